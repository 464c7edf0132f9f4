"""Small helpers shared by the benchmark scripts (imported as `_common`: every script runs with
its own folder on sys.path)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["git_sha"]


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
