"""Launch configs for the Triton kernels: targets and their shared-memory limits, the
shared-memory model, the candidate lists, the pinned config, the JSON cache.

Legend: M token-sorted rows, K in features, N out features, E experts.

Candidates depend only on (N, K, E), the sizes that move the optimum (docs/architecture.md,
"Conventions"); M changes every step and is deliberately not a key. Winners measured by
``python -m model.autotune`` are stored per (device name, Triton version) in one JSON file and
looked up at launch; without a stored winner the first candidate (a safe default) is used.

Shared memory (LDS on AMD). A config the target cannot hold fails at launch (Triton compares
the kernel's ``metadata.shared`` with the device's per-block limit), so every config offered
here is checked against a model of what ``triton.compile`` allocates (validated against the
compiled kernels for sm_80, sm_90, gfx90a and gfx942 in ``tests/test_kernels_compile.py``;
docs/kernels.md has the table). Both GEMM kernels stage one A and one B tile of the dot per
pipeline buffer and keep the fp32 accumulator in registers:

    bytes = (dot_M * dot_K + dot_K * dot_N) * elem_bytes * buffers
    fwd, dx: dot [BLOCK_M x BLOCK_K] @ [BLOCK_K x BLOCK_N]      (x or dy rows times w[e])
    dw:      dot [BLOCK_K x BLOCK_M] @ [BLOCK_M x BLOCK_N]      (x^T times dy; BLOCK_M reduces)
    buffers = num_stages      on sm_90 when the dot lowers to wgmma (dot_M >= 64, and 16-bit
                              inputs or tf32 on fwd/dx: dw's x^T operand is M-major, which
                              tf32 wgmma cannot read)
            = num_stages - 1  otherwise (mma.sync on sm_80, FMA for fp32 "ieee", AMD's stream
                              pipeliner; at least 1)
            = num_stages      on a live GPU outside those families (sm_100, gfx950, ...):
                              not validated, so the larger of the two (a safe upper bound)

The epilogue's layout conversion reuses the freed pipeline buffers, so it adds nothing.
``num_stages=1`` is over-estimated on AMD (the compiler stages only the B tile there); no
candidate uses it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from piper_kernels.backend import settings

OPS = ("fwd", "dx", "dw")
PRECISIONS = ("ieee", "tf32")
# Row-tiles that sweep the N-tiles together in the forward kernel's grouped tile order.
GROUP_M = 8


@dataclass(frozen=True)
class Target:
    """A compile target and the shared memory (bytes) one program (CTA / workgroup) may use."""

    name: str  # "sm90", "gfx90a", ...
    backend: str  # triton backend: "cuda" or "hip"
    arch: int | str  # 90 (compute capability) or "gfx90a"
    warp_size: int
    smem_limit: int
    source: str  # where smem_limit comes from

    @property
    def validated(self) -> bool:
        """Whether the model below was checked against triton.compile for this arch family
        (sm_80-sm_90, gfx90a, gfx942); elsewhere it assumes every stage is buffered (an upper
        bound of both rules)."""
        if self.backend == "cuda":
            return isinstance(self.arch, int) and 80 <= self.arch < 100
        return self.arch in ("gfx90a", "gfx942")

    @property
    def wgmma(self) -> bool:
        """Hopper's warp-group MMA; its pipeline keeps all num_stages buffers in flight."""
        return self.backend == "cuda" and isinstance(self.arch, int) and 90 <= self.arch < 100


# Per-block limits. Triton's launcher compares metadata.shared with the driver's opt-in maximum
# per block (cuda: CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN; hip: the device's
# shared memory per block), which is what these numbers are; on a live device the driver's
# value is used instead (device_target).
TARGETS: dict[str, Target] = {
    "sm80": Target("sm80", "cuda", 80, 32, 163 * 1024,
                   "NVIDIA Ampere Tuning Guide, 'Unified Shared Memory/L1/Texture Cache': A100 "
                   "has up to 164 KB per SM; CUDA reserves 1 KB per block, so one block can "
                   "address up to 163 KB"),
    "sm90": Target("sm90", "cuda", 90, 32, 227 * 1024,
                   "NVIDIA Hopper Tuning Guide, 'Unified Shared Memory/L1/Texture Cache': H100 "
                   "has up to 228 KB per SM; one block can address up to 227 KB (1 KB reserved)"),
    "gfx90a": Target("gfx90a", "hip", "gfx90a", 64, 64 * 1024,
                     "ROCm docs, 'AMD GPU specifications' table: MI250X/MI250/MI210 (LLVM target "
                     "gfx90a) have 64 KiB of LDS per CU, all of it addressable by one workgroup"),
    "gfx942": Target("gfx942", "hip", "gfx942", 64, 64 * 1024,
                     "ROCm docs, 'AMD GPU specifications' table: MI300X/MI325X (LLVM target "
                     "gfx942) have 64 KiB of LDS per CU"),
}


