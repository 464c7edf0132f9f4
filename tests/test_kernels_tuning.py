"""Launch-config candidates, the shared-memory model and limits, the autotune cache round
trip, and backend dispatch rules. Fast: no compiles (tests/test_kernels_compile.py, slow tier,
validates the model against triton.compile for every reachable config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model import presets
from piper_kernels import tuning
from piper_kernels.autotune import problems
from piper_kernels.backend import resolve_backend, settings
from piper_kernels.tuning import (
    OPS,
    TARGETS,
    GemmConfig,
    default_config,
    gemm_configs,
    pick,
    problem_key,
    store,
)


@pytest.mark.parametrize("op", ["fwd", "dx", "dw"])
@pytest.mark.parametrize("N,K,E,elem", [(14336, 4096, 8, 2), (2048, 7168, 256, 2), (32, 24, 3, 4)])
@pytest.mark.parametrize("target", [None, *TARGETS])
def test_configs_valid_and_default_first(op: str, N: int, K: int, E: int, elem: int,
                                         target: str | None) -> None:
    cfgs = gemm_configs(op, N, K, E, elem, target)
    assert len(cfgs) == len(set(cfgs)) and 1 <= len(cfgs) <= 12  # short: tuning stays cheap
    assert cfgs[0] == default_config(op, N, K, E, elem)
    for c in cfgs:
        # tl.dot needs every block dim >= 16 and powers of two; stages must fit shared memory.
        for b in (c.block_m, c.block_n, c.block_k):
            assert b >= 16 and b & (b - 1) == 0
        assert c.num_stages >= 2  # the model is validated for 2+ stages only
        for t in [target] if target else TARGETS:
            assert c.max_smem_bytes(op, elem, t) <= TARGETS[t].smem_limit, (c, t)
    if E >= 64:
        assert min(c.block_m for c in cfgs) == 32  # few rows per expert -> short M tiles tried


def test_candidates_grow_with_the_target_limit() -> None:
    # H100's 227 KB holds deeper pipelines than MI250X's 64 KiB: the per-target list is not
    # just the portable one.
    portable = set(gemm_configs("dw", 14336, 4096, 8, 2))
    assert set(gemm_configs("dw", 14336, 4096, 8, 2, "sm90")) - portable
    assert any(c.num_stages == 4 for c in gemm_configs("fwd", 14336, 4096, 8, 2, "sm90"))


def _preset_problems():
    for name in presets.names():
        m = presets.get(name)
        for op, N, K in problems(m.d_model, m.moe_ffn_dim):
            yield name, op, N, K, m.n_routed_experts


@pytest.mark.parametrize("target", list(TARGETS))
def test_pick_fits_every_preset_on_every_target(target: str) -> None:
    limit = TARGETS[target].smem_limit
    n = 0
    for name, op, N, K, E in _preset_problems():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            elem = torch.empty((), dtype=dtype).element_size()
            cfg = pick(op, dtype, N, K, E, torch.device("cpu"), target=target)
            assert cfg.max_smem_bytes(op, elem, target) <= limit, (name, op, dtype, cfg)
            for c in gemm_configs(op, N, K, E, elem, target):
                assert c.max_smem_bytes(op, elem, target) <= limit, (name, op, dtype, c)
            n += 1
    assert n == 3 * 6 * len(presets.names())


# (op, config, elem bytes, target, input precision, bytes triton.compile reported)
# Measured with triton 3.9.0 (tests/test_kernels_compile.py and docs/kernels.md); the first
# rows are the numbers issue 22 reported for the old defaults.
COMPILED = [
    ("dw", GemmConfig(128, 128, 64, 8, 3), 2, "gfx90a", "ieee", 98304),  # old dW default
    ("fwd", GemmConfig(128, 128, 64, 8, 3), 2, "gfx90a", "ieee", 65536),  # fwd default
    ("dw", GemmConfig(128, 128, 32, 8, 3), 4, "sm90", "ieee", 163840),  # old fp32 dW default
    ("fwd", GemmConfig(128, 128, 64, 8, 3), 2, "sm90", "ieee", 98304),
    ("fwd", GemmConfig(64, 128, 64, 4, 4), 2, "sm80", "ieee", 73728),
    ("fwd", GemmConfig(64, 128, 64, 4, 4), 2, "sm90", "ieee", 98304),  # wgmma: all 4 buffers
    ("fwd", GemmConfig(32, 128, 64, 4, 4), 2, "sm90", "ieee", 61440),  # BM=32: no wgmma
    ("dx", GemmConfig(128, 256, 64, 8, 3), 2, "sm90", "ieee", 147456),
    ("dw", GemmConfig(128, 256, 64, 8, 3), 2, "sm80", "ieee", 163840),
    ("dw", GemmConfig(128, 256, 64, 8, 3), 2, "sm90", "ieee", 245760),
    ("dw", GemmConfig(64, 128, 32, 4, 4), 4, "sm90", "tf32", 122880),  # x^T operand: no wgmma
    ("fwd", GemmConfig(64, 128, 32, 4, 4), 4, "sm90", "tf32", 98304),  # tf32 wgmma
    ("dx", GemmConfig(128, 128, 32, 8, 3), 4, "sm90", "tf32", 98304),
    ("fwd", GemmConfig(64, 128, 32, 4, 4), 4, "sm80", "tf32", 73728),
    ("fwd", GemmConfig(128, 128, 64, 8, 2), 2, "gfx942", "ieee", 32768),
    ("dw", GemmConfig(64, 128, 32, 4, 2), 4, "gfx90a", "ieee", 40960),
    ("dw", GemmConfig(128, 256, 32, 8, 3), 4, "gfx90a", "ieee", 294912),
]


@pytest.mark.parametrize("op,cfg,elem,target,prec,compiled", COMPILED)
def test_smem_model_reproduces_compiled_bytes(op, cfg, elem, target, prec, compiled) -> None:
    assert cfg.smem_bytes(op, elem, target, prec) == compiled


def test_unvalidated_target_is_bounded_from_above() -> None:
    # A live GPU outside the validated families (here a made-up sm_100 entry) gets every stage
    # counted: never less than either rule would give.
    sm100 = tuning.Target("sm100", "cuda", 100, 32, 227 * 1024, "test")
    c = GemmConfig(64, 128, 64, 4, 4)
    assert not sm100.validated and all(TARGETS[t].validated for t in TARGETS)
    assert c.smem_bytes("dw", 2, sm100) == (64 * 64 + 64 * 128) * 2 * 4
    assert c.smem_bytes("fwd", 4, sm100) >= c.smem_bytes("fwd", 4, "sm80")


def test_smaller_live_gpu_drops_the_default() -> None:
    # A device reporting less than TARGETS' limits (e.g. a partitioned or future part) gets
    # only configs that fit it, led by the first that does.
    small = tuning.Target("gfx90a", "hip", "gfx90a", 64, 48 * 1024, "test")
    cfgs = gemm_configs("fwd", 14336, 4096, 8, 2, small)
    assert cfgs and default_config("fwd", 14336, 4096, 8, 2) not in cfgs
    assert all(c.smem_bytes("fwd", 2, small) <= 48 * 1024 for c in cfgs)


def test_list_candidates_without_gpu() -> None:
    from model.autotune import list_candidates

    lines = list_candidates("tiny", torch.bfloat16, "gfx90a")
    assert "limit 65536 B" in lines[0] and len(lines) > 6
    for line in lines[1:]:
        assert int(line.rsplit(" B", 1)[0].rsplit(" ", 1)[1]) <= 65536, line


def test_command_line_lists_candidates_and_names_bad_presets(capsys) -> None:
    """`python -m model.autotune` (main) prints what list_candidates returns; an unknown
    preset is a clear error with status 2."""
    from model.autotune import list_candidates, main

    assert main(["--model", "tiny", "--list", "gfx90a"]) == 0
    want = list_candidates("tiny", torch.bfloat16, "gfx90a")
    assert capsys.readouterr().out.splitlines() == want
    assert main(["--model", "no-such-model", "--list", "gfx90a"]) == 2
    assert "model.autotune: " in capsys.readouterr().err


def test_old_defaults_over_mi250x_limit_new_ones_fit() -> None:
    old_dw = GemmConfig(128, 128, 64, 8, 3)
    assert not old_dw.fits("dw", 2, "gfx90a")
    for op in OPS:
        for elem in (2, 4):
            for E in (8, 256):
                d = default_config(op, 14336, 4096, E, elem)
                assert all(d.fits(op, elem, t) for t in TARGETS), (op, elem, E, d)


def test_configs_bad_input() -> None:
    with pytest.raises(ValueError, match="op='bwd'"):
        gemm_configs("bwd", 128, 128, 8)
    with pytest.raises(ValueError, match="E=0"):
        gemm_configs("fwd", 128, 128, 0)
    with pytest.raises(ValueError, match="target='sm70' is unknown; valid: sm80, sm90, gfx90a, gfx942"):
        gemm_configs("fwd", 128, 128, 8, 2, "sm70")
    with pytest.raises(ValueError, match="input_precision='tf64'"):
        GemmConfig(64, 64, 64, 4, 2).smem_bytes("fwd", 4, "sm90", "tf64")
    with pytest.raises(ValueError, match="not a CUDA/ROCm GPU"):
        tuning.device_target(torch.device("cpu"))


def test_explicit_configs_bad_input() -> None:
    from piper_kernels import grouped_gemm, offsets_from_counts

    x, w = torch.randn(6, 4), torch.randn(2, 4, 3)
    offs = offsets_from_counts(torch.tensor([2, 4]))
    with pytest.raises(ValueError, match=r"\['bwd'\] are not ops.*valid keys: fwd, dx, dw"):
        grouped_gemm(x, w, offs, configs={"bwd": tuning.PINNED})
    with pytest.raises(ValueError, match="Triton backend only.*backend='torch'"):
        grouped_gemm(x, w, offs, backend="torch", configs={"fwd": tuning.PINNED})


def test_cache_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    dev = torch.device("cpu")
    win = GemmConfig(64, 256, 64, 8, 4)
    store(path, dev, {problem_key("fwd", torch.bfloat16, 512, 256, 8): win})
    data = json.loads(path.read_text())
    assert list(data) == [tuning.device_key(dev)]  # keyed by device name and Triton version
    # An explicit target ignores stored winners (they belong to a device) and pinning.
    assert pick("fwd", torch.bfloat16, 512, 256, 8, dev, cache_path=path, target="gfx90a") == \
        default_config("fwd", 512, 256, 8, 2)
    if settings().pin_config or settings().interpret:
        pytest.skip("pinned config in this process: stored winners are ignored by design")
    assert pick("fwd", torch.bfloat16, 512, 256, 8, dev, cache_path=path) == win
    # Another problem falls back to the first (default) candidate.
    assert pick("fwd", torch.bfloat16, 512, 256, 16, dev, cache_path=path) == gemm_configs(
        "fwd", 512, 256, 16, 2)[0]


def test_corrupt_cache_falls_back(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    if settings().pin_config or settings().interpret:
        pytest.skip("pinned config in this process")
    got = pick("dw", torch.float16, 64, 64, 4, torch.device("cpu"), cache_path=path)
    assert got == gemm_configs("dw", 64, 64, 4, 2)[0]


def test_backend_resolution() -> None:
    cpu = torch.device("cpu")
    expected = "triton" if settings().interpret else "torch"
    assert resolve_backend(cpu) == expected
    assert resolve_backend(torch.device("cuda", 0)) == "triton"
    assert resolve_backend(cpu, "reference") == "reference"
    with pytest.raises(ValueError, match="valid: triton, torch, reference"):
        resolve_backend(cpu, "cublas")
    if not settings().interpret:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            resolve_backend(cpu, "triton")
