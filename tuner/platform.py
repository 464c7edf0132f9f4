"""Platform descriptions: what one accelerator and its interconnect can do.

A `Platform` is plain data read from `configs/platforms/<name>.toml`. Files use human units
(TFLOPS, GB = 1e9 bytes, GB/s per direction, microseconds); the dataclass holds SI units
(FLOP/s, bytes, bytes/s, seconds) so the analytic model never converts. Values that are not
published are documented in each file as assumed parameters; `python -m tuner measure` writes
`local.toml` with every value measured on this machine.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Platform", "PLATFORM_DIR", "load_platform", "platform_names"]

PLATFORM_DIR = Path(__file__).resolve().parents[1] / "configs" / "platforms"

# (toml section, toml key, dataclass field, factor to SI)
_FIELDS: tuple[tuple[str, str, str, float], ...] = (
    ("compute", "peak_tflops", "peak_flops", 1e12),
    ("compute", "gemm_efficiency", "gemm_efficiency", 1.0),
    ("compute", "grouped_gemm_efficiency", "grouped_gemm_efficiency", 1.0),
    ("compute", "attention_efficiency", "attention_efficiency", 1.0),
    ("compute", "layer_overhead_us", "layer_overhead", 1e-6),
    ("memory", "hbm_gb", "hbm_bytes", 1e9),
    ("memory", "hbm_bandwidth_gbs", "hbm_bandwidth", 1e9),
    ("memory", "usable_fraction", "usable_fraction", 1.0),
    ("node", "gpus_per_node", "gpus_per_node", 1),
    ("node", "nodes_per_domain", "nodes_per_domain", 1),
    ("node", "nodes_per_group", "nodes_per_group", 1),
    ("node", "intra_node_bandwidth_gbs", "intra_node_bandwidth", 1e9),
    ("node", "intra_node_latency_us", "intra_node_latency", 1e-6),
    ("network", "nics_per_node", "nics_per_node", 1),
    ("network", "nic_bandwidth_gbs", "nic_bandwidth", 1e9),
    ("network", "network_latency_us", "network_latency", 1e-6),
    ("network", "nonminimal_route_share", "nonminimal_route_share", 1.0),
)
_INT_FIELDS = {"gpus_per_node", "nodes_per_domain", "nodes_per_group", "nics_per_node"}
_FRACTIONS = {
    "gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "usable_fraction",
}


@dataclass(frozen=True)
class Platform:
    """One machine type. Bandwidths are per direction; `intra_node_bandwidth` is the effective
    per-device injection rate of a uniform all-to-all inside one node, `nic_bandwidth` the
    rate of one NIC (a node has `nics_per_node`, shared by its `gpus_per_node` devices)."""

    name: str
    peak_flops: float  # dense bf16 matrix peak per device, FLOP/s
    hbm_bytes: float
    gpus_per_node: int
    nic_bandwidth: float
    nics_per_node: int
    intra_node_bandwidth: float
    gemm_efficiency: float = 0.6
    grouped_gemm_efficiency: float = 0.6
    attention_efficiency: float = 0.6
    # Fixed seconds per decoder layer per micro-batch (forward + backward) that do not scale
    # with FLOPs: framework dispatch of the ~200 small ops of an eager MoE layer. Measured on
    # CPU (`tuner measure`); 0 on the GPU platforms, whose layers are large enough that launch
    # overheads hide behind the kernels (an assumption, not measured).
    layer_overhead: float = 0.0
    # Measured GEMM efficiency by width: ((w, efficiency), ...) for [2048, w] x [w, w]
    # products, w ascending. Narrow GEMMs run far below peak on a CPU (width 128: ~0.3 of the
    # best shape), which one efficiency cannot say. Empty (GPU platforms): gemm_efficiency.
    gemm_width_efficiency: tuple[tuple[int, float], ...] = ()
    hbm_bandwidth: float = 1e12
    usable_fraction: float = 0.9
    nodes_per_domain: int = 1
    nodes_per_group: int = 1
    intra_node_latency: float = 5e-6
    network_latency: float = 1e-5
    nonminimal_route_share: float = 0.0
    description: str = ""
    device: str = ""
    backend: str = "nccl"  # torch.distributed backend the launch lines ask for
    launcher: str = "torchrun"  # "slurm" -> the planner also writes an sbatch script

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _INT_FIELDS and (not isinstance(v, int) or v < 1):
                raise ValueError(f"platform {self.name!r}: {f.name}={v!r} must be an int >= 1")
            if f.name == "gemm_width_efficiency":
                if any(not 0.0 < e <= 1.0 or w < 1 for w, e in v) or \
                        [w for w, _ in v] != sorted({w for w, _ in v}):
                    raise ValueError(f"platform {self.name!r}: gemm_width_efficiency={v!r} needs "
                                     f"ascending distinct widths >= 1 and efficiencies in (0, 1]")
                continue
            if f.name in _FRACTIONS and not 0.0 < v <= 1.0:
                raise ValueError(f"platform {self.name!r}: {f.name}={v} must be in (0, 1]")
        if self.layer_overhead < 0:
            raise ValueError(f"platform {self.name!r}: layer_overhead={self.layer_overhead} must be >= 0")
        for key in ("peak_flops", "hbm_bytes", "nic_bandwidth", "intra_node_bandwidth",
                    "hbm_bandwidth"):
            if getattr(self, key) <= 0:
                raise ValueError(f"platform {self.name!r}: {key}={getattr(self, key)} must be > 0")
        if self.launcher not in ("slurm", "torchrun"):
            raise ValueError(f"platform {self.name!r}: launcher={self.launcher!r}; valid: slurm, torchrun")

    def gemm_eff(self, width: float) -> float:
        """GEMM efficiency for inner width `width` (min of K and N): interpolated in log2(width)
        over `gemm_width_efficiency`, clamped at its ends; `gemm_efficiency` without a table."""
        table = self.gemm_width_efficiency
        if not table:
            return self.gemm_efficiency
        if width <= table[0][0]:
            return table[0][1]
        for (w0, e0), (w1, e1) in zip(table, table[1:], strict=False):
            if width <= w1:
                f = (math.log2(width) - math.log2(w0)) / (math.log2(w1) - math.log2(w0))
                return e0 + f * (e1 - e0)
        return table[-1][1]

    def matmul_eff(self, m: float, n: float, k: float) -> float:
        """Efficiency (achieved / `peak_flops`) of one dense GEMM [m, k] x [k, n].

        Without a per-shape table this is `gemm_eff(min(n, k))`: the width table (or the
        single `gemm_efficiency`), as the estimate priced every dense GEMM before shapes."""
        return self.gemm_eff(min(n, k))

    def grouped_eff(self, rows_per_expert: float, n: float, k: float) -> float:
        """Efficiency of the grouped expert GEMM: every expert multiplies its
        `rows_per_expert` routed rows [rows, k] by its own [k, n] weight.

        Without a rows-per-expert table this is the single `grouped_gemm_efficiency`."""
        return self.grouped_gemm_efficiency

    def attention_eff(self, seq: int, head_dim: int, causal: bool) -> float:
        """Efficiency of the attention kernel (scores and weighted values) for sequence length
        `seq` and head width `head_dim`. The kernel priced is the trainer's causal one;
        `causal` says how the caller counts its FLOPs: True = only the unmasked half
        (Megatron, FlashAttention papers), False = the full s x s products (the model's
        convention, `ModelConfig.flops_per_token`). The two answers differ by exactly 2x, so
        the time FLOPs / (peak x efficiency) is the same under either count.

        Without a table: `attention_efficiency`, which is stated against the full count (as
        `tuner measure` measures it), halved for causal=True."""
        return self.attention_efficiency / 2 if causal else self.attention_efficiency

    @property
    def usable_hbm(self) -> float:
        """Bytes a training process may plan to use on one device."""
        return self.hbm_bytes * self.usable_fraction

    @property
    def nic_bandwidth_per_gpu(self) -> float:
        """Injection bandwidth of one device when every device of a node sends off-node."""
        return self.nic_bandwidth * self.nics_per_node / self.gpus_per_node

    @property
    def max_ep(self) -> int:
        """Largest EP group kept inside one locality domain (Piper's EP constraint)."""
        return self.gpus_per_node * self.nodes_per_domain

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> Platform:
        """Build from the TOML layout (sections compute, memory, node, network)."""
        kw: dict[str, Any] = {}
        for key in ("name", "description", "device", "backend", "launcher"):
            if key in data:
                kw[key] = str(data[key])
        known = {"name", "description", "device", "backend", "launcher"}
        for section, key, fname, scale in _FIELDS:
            known.add(section)
            body = data.get(section, {})
            if key in body:
                v = body[key]
                kw[fname] = int(v) if fname in _INT_FIELDS else float(v) * scale
        if "gemm_width_efficiency" in data.get("compute", {}):
            kw["gemm_width_efficiency"] = tuple(
                (int(w), float(e)) for w, e in data["compute"]["gemm_width_efficiency"])
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown platform keys {unknown}; valid: {sorted(known)}")
        for section in ("compute", "memory", "node", "network"):
            valid = {k for s, k, _, _ in _FIELDS if s == section}
            valid |= {"gemm_width_efficiency"} if section == "compute" else set()
            bad = sorted(set(data.get(section, {})) - valid)
            if bad:
                raise ValueError(f"{source}: unknown keys {bad} in [{section}]; valid: {sorted(valid)}")
        required = ("name", "peak_flops", "hbm_bytes", "gpus_per_node", "nic_bandwidth",
                    "nics_per_node", "intra_node_bandwidth")
        missing = [f for f in required if f not in kw]
        if missing:
            raise ValueError(f"{source}: platform lacks {missing}")
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The TOML layout in human units (inverse of `from_dict`)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in
                               ("name", "description", "device", "backend", "launcher")}
        for section, key, fname, scale in _FIELDS:
            v = getattr(self, fname)
            out.setdefault(section, {})[key] = v if fname in _INT_FIELDS else round(v / scale, 9)
        if self.gemm_width_efficiency:
            out["compute"]["gemm_width_efficiency"] = [list(p) for p in self.gemm_width_efficiency]
        return out


def platform_names(directory: Path = PLATFORM_DIR) -> list[str]:
    """Names of the platform files under `directory`."""
    return sorted(p.stem for p in Path(directory).glob("*.toml"))


def load_platform(name_or_path: str | Path, directory: Path = PLATFORM_DIR) -> Platform:
    """Load a platform by name (`frontier`) or by path to a TOML file."""
    p = Path(name_or_path)
    if p.suffix != ".toml" or not p.is_file():
        p = Path(directory) / f"{name_or_path}.toml"
    if not p.is_file():
        raise ValueError(
            f"unknown platform {str(name_or_path)!r}; valid: {', '.join(platform_names(directory))} "
            f"(files in {directory}), or a path to a .toml file"
            + ("; run `python -m tuner measure` to create 'local'" if str(name_or_path) == "local" else "")
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"platform file {str(p)!r} is not valid TOML: {e}") from None
    return Platform.from_dict(data, source=str(p))