def resolve_target(target: Target | str) -> Target:
    if isinstance(target, Target):
        return target
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is unknown; valid: {', '.join(TARGETS)}")
    return TARGETS[target]


@dataclass(frozen=True)
class GemmConfig:
    """One launch config. For "dw" BLOCK_M is the reduction (row) block."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def dot_tiles(self, op: str) -> tuple[int, int, int]:
        """(dot_M, dot_K, dot_N): the block shape of the kernel's ``tl.dot`` for ``op``."""
        if op not in OPS:
            raise ValueError(f"op={op!r} is unknown; valid: {', '.join(OPS)}")
        if op == "dw":
            return self.block_k, self.block_m, self.block_n
        return self.block_m, self.block_k, self.block_n

    def smem_bytes(self, op: str, elem_bytes: int, target: Target | str,
                   input_precision: str = "ieee") -> int:
        """Shared memory (LDS) ``triton.compile`` allocates for ``op`` with this config on
        ``target`` (the model in the module docstring)."""
        t = resolve_target(target)
        if input_precision not in PRECISIONS:
            raise ValueError(f"input_precision={input_precision!r} is unknown; valid: "
                             f"{', '.join(PRECISIONS)}")
        m, k, n = self.dot_tiles(op)
        wgmma = t.wgmma and m >= 64 and (
            elem_bytes == 2 or (input_precision == "tf32" and op != "dw"))
        if wgmma or not t.validated:
            buffers = self.num_stages
        else:
            buffers = max(1, self.num_stages - 1)
        return (m * k + k * n) * elem_bytes * buffers

    def max_smem_bytes(self, op: str, elem_bytes: int, target: Target | str) -> int:
        """Largest allocation over the input precisions a launch may use: fp32 follows
        torch's tf32 switch at launch time, so both are allowed for."""
        precs = PRECISIONS if elem_bytes == 4 and resolve_target(target).backend == "cuda" else ("ieee",)
        return max(self.smem_bytes(op, elem_bytes, target, p) for p in precs)

    def fits(self, op: str, elem_bytes: int, target: Target | str) -> bool:
        t = resolve_target(target)
        return self.max_smem_bytes(op, elem_bytes, t) <= t.smem_limit


# Interpreter runs and the escape hatch: smallest tiles tl.dot accepts (16) would multiply the
# number of interpreted steps; 32 keeps tiny test shapes to a few tiles per expert.
PINNED = GemmConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)

# Pipeline depths tried per warp count, deepest first; a tile gets the deepest that fits.
_STAGES = {4: (4, 3, 2), 8: (3, 2)}


def _targets(target: Target | str | None) -> list[Target]:
    return list(TARGETS.values()) if target is None else [resolve_target(target)]


def _deepest(op: str, bm: int, bn: int, bk: int, warps: int, elem_bytes: int,
             targets: list[Target]) -> GemmConfig | None:
    for stages in _STAGES[warps]:
        c = GemmConfig(bm, bn, bk, warps, stages)
        if all(c.fits(op, elem_bytes, t) for t in targets):
            return c
    return None


def default_config(op: str, N: int, K: int, E: int, elem_bytes: int = 2) -> GemmConfig:
    """The config used without a stored winner: the same on every target, and it fits all
    of TARGETS (MI250X's 64 KiB of LDS is the tightest).

    fwd/dx: 128x128 tiles (64 rows when E >= 64: few rows per expert); dw: a 64-row reduction
    block (32 when E >= 64) under a BLOCK_K x 128 output tile, which needs half the LDS of the
    old 128-row block (98,304 B on gfx90a, over its 65,536).
    """
    _check(op, N, K, E, elem_bytes)
    small_m = E >= 64
    bn = 64 if N <= 64 else 128
    bk = 64 if elem_bytes <= 2 else 32
    if op == "dw":
        bm = 32 if small_m else 64
    else:
        bm = 64 if small_m else 128
    c = _deepest(op, bm, bn, bk, 8, elem_bytes, list(TARGETS.values()))
    assert c is not None, (op, bm, bn, bk, elem_bytes)  # 2 stages of these tiles fit 64 KiB
    return c


