"""Small helpers shared by the benchmark scripts (imported as `_common`: every script runs with
its own folder on sys.path)."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["cpu_name", "git_sha"]


@functools.cache
def git_sha() -> str:
    """Short SHA of the checkout's HEAD, recorded with every result row; "unknown" without git.
    Looked up once per run (scripts call it per row)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


@functools.cache
def cpu_name() -> str:
    """The host CPU's model name (/proc/cpuinfo), recorded with benchmark rows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
