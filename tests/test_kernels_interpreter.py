"""Runs the Triton kernel tests on CPU through the Triton interpreter, in a subprocess.

Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET=1 has
to be set before ``kernels`` launches anything; a separate process keeps that setting out of
every other test module. The child is a plain pytest run of test_kernels_triton.py with one
pinned launch config (PIPER_KERNELS_PIN_CONFIG=1); its exit status is the verdict.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.interpreter

ROOT = Path(__file__).resolve().parents[1]


def test_triton_kernels_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PIPER_KERNELS_PIN_CONFIG="1",
               CUDA_VISIBLE_DEVICES="")  # CPU tensors even on a GPU machine
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpreter",
         str(ROOT / "tests" / "test_kernels_triton.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