def _check(op: str, N: int, K: int, E: int, elem_bytes: int) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is unknown; valid: {', '.join(OPS)}")
    for name, v in (("N", N), ("K", K), ("E", E), ("elem_bytes", elem_bytes)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")


def gemm_configs(op: str, N: int, K: int, E: int, elem_bytes: int = 2,
                 target: Target | str | None = None) -> list[GemmConfig]:
    """Autotune candidates for ``op`` ("fwd", "dx", "dw") on an (N, K, E) problem; default first.

    Every candidate fits ``target``'s shared memory (``target=None``: every target in TARGETS).
    Kept short (at most 12) so tuning one preset stays within a minute or two of compiles:
    many experts (E >= 64) mean few rows per expert, so a 32-row BLOCK_M joins the list (less
    waste on partial tiles); N <= 64 drops the wide N tiles that would be mostly masked;
    4-byte inputs get a 32-deep K block. Each tile shape gets the deepest pipeline of
    ``_STAGES`` that fits (on gfx90a/gfx942 that is often 2 stages, one LDS buffer).
    """
    _check(op, N, K, E, elem_bytes)
    targets = _targets(target)
    small_m = E >= 64
    bms = (32, 64, 128) if small_m else (64, 128)
    bns = (64,) if N <= 64 else (128, 256)
    bk = 64 if elem_bytes <= 2 else 32
    out: list[GemmConfig] = []
    for bm in bms:
        for bn in bns:
            for warps in (4, 8):
                if bm * bn >= 128 * 256 and warps == 4:
                    continue  # a 128x256 fp32 accumulator spills with 4 warps
                c = _deepest(op, bm, bn, bk, warps, elem_bytes, targets)
                if c is not None:
                    out.append(c)
    default = default_config(op, N, K, E, elem_bytes)
    # The default fits TARGETS by construction; a live GPU outside them (device_target) may
    # be smaller, and then its first fitting candidate leads instead.
    head = [default] if all(default.fits(op, elem_bytes, t) for t in targets) else []
    return head + [c for c in out if c != default]


@functools.cache
def device_target(device: torch.device) -> Target:
    """The Target of a live GPU: its arch from torch, its limit from Triton's driver (the very
    number Triton's launcher checks ``metadata.shared`` against)."""
    if device.type != "cuda":
        raise ValueError(f"device {device} is not a CUDA/ROCm GPU; valid targets without one: "
                         f"{', '.join(TARGETS)} (pass target=)")
    from triton.runtime import driver

    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    limit = int(driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    if torch.version.hip:
        arch: int | str = props.gcnArchName.split(":")[0]
        backend, warp = "hip", 64 if str(arch).startswith("gfx9") else 32
    else:
        arch, backend, warp = props.major * 10 + props.minor, "cuda", 32
    return Target(f"sm{arch}" if backend == "cuda" else str(arch), backend, arch, warp, limit,
                  f"driver max_shared_mem of {torch.cuda.get_device_name(idx)}")


@functools.cache
def device_key(device: torch.device) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{name}|triton-{triton.__version__}"


def problem_key(op: str, dtype: torch.dtype, N: int, K: int, E: int) -> str:
    return f"{op}|{str(dtype).removeprefix('torch.')}|N={N}|K={K}|E={E}"


def default_cache_path() -> Path:
    cache_path = settings().cache_path
    if cache_path:
        return Path(cache_path)
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
         cache_path: Path | None = None, target: Target | str | None = None) -> GemmConfig:
    """The config a launch uses: pinned, else the stored winner, else the default candidate.

    ``target`` (a name in TARGETS or a Target) asks what a launch on that GPU would use without
    a stored winner, whatever this process runs on (pinning and the interpreter ignored): how
    tests run the real configs under the interpreter and check them against every target.
    A stored winner that does not fit the device (a stale or hand-edited cache) is ignored.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    if target is not None:
        resolve_target(target)
        return default_config(op, N, K, E, elem)
    s = settings()
    if s.pin_config or s.interpret:
        return PINNED
    stored = _load(str(cache_path or default_cache_path())).get(device_key(device), {})
    hit = stored.get(problem_key(op, dtype, N, K, E))
    if hit is not None:
        cfg = GemmConfig(**hit)
        if device.type != "cuda" or cfg.fits(op, elem, device_target(device)):
            return cfg
    if device.type == "cuda":
        fitting = gemm_configs(op, N, K, E, elem, device_target(device))
        if not fitting:
            t = device_target(device)
            raise ValueError(f"no grouped-GEMM config for {op} fits {t.name}'s "
                             f"{t.smem_limit} B of shared memory per block")
        return fitting[0]
    return default_config(op, N, K, E, elem)
