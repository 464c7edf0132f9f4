"""Shared test set-up: determinism, hypothesis profile, and a torchrun launcher."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
# Measured CPU platforms (2 and 4 processes on this 2-core VM), frozen for the tests: the
# validation record's own files (benchmarks/results/tuner_validate_platform_w*.toml) are
# replaced by every record, and a verdict that depends on measured numbers moves with them.
CPU_W2 = ROOT / "tests" / "data" / "cpu_platform_w2.toml"
CPU_W4 = ROOT / "tests" / "data" / "cpu_platform_w4.toml"

# The CI machine has 2 shared cores: wall-clock deadlines would make property tests flaky.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def toy_platform():
    """A hand-sized GPU-like platform for estimate tests whose expected steps are computed by
    hand (100 TFLOPS at one efficiency of 0.5, microsecond latencies)."""
    from tuner import Platform

    return Platform(
        name="toy", peak_flops=100e12, hbm_bytes=80e9, gpus_per_node=4, nic_bandwidth=10e9,
        nics_per_node=2, intra_node_bandwidth=100e9, gemm_efficiency=0.5,
        grouped_gemm_efficiency=0.5, attention_efficiency=0.5, hbm_bandwidth=1e12,
        intra_node_latency=1e-6, network_latency=1e-5,
    )


def toy_moe_config():
    """The 4-layer all-MoE model the toy-platform tests price by hand (V 16, D 64)."""
    from model import ModelConfig

    return ModelConfig(vocab_size=16, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4,
                       n_routed_experts=8, top_k=2, moe_ffn_dim=32)


def toy_head_seconds(plan) -> float:
    """The lm_head's forward seconds of one micro-batch of `toy_moe_config` on `toy_platform`,
    by hand: 2 V D t FLOPs at the toy's single GEMM efficiency (0.5) of its 100 TFLOPS."""
    t = plan.global_batch * plan.seq_len / (plan.microbatches * plan.n_gpus // plan.pp)
    return 2 * 16 * 64 * t / (100e12 * 0.5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def netns_works() -> bool:
    """Whether this process can create network namespaces (root, iproute2, tc)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    name = f"pmoe-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stdlib_corpus(path: Path, n_files: int, n_bytes: int) -> str:
    """A small text file for fast training runs: the first `n_bytes` of the first `n_files` of
    the default corpus (the standard library sources, sorted)."""
    from trainer.data import default_corpus_files

    path.write_bytes(b"".join(f.read_bytes() for f in default_corpus_files()[:n_files])[:n_bytes])
    return str(path)


def value_errors(calls) -> list[str]:
    """The ValueError message of each call ("" for a call that did not raise one)."""
    errors = []
    for call in calls:
        try:
            call()
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def step_losses(out: Path) -> dict[int, float]:
    """{step: training loss} from a run's metrics.jsonl (event rows skipped)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> str:
    """The multi-process trainer tests' corpus: 400 kB of the first 40 stdlib sources, written
    once per session."""
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 40, 400_000)


def base_env() -> dict[str, str]:
    """The environment train.py runs get: this one without TRITON_INTERPRET, one OpenMP thread
    unless set (train.py sets its own thread count)."""
    e = dict(os.environ)
    e.pop("TRITON_INTERPRET", None)
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run_train(args: list[str], nproc: int = 1, timeout: float = 600,
              env: dict[str, str] | None = None,
              launcher: str = "fork") -> subprocess.CompletedProcess:
    """Run train.py from the repository root: a fork of this test process's zygote (tests/
    zygote.py: one interpreter that imported torch and the trainer once) that runs it as
    `python train.py` would, with nproc > 1 as forked ranks (tests/forklaunch.py: torchrun's
    worker environment and failure handling, without its per-process start-up); or, with
    launcher="torchrun", through torchrun itself. PIPER_TEST_ZYGOTE=0 starts a fresh
    interpreter per run instead (what the zygote saves: ~5 s of CPU per run on 2 cores)."""
    if launcher not in ("fork", "torchrun"):
        raise ValueError(f"launcher={launcher!r}: use 'fork' or 'torchrun'")
    base = base_env()
    e = {**base, **(env or {})}
    if launcher == "fork" and os.environ.get("PIPER_TEST_ZYGOTE", "1") == "1":
        from zygote import Zygote  # a fork of one pre-imported interpreter per run

        zyg = Zygote.shared(base)
        if zyg.accepts(e):
            return zyg.run(args, nproc, free_port(), e, timeout)
    if nproc > 1 and launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "train.py", *args]
    elif nproc > 1:
        cmd = [sys.executable, str(ROOT / "tests" / "forklaunch.py"), str(nproc),
               str(free_port()), *args]
    else:
        cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def train_ok(args: list[str], out: Path, nproc: int = 1) -> Path:
    """run_train with --train.out_dir=out; fails the test with the run's output tails."""
    r = run_train([*args, f"--train.out_dir={out}"], nproc=nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


@pytest.fixture
def train_runner():
    return run_train
