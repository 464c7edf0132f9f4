"""The kernel autotuner's command line: a model preset's expert shapes -> `piper_kernels.autotune`.

    python -m model.autotune --model mixtral-8x7b [--tokens 8192] [--dtype bfloat16]
                               [--cache PATH] [--max-configs 12]
    python -m model.autotune --model mixtral-8x7b --list gfx90a   # no GPU needed

It lives here, above `piper_kernels`, because it reads `model.presets`; `piper_kernels.autotune` does the
timing and knows only shapes (D d_model, F moe_ffn_dim, E routed experts, k top-k).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from piper_kernels import autotune as _kernel_autotune
from piper_kernels.tuning import TARGETS, GemmConfig, default_cache_path

from . import presets

__all__ = ["list_candidates", "main", "tune"]


def tune(model: str, tokens: int, dtype: torch.dtype, max_configs: int,
         device: torch.device, cache: Path) -> dict[str, GemmConfig]:
    """`piper_kernels.autotune.tune` for the expert shapes of preset `model` (KeyError if unknown)."""
    cfg = presets.get(model)
    return _kernel_autotune.tune(model, cfg.d_model, cfg.moe_ffn_dim, cfg.n_routed_experts,
                                 cfg.top_k, tokens, dtype, max_configs, device, cache)


def list_candidates(model: str, dtype: torch.dtype, target: str) -> list[str]:
    """`piper_kernels.autotune.list_candidates` for the expert shapes of preset `model`."""
    cfg = presets.get(model)
    return _kernel_autotune.list_candidates(model, cfg.d_model, cfg.moe_ffn_dim,
                                            cfg.n_routed_experts, dtype, target)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.autotune",
                                description=_kernel_autotune.__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model.presets name, e.g. mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step per GPU (rows = tokens*top_k)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--cache", type=Path, default=None, help=f"JSON cache (default {default_cache_path()}; launches read a non-default one when PIPER_KERNELS_CACHE names it)")
    p.add_argument("--max-configs", type=int, default=12, help="candidates tried per problem")
    p.add_argument("--list", choices=list(TARGETS), default=None, metavar="TARGET",
                   help=f"print the candidates for TARGET ({', '.join(TARGETS)}) and exit")
    args = p.parse_args(argv)
    if args.list:
        try:
            print("\n".join(list_candidates(args.model, getattr(torch, args.dtype), args.list)))
        except KeyError as exc:
            print(f"model.autotune: {exc}", file=sys.stderr)
            return 2
        return 0
    if not torch.cuda.is_available():
        print("model.autotune: no CUDA/ROCm GPU visible; autotuning measures a GPU, nothing "
              "to do on this machine", file=sys.stderr)
        return 2
    if args.tokens < 1 or args.max_configs < 1:
        p.error(f"--tokens={args.tokens} and --max-configs={args.max_configs} must be >= 1")
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    path = args.cache or default_cache_path()
    try:
        winners = tune(args.model, args.tokens, getattr(torch, args.dtype), args.max_configs,
                       device, path)
    except KeyError as exc:
        print(f"model.autotune: {exc}", file=sys.stderr)
        return 2
    print(f"stored {len(winners)} winners in {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
