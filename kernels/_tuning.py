"""Launch configs for the Triton kernels: the candidate lists, the pinned config, the JSON cache.

Legend: M token-sorted rows, K in features, N out features, E experts.

Candidates depend only on (N, K, E), the sizes that move the optimum (STYLE.md "Kernels" 4);
M changes every step and is deliberately not a key. Winners measured by
``python -m kernels.autotune`` are stored per (device name, Triton version) in one JSON file and
looked up at launch; without a stored winner the first candidate (a safe default) is used.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels._backend import settings

OPS = ("fwd", "dx", "dw")


@dataclass(frozen=True)
class GemmConfig:
    """One launch config. For "dw" BLOCK_M is the reduction (row) block."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def smem_bytes(self, elem_bytes: int) -> int:
        # One A and one B tile per pipeline stage; the accumulator lives in registers.
        return (self.block_m * self.block_k + self.block_k * self.block_n) * elem_bytes * self.num_stages


# Interpreter runs and the escape hatch: smallest tiles tl.dot accepts (16) would multiply the
# number of interpreted steps; 32 keeps tiny test shapes to a few tiles per expert.
PINNED = GemmConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)


def gemm_configs(op: str, N: int, K: int, E: int, elem_bytes: int = 2) -> list[GemmConfig]:
    """Autotune candidates for ``op`` ("fwd", "dx", "dw") on an (N, K, E) problem; default first.

    Kept short (about 8-12) so tuning one preset stays within a minute or two of compiles:
    many experts (E >= 64) mean few rows per expert, so a 32-row BLOCK_M joins the list (less
    waste on partial tiles); N <= 64 drops the wide N tiles that would be mostly masked;
    4-byte inputs get a 32-deep K block so stages fit in shared memory.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is unknown; valid: {', '.join(OPS)}")
    for name, v in (("N", N), ("K", K), ("E", E), ("elem_bytes", elem_bytes)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    small_m = E >= 64
    bms = (32, 64, 128) if small_m else (64, 128)
    bns = (64,) if N <= 64 else (128, 256)
    bk = 64 if elem_bytes <= 2 else 32
    out: list[GemmConfig] = []
    for bm in bms:
        for bn in bns:
            for warps, stages in ((4, 4), (8, 3)):
                if bm * bn >= 128 * 256 and warps == 4:
                    continue  # a 128x256 fp32 accumulator spills with 4 warps
                c = GemmConfig(bm, bn, bk, warps, stages)
                # 200 KB leaves headroom under H100/H200's 228 KB of shared memory per SM.
                if c.smem_bytes(elem_bytes) <= 200 * 1024:
                    out.append(c)
    default = GemmConfig(64 if small_m else 128, min(128, bns[0]), bk, 8, 3)
    return [default] + [c for c in out if c != default]


@functools.cache
def device_key(device: torch.device) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{name}|triton-{triton.__version__}"


def problem_key(op: str, dtype: torch.dtype, N: int, K: int, E: int) -> str:
    return f"{op}|{str(dtype).removeprefix('torch.')}|N={N}|K={K}|E={E}"


def default_cache_path() -> Path:
    if settings().cache_path:
        return Path(settings().cache_path)
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "piper-moe" / "kernels-autotune.json"


@functools.cache
def _load(path: str) -> dict[str, dict[str, dict[str, int]]]:
    p = Path(path)
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        # A corrupt cache must not stop training: fall back to defaults (autotune rewrites it).
        return {}


def store(path: Path, device: torch.device, winners: dict[str, GemmConfig]) -> None:
    """Merge ``winners`` (problem key -> config) into the cache file for this device."""
    data = dict(_load(str(path)))
    section = dict(data.get(device_key(device), {}))
    section.update({k: asdict(v) for k, v in winners.items()})
    data[device_key(device)] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    _load.cache_clear()


def pick(op: str, dtype: torch.dtype, N: int, K: int, E: int, device: torch.device,
         cache_path: Path | None = None) -> GemmConfig:
    """The config a launch uses: pinned, else the stored winner, else the default candidate."""
    s = settings()
    if s.pin_config or s.interpret:
        return PINNED
    stored = _load(str(cache_path or default_cache_path())).get(device_key(device), {})
    hit = stored.get(problem_key(op, dtype, N, K, E))
    if hit is not None:
        return GemmConfig(**hit)
    return gemm_configs(op, N, K, E, torch.empty((), dtype=dtype).element_size())[0]
