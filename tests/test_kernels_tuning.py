"""Launch-config candidates, the autotune cache round trip, and backend dispatch rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels import _backend, _tuning
from kernels._tuning import GemmConfig, gemm_configs, pick, problem_key, store


@pytest.mark.parametrize("op", ["fwd", "dx", "dw"])
@pytest.mark.parametrize("N,K,E,elem", [(14336, 4096, 8, 2), (2048, 7168, 256, 2), (32, 24, 3, 4)])
def test_configs_valid_and_default_first(op: str, N: int, K: int, E: int, elem: int) -> None:
    cfgs = gemm_configs(op, N, K, E, elem)
    assert len(cfgs) == len(set(cfgs)) and 1 <= len(cfgs) <= 12  # short: tuning stays cheap
    for c in cfgs:
        # tl.dot needs every block dim >= 16 and powers of two; stages must fit shared memory.
        for b in (c.block_m, c.block_n, c.block_k):
            assert b >= 16 and b & (b - 1) == 0
        assert c.smem_bytes(elem) <= 200 * 1024
    if E >= 64:
        assert min(c.block_m for c in cfgs) == 32  # few rows per expert -> short M tiles tried


def test_configs_bad_input() -> None:
    with pytest.raises(ValueError, match="op='bwd'"):
        gemm_configs("bwd", 128, 128, 8)
    with pytest.raises(ValueError, match="E=0"):
        gemm_configs("fwd", 128, 128, 0)


def test_cache_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    dev = torch.device("cpu")
    win = GemmConfig(64, 256, 64, 8, 4)
    store(path, dev, {problem_key("fwd", torch.bfloat16, 512, 256, 8): win})
    data = json.loads(path.read_text())
    assert list(data) == [_tuning.device_key(dev)]  # keyed by device name and Triton version
    if _backend.settings().pin_config or _backend.settings().interpret:
        pytest.skip("pinned config in this process: stored winners are ignored by design")
    assert pick("fwd", torch.bfloat16, 512, 256, 8, dev, cache_path=path) == win
    # Another problem falls back to the first (default) candidate.
    assert pick("fwd", torch.bfloat16, 512, 256, 16, dev, cache_path=path) == gemm_configs(
        "fwd", 512, 256, 16, 2)[0]


def test_corrupt_cache_falls_back(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    if _backend.settings().pin_config or _backend.settings().interpret:
        pytest.skip("pinned config in this process")
    got = pick("dw", torch.float16, 64, 64, 4, torch.device("cpu"), cache_path=path)
    assert got == gemm_configs("dw", 64, 64, 4, 2)[0]


def test_backend_resolution() -> None:
    cpu = torch.device("cpu")
    expected = "triton" if _backend.settings().interpret else "torch"
    assert _backend.resolve_backend(cpu) == expected
    assert _backend.resolve_backend(torch.device("cuda", 0)) == "triton"
    assert _backend.resolve_backend(cpu, "reference") == "reference"
    with pytest.raises(ValueError, match="valid: triton, torch, reference"):
        _backend.resolve_backend(cpu, "cublas")
    if not _backend.settings().interpret:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            _backend.resolve_backend(cpu, "triton")
