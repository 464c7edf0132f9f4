"""Tune the grouped GEMM kernels for one model's expert shapes on this GPU and cache the winners.

    python -m model.autotune --model mixtral-8x7b [--tokens 8192] [--dtype bfloat16]
                               [--cache PATH] [--max-configs 12]
    python -m model.autotune --model mixtral-8x7b --list gfx90a   # no GPU needed

Legend: D d_model, F moe_ffn_dim, E routed experts, k top-k, M = tokens * k rows.

The expert SwiGLU runs six grouped GEMM problems per step, each keyed by (op, dtype, N, K, E):
fwd w1/w3 (K=D, N=F) and w2 (K=F, N=D); dx of those (same kernel on w^T: N and K swap);
dw of those (a grouped reduction over rows). For each, every candidate of
``piper_kernels.tuning.gemm_configs`` is timed with ``triton.testing.do_bench`` on balanced routing
(M / E rows per expert) and the fastest is stored in the JSON cache under
"<device name>|triton-<version>"; ``grouped_gemm`` reads that cache at launch. Candidates are
only those whose modelled shared memory fits the GPU (``piper_kernels.tuning``). ``--list TARGET``
prints the candidates for a target (sm80, sm90, gfx90a, gfx942) with their modelled bytes and
the limit, without a GPU. Without a GPU (and without ``--list``) this says so and exits with
status 2.

The command line turns a preset name into those shapes, so it lives in `model.autotune` (above
kernels: kernels never imports model): `python -m model.autotune`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from piper_kernels.tuning import (
    TARGETS,
    GemmConfig,
    device_target,
    gemm_configs,
    problem_key,
    store,
)


def problems(D: int, F: int) -> list[tuple[str, int, int]]:
    """(op, N, K) of the expert SwiGLU's grouped GEMMs; w1 and w3 share a shape."""
    return [("fwd", F, D), ("fwd", D, F), ("dx", D, F), ("dx", F, D), ("dw", F, D), ("dw", D, F)]


def _bench(op: str, cfg: GemmConfig, M: int, N: int, K: int, E: int, dtype: torch.dtype,
           device: torch.device) -> float:
    """Median milliseconds of one launch of ``op`` with ``cfg`` (balanced routing)."""
    import triton.testing

    from piper_kernels import grouped_gemm_triton as tri

    counts = torch.full((E,), M // E, dtype=torch.long)
    counts[: M - int(counts.sum())] += 1
    offs = torch.cumsum(counts, 0, dtype=torch.int32).to(device)
    if op == "fwd":
        x = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(E, K, N, device=device, dtype=dtype)
        fn = lambda: tri.gmm(x, w, offs, config=cfg)  # noqa: E731
    elif op == "dx":
        dy = torch.randn(M, K, device=device, dtype=dtype)  # the dx GEMM reads dy [M, F]
        w = torch.randn(E, N, K, device=device, dtype=dtype)  # w [E, D, F] seen transposed
        fn = lambda: tri.gmm_dx(dy, w, offs, config=cfg)  # noqa: E731
    else:
        x = torch.randn(M, K, device=device, dtype=dtype)
        dy = torch.randn(M, N, device=device, dtype=dtype)
        fn = lambda: tri.gmm_dw(x, dy, offs, config=cfg)  # noqa: E731
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def tune(name: str, D: int, F: int, E: int, k: int, tokens: int, dtype: torch.dtype,
         max_configs: int, device: torch.device, cache: Path) -> dict[str, GemmConfig]:
    """Time the candidates of every problem of the expert shape (D, F, E, k) at `tokens`
    tokens (M = tokens * k rows); each winner is stored as soon as it is known, so a run cut
    short by a time limit keeps what it finished. `name` labels the printout."""
    M = tokens * k
    elem = torch.empty((), dtype=dtype).element_size()
    winners: dict[str, GemmConfig] = {}
    target = device_target(device)  # candidates that fit this GPU's shared memory only
    print(f"{name}: D={D} F={F} E={E} k={k} M={M} {dtype} on {torch.cuda.get_device_name(device)} "
          f"({target.name}, {target.smem_limit} B shared memory per block)")
    for op, N, K in problems(D, F):
        key = problem_key(op, dtype, N, K, E)
        if key in winners:
            continue
        results = []
        for c in gemm_configs(op, N, K, E, elem, target)[:max_configs]:
            try:
                ms = _bench(op, c, M, N, K, E, dtype, device)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                print(f"  {key}: {c} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            results.append((ms, c))
        if not results:
            print(f"  {key}: no candidate ran; keeping the default", file=sys.stderr)
            continue
        results.sort(key=lambda r: r[0])
        ms, best = results[0]
        default_ms = next((m for m, c in results if c == gemm_configs(op, N, K, E, elem, target)[0]), ms)
        flops = 2.0 * M * N * K
        print(f"  {key}: best {best} {ms:.3f} ms ({flops / ms / 1e9:.1f} TFLOPS), "
              f"default {default_ms:.3f} ms, {len(results)} configs")
        winners[key] = best
        store(cache, device, {key: best})
    return winners


def list_candidates(name: str, D: int, F: int, E: int, dtype: torch.dtype,
                    target: str) -> list[str]:
    """One line per (problem, candidate): config, modelled shared memory, the target's limit."""
    t = TARGETS[target]
    elem = torch.empty((), dtype=dtype).element_size()
    lines = [f"{name} {dtype} on {t.name}: limit {t.smem_limit} B per block ({t.source})"]
    for op, N, K in problems(D, F):
        for i, c in enumerate(gemm_configs(op, N, K, E, elem, t)):
            lines.append(f"  {problem_key(op, dtype, N, K, E)}: {c} "
                         f"{c.max_smem_bytes(op, elem, t)} B{' (default)' if i == 0 else ''}")
    return lines


if __name__ == "__main__":
    # The command line needs a preset's shapes, so it lives above kernels, in model.autotune;
    # kernels never imports model, not even here.
    sys.exit("the kernel autotuner's command line is `python -m model.autotune --model PRESET` "
             "(it reads model.presets); piper_kernels.autotune.tune takes the shapes directly")
