"""Platform descriptions: what one accelerator and its interconnect can do.

A `Platform` is plain data read from `configs/platforms/<name>.toml`. Files use human units
(TFLOPS, GB = 1e9 bytes, GB/s per direction, microseconds); the dataclass holds SI units
(FLOP/s, bytes, bytes/s, seconds) so the analytic model never converts. Values that are not
published are documented in each file as assumed parameters; `python -m tuner measure` writes
`local.toml` with every value measured on this machine.

Compute by shape. Beside the single efficiencies a file may carry, each its own section:
    [gemm_table]       dense GEMM [m, k] x [k, n] efficiency on a grid: m, n, k ascending
                       lists, efficiency[i][j][l] for (m[i], n[j], k[l])
    [grouped_table]    the grouped expert GEMM by rows per expert: rows_per_expert ascending,
                       efficiency[i]; fine-grained experts with few rows each run far below a
                       large GEMM
    [attention_table]  the causal flash-attention kernel, fwd + bwd, by seq and head_dim,
                       efficiency[i][j] against the causal (unmasked-half) FLOPs
    [roofline]         the stated alternative to a GEMM table where no measurement is
                       published: eff = min(max_efficiency, AI / (peak / hbm_bandwidth)),
                       AI = 2 m n k / (bytes_per_element x (m k + k n + m n)) (each operand
                       read once, the product written once); grouped: per expert with
                       m = rows_per_expert, capped at grouped_max_efficiency
    [fp8_gemm]         FP8 GEMMs (`precision="fp8"`), against the FP8 peak: a k-limited cap
                       and a memory roofline with stated parameters,
                         eff = min(max_efficiency x k / (k + k_half),
                                   AI8 x hbm_fraction x hbm_bandwidth / fp8_peak)
                         AI8 = 2 m n k / (m k + k n + 2 m n)  (FP8 operands, bf16 output)
                       k_half: the reduction depth at which a tile's fixed prologue and
                       epilogue cost as much as its multiply-adds (short-k GEMMs run far below
                       the cap: DeepGEMM's m = 4096 rows fall from 0.72 at k = 16384 to 0.38
                       at k = 512); grouped: per expert with m = rows_per_expert. Absent: FP8
                       GEMMs take the bf16 efficiencies above (the behaviour before it)
Tables are interpolated linearly in log(axis) on every axis and clamped at the ends. Precedence
per op: table, then roofline, then the single efficiency (the behaviour before tables).

Measured collectives (`tuner measure` on CPU; absent on the GPU platforms). A section
    [collectives]      all_reduce / reduce / broadcast = [[group size, latency_us,
                       bandwidth_gbs], ...]: t = latency + bytes per rank / bandwidth, fitted
                       to the backend's own collective over groups of that size inside one
                       node (concurrent disjoint groups when smaller than the node)
prices those collectives directly (`tuner.comms`); a kind or group size it lacks falls back
to the ring formulas over the link rates. `[memory] optimizer_bandwidth_gbs`: state bytes
(weights, gradients, moments) the trainer's optimizer step updates per second, measured; 0 or
absent: the step is memory bound, 2 x the state bytes / hbm_bandwidth (`optimizer_time`).
`[memory] elementwise_bandwidth_gbs` (measured on CPU): the rate of the activation traffic term,
see the field; absent: hbm_bandwidth. `[memory] zero_copy_bandwidth_gbs` (measured on CPU):
weight bytes per second of one pass of per-parameter ZeRO's broadcast pack / unpack, see the
field; absent: hbm_bandwidth / 2 (`zero_copy_rate`). `[memory] loss_bandwidth_gbs` (measured
on CPU): fp32 logit bytes per second of the trainer's cross-entropy forward + backward, see
the field; absent: the loss's elementwise work is not priced (every GPU file).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comm.topology.platform import PLATFORM_DIR, load_platform_file, platform_names

__all__ = ["Grid", "Platform", "PLATFORM_DIR", "load_platform", "platform_names"]


# (toml section, toml key, dataclass field, factor to SI)
_FIELDS: tuple[tuple[str, str, str, float], ...] = (
    ("compute", "peak_tflops", "peak_flops", 1e12),
    ("compute", "fp8_peak_tflops", "fp8_peak_flops", 1e12),
    ("compute", "gemm_efficiency", "gemm_efficiency", 1.0),
    ("compute", "grouped_gemm_efficiency", "grouped_gemm_efficiency", 1.0),
    ("compute", "attention_efficiency", "attention_efficiency", 1.0),
    ("compute", "layer_overhead_us", "layer_overhead", 1e-6),
    ("compute", "ep_layer_overhead_us", "ep_layer_overhead", 1e-6),
    ("compute", "split_backward_extra", "split_backward_extra", 1.0),
    ("compute", "split_backward_input_share", "split_backward_input_share", 1.0),
    ("compute", "zero3_layer_overhead_us", "zero3_layer_overhead", 1e-6),
    ("compute", "zero3_pair_overhead_us", "zero3_pair_overhead", 1e-6),
    ("compute", "shared_pipeline_factor", "shared_pipeline_factor", 1.0),
    ("compute", "pipeline_action_overhead_us", "pipeline_action_overhead", 1e-6),
    ("compute", "rank_skew", "rank_skew", 1.0),
    ("compute", "shared_rank_skew", "shared_rank_skew", 1.0),
    ("memory", "zero3_optimizer_overhead_us", "zero3_optimizer_overhead", 1e-6),
    ("memory", "hbm_gb", "hbm_bytes", 1e9),
    ("memory", "hbm_bandwidth_gbs", "hbm_bandwidth", 1e9),
    ("memory", "usable_fraction", "usable_fraction", 1.0),
    ("memory", "optimizer_bandwidth_gbs", "optimizer_bandwidth", 1e9),
    ("memory", "grad_flatten_bandwidth_gbs", "grad_flatten_bandwidth", 1e9),
    ("memory", "grad_norm_bandwidth_gbs", "grad_norm_bandwidth", 1e9),
    ("memory", "elementwise_bandwidth_gbs", "elementwise_bandwidth", 1e9),
    ("memory", "zero_copy_bandwidth_gbs", "zero_copy_bandwidth", 1e9),
    ("memory", "loss_bandwidth_gbs", "loss_bandwidth", 1e9),
    ("node", "gpus_per_node", "gpus_per_node", 1),
    ("node", "nodes_per_domain", "nodes_per_domain", 1),
    ("node", "nodes_per_group", "nodes_per_group", 1),
    ("node", "intra_node_bandwidth_gbs", "intra_node_bandwidth", 1e9),
    ("node", "intra_node_latency_us", "intra_node_latency", 1e-6),
    ("node", "sync_latency_us", "sync_latency", 1e-6),
    ("node", "collective_tail_us", "collective_tail", 1e-6),
    ("node", "pair_sync_latency_us", "pair_sync_latency", 1e-6),
    ("node", "cores_per_node", "cores_per_node", 1),
    ("node", "threads_per_process", "threads_per_process", 1),
    ("node", "host_nodes", "host_nodes", 1),
    ("network", "nics_per_node", "nics_per_node", 1),
    ("network", "nic_bandwidth_gbs", "nic_bandwidth", 1e9),
    ("network", "network_latency_us", "network_latency", 1e-6),
    ("network", "nonminimal_route_share", "nonminimal_route_share", 1.0),
)
_INT_FIELDS = {"gpus_per_node", "nodes_per_domain", "nodes_per_group", "nics_per_node"}
# ints where 0 means "not stated": one device per rank, nothing shared (every GPU file)
_COUNT_FIELDS = {"cores_per_node", "threads_per_process", "host_nodes"}
_FRACTIONS = {
    "gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "usable_fraction",
}


@dataclass(frozen=True)
class Grid:
    """Efficiencies on a rectangular grid: `axes[d]` ascending positive values of dimension d,
    `values` row-major (the last axis fastest), each in (0, 1]. `at(*point)` interpolates
    linearly in log(axis) on every axis (multilinear), clamped to the grid's ends."""

    name: str
    axis_names: tuple[str, ...]
    axes: tuple[tuple[float, ...], ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.axes):
            raise ValueError(f"{self.name}: {len(self.axes)} axes for names {self.axis_names}")
        for an, ax in zip(self.axis_names, self.axes, strict=True):
            if not ax or any(v <= 0 for v in ax) or list(ax) != sorted(set(ax)):
                raise ValueError(f"{self.name}.{an}={list(ax)} must be a non-empty list of "
                                 f"ascending distinct values > 0")
        size = math.prod(len(ax) for ax in self.axes)
        if len(self.values) != size:
            raise ValueError(f"{self.name}.efficiency has {len(self.values)} values, expected "
                             f"{' x '.join(str(len(a)) for a in self.axes)} = {size} (one per "
                             f"point of {' x '.join(self.axis_names)})")
        bad = [v for v in self.values if not 0.0 < v <= 1.0]
        if bad:
            raise ValueError(f"{self.name}.efficiency has {bad[:4]}; every value must be in (0, 1]")

    @classmethod
    def from_nested(cls, name: str, axis_names: tuple[str, ...], axes: list[list[float]],
                    nested: Any) -> Grid:
        """Build from nested lists (efficiency[i][j]...), checking the nesting's shape."""
        flat: list[float] = []

        def walk(x: Any, depth: int, where: str) -> None:
            want = len(axes[depth])
            if not isinstance(x, list) or len(x) != want:
                got = f"{len(x)} entries" if isinstance(x, list) else repr(x)
                raise ValueError(f"{name}.efficiency{where} has {got}, expected a list of "
                                 f"{want} (one per {axis_names[depth]})")
            for i, y in enumerate(x):
                if depth + 1 < len(axes):
                    walk(y, depth + 1, f"{where}[{i}]")
                else:
                    if not isinstance(y, int | float) or isinstance(y, bool):
                        raise ValueError(f"{name}.efficiency{where}[{i}]={y!r} is not a number")
                    flat.append(float(y))

        walk(nested, 0, "")
        return cls(name, axis_names, tuple(tuple(float(v) for v in a) for a in axes), tuple(flat))

    def nested(self) -> Any:
        """`values` as nested lists, the inverse of `from_nested`."""
        def build(depth: int, offset: int) -> Any:
            stride = math.prod(len(a) for a in self.axes[depth + 1:])
            if depth == len(self.axes) - 1:
                return list(self.values[offset:offset + len(self.axes[depth])])
            return [build(depth + 1, offset + i * stride) for i in range(len(self.axes[depth]))]
        return build(0, 0)

    def at(self, *point: float) -> float:
        """The efficiency at `point` (one coordinate per axis, each > 0)."""
        if len(point) != len(self.axes):
            raise ValueError(f"{self.name}: {len(point)} coordinates for axes {self.axis_names}")
        # per axis: (lower index, weight of the upper neighbour) after clamping
        brackets: list[tuple[int, float]] = []
        for an, ax, x in zip(self.axis_names, self.axes, point, strict=True):
            if not x > 0:
                raise ValueError(f"{self.name}: {an}={x} must be > 0")
            if x <= ax[0] or len(ax) == 1:
                brackets.append((0, 0.0))
            elif x >= ax[-1]:
                brackets.append((len(ax) - 2, 1.0))
            else:
                i = next(j for j in range(len(ax) - 1) if x <= ax[j + 1])
                f = (math.log(x) - math.log(ax[i])) / (math.log(ax[i + 1]) - math.log(ax[i]))
                brackets.append((i, f))
        strides = [math.prod(len(a) for a in self.axes[d + 1:]) for d in range(len(self.axes))]
        out = 0.0
        for corner in range(2 ** len(self.axes)):
            w, idx = 1.0, 0
            for d, (i, f) in enumerate(brackets):
                up = (corner >> d) & 1
                if up and len(self.axes[d]) == 1:
                    w = 0.0
                    break
                w *= f if up else 1.0 - f
                idx += (i + up) * strides[d]
            if w:
                out += w * self.values[idx]
        return out


# section -> (axis names, Platform field)
_TABLES: dict[str, tuple[tuple[str, ...], str]] = {
    "gemm_table": (("m", "n", "k"), "gemm_table"),
    "grouped_table": (("rows_per_expert",), "grouped_table"),
    "attention_table": (("seq", "head_dim"), "attention_table"),
}
COLLECTIVE_KINDS = ("all_reduce", "reduce", "broadcast")  # [collectives] keys
_FP8_KEYS = {"max_efficiency": "fp8_max_efficiency", "k_half": "fp8_k_half",
             "hbm_fraction": "fp8_hbm_fraction"}
_ROOFLINE_KEYS = {"max_efficiency": "roofline_max_efficiency",
                  "grouped_max_efficiency": "roofline_grouped_max_efficiency",
                  "bytes_per_element": "roofline_bytes_per_element"}


def _efficiency_section(data: dict, section: str, keys: dict[str, str], what: str, source: str,
                        kw: dict) -> None:
    """Read the optional `[section]` of GEMM-efficiency parameters (file key -> field in
    `keys`) into `kw`: unknown keys, a non-number value and a section without
    max_efficiency are refused, naming the file."""
    body = data.get(section, {})
    bad = sorted(set(body) - set(keys))
    if bad:
        raise ValueError(f"{source}: unknown keys {bad} in [{section}]; valid: {sorted(keys)}")
    for key, fname in keys.items():
        if key in body:
            v = body[key]
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{source}: [{section}] {key}={v!r} must be a number")
            kw[fname] = float(v)
    if body and not body.get("max_efficiency"):
        raise ValueError(f"{source}: [{section}] needs max_efficiency in (0, 1]{what}, got "
                         f"{body.get('max_efficiency')!r}")


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
    # Dense FP8 matrix peak per device, FLOP/s, the rate of FP8 GEMMs (`tuner.costs.gemm_peak`);
    # 0: the file states none (fp8 then needs Assumptions.fp8_peak_factor)
    fp8_peak_flops: float = 0.0
    # Fixed seconds per decoder layer per micro-batch (forward + backward) that do not scale
    # with FLOPs: framework dispatch of the ~200 small ops of an eager MoE layer. Measured on
    # CPU (`tuner measure`); 0 on the GPU platforms, whose layers are large enough that launch
    # overheads hide behind the kernels (an assumption, not measured).
    layer_overhead: float = 0.0
    # Fixed seconds the expert-parallel path adds to one MoE layer per micro-batch (forward +
    # backward) beyond the fitted latency of its four exchanges: the splits exchange, the
    # permutes, each exchange waiting for its slowest member. Measured on CPU (`tuner
    # measure`: the layer_overhead probe with its MoE layer sharded over all processes through
    # the real EPDispatcher, against the same layer local); 0 where not measured (the GPU files)
    ep_layer_overhead: float = 0.0
    # Measured on CPU (`tuner measure`): extra time of the zero-bubble split backward (B, then
    # W from the recorded cut nodes: pipeline/split_backward.py) over a plain forward +
    # backward of one decoder layer, as a fraction of the plain time; 0 where not measured
    split_backward_extra: float = 0.0
    # The input-gradient pass B's share of a split backward (B + W): it sets how much of each
    # backward races down the pipeline and how much (W) is left to fill its bubbles. Measured
    # on CPU (`tuner measure`: 0.6-0.7 on the tiny layer, where the attention and elementwise
    # backward all belong to B); 0.5 where not measured, the equal-halves assumption
    # the zero-bubble schedules are usually drawn with (and the model's before it was measured)
    split_backward_input_share: float = 0.5
    # Measured on CPU (`tuner measure`): seconds per decoder layer and micro-batch that ZeRO-3
    # (the trainer's FSDP2) adds beyond the model's price of its gathers and reduce-scatter
    # (FSDP2's per-group copies and DTensor work in Python); 0 where not measured (GPU files)
    zero3_layer_overhead: float = 0.0
    # The same, measured with the processes sharded in concurrent groups of 2 (FSDP2 over each
    # pair): the constant depends on the group's size (4 processes on this project's 2 cores:
    # 45-47 ms per layer over pairs, 63-81 over one group of 4); used for layouts whose FSDP
    # groups are pairs (`zero3_overhead`). 0 where not measured (fewer than 4 processes, GPU)
    zero3_pair_overhead: float = 0.0
    # Measured on CPU where processes share the cores (`tuner measure`): what a real
    # pipeline's step takes beyond the shared-core replay's price of it (`tuner.sharing`, its
    # actions timed with every process computing), per second of the replay's contended part
    # (more processes computing than cores): 1 + excess / contended seconds. The estimate
    # scales a replayed pipeline's contended part by it (files before 2026-12-07 held the
    # whole step's ratio, 1.09-1.19 on this project's VM). 1 where not measured (dedicated
    # devices: no replay)
    shared_pipeline_factor: float = 1.0
    # Measured on CPU where each process has cores of its own (`tuner measure`): seconds one
    # pipeline action (a stage's forward, backward or weight pass of one micro-batch) takes
    # in a real pipeline beyond its compute and its P2P hand-overs as priced: the runtime's
    # per-action work (the boundary batch of sends and receives, the autograd set-up of a
    # stage's micro-batch, the release of its activations). Fitted so that the replay of the
    # pipeline probe's 1F1B schedule with its measured actions, plus this per action, takes
    # the measured step. 0 where not measured (GPU files; where the processes share cores,
    # `shared_pipeline_factor` calibrates the replay as a whole instead)
    pipeline_action_overhead: float = 0.0
    # Measured on CPU where each process has cores of its own (`tuner measure`): the slowest
    # process's time over the processes' mean on identical work between two synchronizations
    # (one decoder layer's forward + backward on every process after a barrier; the median
    # over rounds). Processes of one machine do not run equally fast (measured on this
    # project's 2-core VM: one process 0-8 % slower than the other for a whole run, the side
    # changing between runs, plus a few % of jitter per layer), and ranks that meet in a
    # collective every layer or step wait for the slowest: the estimate scales the compute of
    # plans whose stages hold several ranks (DP, EP) by it. 1 where not measured (GPU files,
    # and where the processes share the cores: there the shared-core terms are measured with
    # every process computing, their jitter included, and `shared_rank_skew` covers the plans
    # none of those terms prices)
    rank_skew: float = 1.0
    # The same probe where the processes share the cores (CPU, more processes x threads than
    # cores): the slowest process over the mean on identical work between two
    # synchronizations, each process getting its share of the cores as the scheduler deals
    # it (1.07-1.24 for 4 processes on this project's 2-core VM, 2026-12-07). The pipeline
    # replay (shared_pipeline_factor) and the EP path's constants (ep_layer_overhead) are
    # measured with every process computing and hold this wait; a plan with neither (PP 1,
    # EP 1: its first collective after the backward is where the ranks meet) is scaled by it
    # (`tuner.estimate`). 1 where not measured (GPU files, dedicated cores, files before it)
    shared_rank_skew: float = 1.0
    # Measured on CPU (`tuner measure`): seconds per decoder layer on a rank that the AdamW
    # step over ZeRO-3's DTensor shards takes beyond a plain AdamW step over the same model
    # (torch's per-tensor DTensor dispatch); 0 where not measured
    zero3_optimizer_overhead: float = 0.0
    # Measured GEMM efficiency by width: ((w, efficiency), ...) for [2048, w] x [w, w]
    # products, w ascending. Narrow GEMMs run far below peak on a CPU (width 128: ~0.3 of the
    # best shape), which one efficiency cannot say. Empty (GPU platforms): gemm_efficiency.
    gemm_width_efficiency: tuple[tuple[int, float], ...] = ()
    # Compute by shape (module docstring): measured or cited tables, or a stated roofline.
    gemm_table: Grid | None = None
    grouped_table: Grid | None = None
    attention_table: Grid | None = None
    roofline_max_efficiency: float = 0.0  # 0: no roofline
    roofline_grouped_max_efficiency: float = 0.0  # 0: roofline_max_efficiency
    roofline_bytes_per_element: float = 2.0  # bf16 operands
    # [fp8_gemm] (module docstring): 0 = no FP8 shape model (FP8 GEMMs use the bf16 ones)
    fp8_max_efficiency: float = 0.0
    fp8_k_half: float = 0.0  # elements of k
    fp8_hbm_fraction: float = 1.0  # share of hbm_bandwidth a memory-bound FP8 GEMM reaches
    hbm_bandwidth: float = 1e12
    usable_fraction: float = 0.9
    # Measured (module docstring): ((kind, group size, latency s, bandwidth B/s), ...) and the
    # optimizer step's state bytes per second (0: memory bound)
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    optimizer_bandwidth: float = 0.0
    # Measured on CPU (`tuner measure`; 0 = not measured, no term): fp32 gradient bytes per
    # second of the trainer's gradient passes after the backward (trainer/distributed/
    # grad_sync.py): flatten into a bucket, scale, copy back (cat, mul_, clone), and the fp64
    # squared norm of the clipping; and the seconds of one small all-reduce (a few fp64
    # values over every process: the norm's, the loss's and the metrics' all-reduces)
    grad_flatten_bandwidth: float = 0.0
    grad_norm_bandwidth: float = 0.0
    sync_latency: float = 0.0
    # Measured on CPU (0 = not measured, no term): what a blocking collective call pays on
    # average beyond a fit over the medians of single calls: the small all-reduce's mean
    # minus its median (`tuner.measure.SYNC_CALLS`; a process blocked in a collective on an
    # idle core is now and then woken late). Added once per such call after the backward
    # (`tuner.estimate._dp_collectives`)
    collective_tail: float = 0.0
    # Measured on CPU with 4+ processes (0 = not measured: `sync_latency`): the small
    # all-reduce over concurrent pairs of the processes, every pair at once; the price of a
    # step's syncs over 2-rank groups in a larger job (`sync_time`)
    pair_sync_latency: float = 0.0
    # Measured on CPU (0 = not measured: `hbm_bandwidth`): bytes per second at which an eager
    # decoder layer's work outside its GEMMs, attention and fixed per-op cost runs, counted as
    # `tuner.layout.CPU_TRAFFIC_PASSES` passes over its saved activations (the estimate's
    # activation traffic term, `traffic_bandwidth`). The unfused elementwise kernels (norms,
    # SiLU x gate, softmax over 8 experts, top-k combine, index_select, scatter_add) run far
    # below a large copy's rate: measured 8.4 vs 18.4 GB/s on this project's 2-core VM
    elementwise_bandwidth: float = 0.0
    # Measured on CPU (0 = not measured: `hbm_bandwidth` / 2, a copy's read and write): weight
    # bytes per second of one pass of per-parameter ZeRO's broadcast around its collective
    # (trainer/distributed/grad_sync.py `broadcast_params`): the owner packs each bucket of
    # several parameters (torch.cat), every other rank unpacks it (one copy_ per parameter),
    # so each byte of such a bucket takes one pass on every rank of its group
    # (`zero_copy_rate`, `tuner.estimate._dp_collectives`)
    zero_copy_bandwidth: float = 0.0
    # Measured on CPU (0 = not measured, not priced): fp32 logit bytes (tokens x vocab x 4)
    # per second of `model.cross_entropy`'s forward + backward (log-softmax over the vocab,
    # its gradient), which no GEMM or activation term holds: ~10 ms per step of the README's
    # tiny Mixtral (vocab 2048, 512 tokens per rank) on 4 processes here (`loss_time`)
    loss_bandwidth: float = 0.0
    # CPU platforms (`tuner measure`: the machine's cores as the OS reports them and the
    # intra-op threads each process got): with more processes x threads than cores the
    # processes share the cores, and a rank waiting in the pipeline gives its share to the
    # busy ones (`tuner.sharing`). 0 = not stated: one device per rank (every GPU file)
    cores_per_node: int = 0
    threads_per_process: int = 0
    # nodes whose processes all run on one host's `cores_per_node` cores: an emulated cluster
    # (`tuner.measure.emulator_platform`, every emulated node on this machine); 1 otherwise
    host_nodes: int = 1
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
            if f.name == "collectives":
                for c in v:
                    if (len(c) != 4 or c[0] not in COLLECTIVE_KINDS or not isinstance(c[1], int)
                            or c[1] < 2 or not c[2] >= 0 or not c[3] > 0):
                        raise ValueError(f"platform {self.name!r}: collective {c!r} must be "
                                         f"(kind in {COLLECTIVE_KINDS}, group size >= 2, "
                                         f"latency >= 0 s, bandwidth > 0 B/s)")
                continue
            if f.name in ("gemm_table", "grouped_table", "attention_table"):
                if v is not None and not isinstance(v, Grid):
                    raise ValueError(f"platform {self.name!r}: {f.name} must be a Grid, got {v!r}")
                continue
            if f.name in _INT_FIELDS and (not isinstance(v, int) or v < 1):
                raise ValueError(f"platform {self.name!r}: {f.name}={v!r} must be an int >= 1")
            if f.name in _COUNT_FIELDS and (not isinstance(v, int) or v < 0):
                raise ValueError(f"platform {self.name!r}: {f.name}={v!r} must be an int >= 0 "
                                 f"(0 = not stated: one device per rank)")
            if f.name == "gemm_width_efficiency":
                if any(not 0.0 < e <= 1.0 or w < 1 for w, e in v) or \
                        [w for w, _ in v] != sorted({w for w, _ in v}):
                    raise ValueError(f"platform {self.name!r}: gemm_width_efficiency={v!r} needs "
                                     f"ascending distinct widths >= 1 and efficiencies in (0, 1]")
                continue
            if f.name in _FRACTIONS and not 0.0 < v <= 1.0:
                raise ValueError(f"platform {self.name!r}: {f.name}={v} must be in (0, 1]")
        if not (math.isfinite(self.shared_pipeline_factor) and self.shared_pipeline_factor > 0):
            raise ValueError(f"platform {self.name!r}: shared_pipeline_factor="
                             f"{self.shared_pipeline_factor} must be a finite number > 0 "
                             f"(measured step / replayed step; 1 = the replay as is)")
        for name, v, what in (("rank_skew", self.rank_skew, "the slowest process over the mean"),
                              ("shared_rank_skew", self.shared_rank_skew, "the slowest of the "
                               "processes sharing the cores over their mean")):
            if not (math.isfinite(v) and v >= 1.0):
                raise ValueError(f"platform {self.name!r}: {name}={v} must be a finite number "
                                 f">= 1 ({what}; 1 = not measured)")
        if self.split_backward_extra < 0:
            raise ValueError(f"platform {self.name!r}: split_backward_extra="
                             f"{self.split_backward_extra} must be >= 0")
        for name, v in (("pipeline_action_overhead_us", self.pipeline_action_overhead),
                        ("zero3_layer_overhead_us", self.zero3_layer_overhead),
                        ("zero3_pair_overhead_us", self.zero3_pair_overhead),
                        ("zero3_optimizer_overhead_us", self.zero3_optimizer_overhead)):
            if v < 0:
                raise ValueError(f"platform {self.name!r}: {name}={v * 1e6} must be >= 0")
        if not 0.0 <= self.split_backward_input_share <= 1.0:
            raise ValueError(f"platform {self.name!r}: split_backward_input_share="
                             f"{self.split_backward_input_share} must be in [0, 1] (B's share "
                             f"of B + W)")
        if self.fp8_peak_flops < 0:
            raise ValueError(f"platform {self.name!r}: fp8_peak_flops={self.fp8_peak_flops} "
                             f"must be >= 0 (0 = no FP8 rate stated)")
        if self.optimizer_bandwidth < 0:
            raise ValueError(f"platform {self.name!r}: optimizer_bandwidth="
                             f"{self.optimizer_bandwidth} must be >= 0 (0 = memory bound)")
        for key in ("grad_flatten_bandwidth", "grad_norm_bandwidth", "sync_latency",
                    "collective_tail", "pair_sync_latency", "elementwise_bandwidth",
                    "zero_copy_bandwidth", "loss_bandwidth"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"platform {self.name!r}: {key}={getattr(self, key)} must be "
                                 f">= 0 and finite (0 = not measured)")
        if (self.cores_per_node == 0) != (self.threads_per_process == 0):
            raise ValueError(f"platform {self.name!r}: cores_per_node={self.cores_per_node} and "
                             f"threads_per_process={self.threads_per_process}: give both "
                             f"(a CPU platform) or neither (one device per rank)")
        if self.host_nodes < 1:
            raise ValueError(f"platform {self.name!r}: host_nodes={self.host_nodes} must be >= 1 "
                             f"(nodes sharing one host's cores)")
        if self.layer_overhead < 0:
            raise ValueError(f"platform {self.name!r}: layer_overhead={self.layer_overhead} must be >= 0")
        if self.ep_layer_overhead < 0:
            raise ValueError(f"platform {self.name!r}: ep_layer_overhead={self.ep_layer_overhead} "
                             f"must be >= 0")
        for key in ("peak_flops", "hbm_bytes", "nic_bandwidth", "intra_node_bandwidth",
                    "hbm_bandwidth"):
            if getattr(self, key) <= 0:
                raise ValueError(f"platform {self.name!r}: {key}={getattr(self, key)} must be > 0")
        for key in ("roofline_max_efficiency", "roofline_grouped_max_efficiency"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"platform {self.name!r}: {key}={getattr(self, key)} must be "
                                 f"in (0, 1] (0 = no roofline)")
        if not 0.0 <= self.fp8_max_efficiency <= 1.0:
            raise ValueError(f"platform {self.name!r}: fp8_gemm max_efficiency="
                             f"{self.fp8_max_efficiency} must be in (0, 1] (0 = no FP8 model)")
        if self.fp8_k_half < 0:
            raise ValueError(f"platform {self.name!r}: fp8_gemm k_half={self.fp8_k_half} must "
                             f"be >= 0")
        if not 0.0 < self.fp8_hbm_fraction <= 1.0:
            raise ValueError(f"platform {self.name!r}: fp8_gemm hbm_fraction="
                             f"{self.fp8_hbm_fraction} must be in (0, 1]")
        if self.roofline_bytes_per_element <= 0:
            raise ValueError(f"platform {self.name!r}: roofline_bytes_per_element="
                             f"{self.roofline_bytes_per_element} must be > 0")
        if self.roofline_grouped_max_efficiency and not self.roofline_max_efficiency:
            raise ValueError(f"platform {self.name!r}: roofline grouped_max_efficiency="
                             f"{self.roofline_grouped_max_efficiency} needs max_efficiency > 0")
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

        `gemm_table` interpolated at (m, n, k); else the roofline; else `gemm_eff(min(n, k))`:
        the width table (or the single `gemm_efficiency`), as the estimate priced every
        dense GEMM before shapes."""
        _check_dims("matmul_eff", m=m, n=n, k=k)
        if self.gemm_table is not None:
            return self.gemm_table.at(m, n, k)
        if self.roofline_max_efficiency:
            return self._roofline(m, n, k, self.roofline_max_efficiency)
        return self.gemm_eff(min(n, k))

    def _roofline(self, m: float, n: float, k: float, cap: float) -> float:
        ai = 2.0 * m * n * k / (self.roofline_bytes_per_element * (m * k + k * n + m * n))
        return min(cap, ai * self.hbm_bandwidth / self.peak_flops)

    def grouped_eff(self, rows_per_expert: float, n: float, k: float) -> float:
        """Efficiency of the grouped expert GEMM: every expert multiplies its
        `rows_per_expert` routed rows [rows, k] by its own [k, n] weight.

        `grouped_table` interpolated at `rows_per_expert` (measured at one (n, k), which the
        file states); else the roofline of one expert's GEMM, whose weight is read once for
        few rows; else the single `grouped_gemm_efficiency`."""
        _check_dims("grouped_eff", rows_per_expert=rows_per_expert, n=n, k=k)
        if self.grouped_table is not None:
            return self.grouped_table.at(rows_per_expert)
        if self.roofline_max_efficiency:
            cap = self.roofline_grouped_max_efficiency or self.roofline_max_efficiency
            return self._roofline(rows_per_expert, n, k, cap)
        return self.grouped_gemm_efficiency

    def fp8_matmul_eff(self, m: float, n: float, k: float, fp8_peak: float) -> float:
        """Efficiency (achieved / `fp8_peak`, FLOP/s) of one FP8 GEMM [m, k] x [k, n] with a
        bf16 product: the [fp8_gemm] model (module docstring); without one, `matmul_eff`."""
        _check_dims("fp8_matmul_eff", m=m, n=n, k=k, fp8_peak=fp8_peak)
        if not self.fp8_max_efficiency:
            return self.matmul_eff(m, n, k)
        cap = self.fp8_max_efficiency * k / (k + self.fp8_k_half)
        ai = 2.0 * m * n * k / (m * k + k * n + 2.0 * m * n)
        return min(cap, ai * self.fp8_hbm_fraction * self.hbm_bandwidth / fp8_peak)

    def fp8_grouped_eff(self, rows_per_expert: float, n: float, k: float,
                        fp8_peak: float) -> float:
        """Efficiency of the FP8 grouped expert GEMM, each expert's [rows, k] x [k, n] priced
        as one FP8 GEMM (its weight read once for its rows); without [fp8_gemm],
        `grouped_eff`."""
        if not self.fp8_max_efficiency:
            _check_dims("fp8_grouped_eff", rows_per_expert=rows_per_expert, n=n, k=k)
            return self.grouped_eff(rows_per_expert, n, k)
        return self.fp8_matmul_eff(rows_per_expert, n, k, fp8_peak)

    def attention_eff(self, seq: int, head_dim: int, causal: bool) -> float:
        """Efficiency of the attention kernel (scores and weighted values) for sequence length
        `seq` and head width `head_dim`. The kernel priced is the trainer's causal one;
        `causal` says how the caller counts its FLOPs: True = only the unmasked half
        (Megatron, FlashAttention papers), False = the full s x s products (the model's
        convention, `ModelConfig.flops_per_token`). The two answers differ by exactly 2x, so
        the time FLOPs / (peak x efficiency) is the same under either count.

        `attention_table` (stated against the causal count) interpolated at (seq, head_dim),
        doubled for causal=False. Without a table: `attention_efficiency`, which is stated
        against the full count (as `tuner measure` measured it before tables), halved for
        causal=True."""
        _check_dims("attention_eff", seq=seq, head_dim=head_dim)
        if self.attention_table is not None:
            e = self.attention_table.at(seq, head_dim)
            return e if causal else 2.0 * e
        return self.attention_efficiency / 2 if causal else self.attention_efficiency

    def collective_fit(self, kind: str, group_size: int) -> tuple[float, float] | None:
        """(latency s, bandwidth B/s) of the measured `kind` collective over `group_size`
        ranks of one node, or None where the file has none (module docstring)."""
        for k, n, lat, bw in self.collectives:
            if k == kind and n == group_size:
                return lat, bw
        return None

    def optimizer_time(self, state_bytes: float) -> float:
        """Seconds of the optimizer step over `state_bytes` of state (weights, gradients,
        moments of the parameters one rank updates): the measured `optimizer_bandwidth`, else
        memory bound (each byte read and written once at `hbm_bandwidth`)."""
        if self.optimizer_bandwidth:
            return state_bytes / self.optimizer_bandwidth
        return 2 * state_bytes / self.hbm_bandwidth

    def zero3_overhead(self, group: int) -> float:
        """ZeRO-3's measured per-layer constant for FSDP groups of `group` ranks: the pair
        value where groups are pairs and it was measured, else `zero3_layer_overhead`."""
        return self.zero3_pair_overhead if group == 2 and self.zero3_pair_overhead \
            else self.zero3_layer_overhead

    def loss_time(self, tokens: float, vocab: int) -> float:
        """Seconds of the cross-entropy's forward + backward over `tokens` x `vocab` fp32
        logits at the measured `loss_bandwidth`; 0 where it was not measured."""
        return tokens * vocab * 4 / self.loss_bandwidth if self.loss_bandwidth else 0.0

    @property
    def zero_copy_rate(self) -> float:
        """Bytes per second of one pack or unpack pass of ZeRO's weight broadcast: the
        measured `zero_copy_bandwidth`, else a copy at `hbm_bandwidth` (which counts the
        read and the write of each byte, so a pass moves hbm_bandwidth / 2 bytes a second)."""
        return self.zero_copy_bandwidth or self.hbm_bandwidth / 2

    @property
    def traffic_bandwidth(self) -> float:
        """Bytes per second of the activation traffic term (`Assumptions.
        activation_traffic_passes`): the measured `elementwise_bandwidth`, else `hbm_bandwidth`."""
        return self.elementwise_bandwidth or self.hbm_bandwidth

    def sync_time(self, group_size: int, n_procs: int) -> float:
        """Seconds of one small all-reduce over `group_size` of a job's `n_procs` ranks:
        `pair_sync_latency` for a pair in a larger job where measured, else `sync_latency`
        (measured over every process); 0 over one rank (no collective)."""
        if group_size <= 1:
            return 0.0
        if group_size == 2 and n_procs > 2 and self.pair_sync_latency > 0:
            return self.pair_sync_latency
        return self.sync_latency

    def shares_cores(self, n_procs: int) -> bool:
        """Whether `n_procs` processes on one node of this platform share its cores (more
        processes x threads than cores; `tuner.sharing`). False wherever the cores are not
        stated (one device per rank) and for jobs spanning more than one node."""
        return (self.cores_per_node > 0 and n_procs <= self.gpus_per_node
                and n_procs * self.threads_per_process > self.cores_per_node)

    def host_procs(self, n_procs: int) -> int:
        """Processes of an `n_procs` job that share one host's cores: those of its first
        `host_nodes` nodes."""
        return min(n_procs, self.gpus_per_node * self.host_nodes)

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
                kw[fname] = int(v) if fname in _INT_FIELDS | _COUNT_FIELDS else float(v) * scale
        if "gemm_width_efficiency" in data.get("compute", {}):
            kw["gemm_width_efficiency"] = tuple(
                (int(w), float(e)) for w, e in data["compute"]["gemm_width_efficiency"])
        for section, (axis_names, fname) in _TABLES.items():
            known.add(section)
            if section in data:
                kw[fname] = _grid_from(section, axis_names, data[section], source)
        known.add("collectives")
        if "collectives" in data:
            kw["collectives"] = _collectives_from(data["collectives"], source)
        known.add("fp8_gemm")
        _efficiency_section(data, "fp8_gemm", _FP8_KEYS, "", source, kw)
        known.add("roofline")
        _efficiency_section(data, "roofline", _ROOFLINE_KEYS,
                            " (the efficiency of a GEMM above the ridge point)", source, kw)
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
            out.setdefault(section, {})[key] = v if fname in _INT_FIELDS | _COUNT_FIELDS \
                else round(v / scale, 9)
        if self.gemm_width_efficiency:
            out["compute"]["gemm_width_efficiency"] = [list(p) for p in self.gemm_width_efficiency]
        for section, (axis_names, fname) in _TABLES.items():
            g: Grid | None = getattr(self, fname)
            if g is not None:
                out[section] = {an: [_num(v) for v in ax]
                                for an, ax in zip(axis_names, g.axes, strict=True)}
                out[section]["efficiency"] = g.nested()
        if self.collectives:
            out["collectives"] = {
                k: [[n, round(lat * 1e6, 3), round(bw / 1e9, 6)]
                    for kk, n, lat, bw in self.collectives if kk == k]
                for k in COLLECTIVE_KINDS if any(c[0] == k for c in self.collectives)}
        if self.fp8_max_efficiency:
            out["fp8_gemm"] = {key: getattr(self, fname) for key, fname in _FP8_KEYS.items()}
        if self.roofline_max_efficiency:
            out["roofline"] = {key: getattr(self, fname) for key, fname in _ROOFLINE_KEYS.items()
                               if getattr(self, fname)}
        return out


def _collectives_from(body: Any, source: str) -> tuple[tuple[str, int, float, float], ...]:
    """[collectives] of a platform file: kind = [[group size, latency_us, bandwidth_gbs], ...]."""
    if not isinstance(body, dict) or sorted(set(body) - set(COLLECTIVE_KINDS)):
        raise ValueError(f"{source}: [collectives] keys must be among {list(COLLECTIVE_KINDS)}")
    out = []
    for kind, fits in body.items():
        for f in fits if isinstance(fits, list) else [fits]:
            if not (isinstance(f, list) and len(f) == 3
                    and all(isinstance(x, int | float) for x in f)):
                raise ValueError(f"{source}: [collectives] {kind} entry {f!r} must be "
                                 f"[group size, latency_us, bandwidth_gbs]")
            out.append((kind, int(f[0]), float(f[1]) * 1e-6, float(f[2]) * 1e9))
    return tuple(out)


def _num(v: float) -> int | float:
    """Axis values back as ints where they are whole (shapes), else floats."""
    return int(v) if float(v).is_integer() else v


def _check_dims(op: str, **dims: float) -> None:
    bad = {k: v for k, v in dims.items() if not v > 0}
    if bad:
        raise ValueError(f"{op}: {', '.join(f'{k}={v}' for k, v in bad.items())} must be > 0")


def _grid_from(section: str, axis_names: tuple[str, ...], body: Any, source: str) -> Grid:
    """The [section] of a platform file as a Grid, with errors that name file and key."""
    if not isinstance(body, dict):
        raise ValueError(f"{source}: [{section}] must be a table with keys "
                         f"{list(axis_names) + ['efficiency']}")
    valid = set(axis_names) | {"efficiency"}
    bad = sorted(set(body) - valid)
    missing = sorted(valid - set(body))
    if bad or missing:
        raise ValueError(f"{source}: [{section}] has unknown keys {bad} / lacks {missing}; "
                         f"valid: {sorted(valid)}")
    axes = []
    for an in axis_names:
        ax = body[an]
        if not isinstance(ax, list) or not all(isinstance(v, int | float) for v in ax):
            raise ValueError(f"{source}: [{section}] {an}={ax!r} must be a list of numbers")
        axes.append([float(v) for v in ax])
    try:
        return Grid.from_nested(section, axis_names, axes, body["efficiency"])
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_platform(name_or_path: str | Path, directory: Path = PLATFORM_DIR) -> Platform:
    """Load a platform by name (`frontier`) or by path to a TOML file (`comm.topology.platform`
    finds and parses it)."""
    pf = load_platform_file(name_or_path, directory)
    return Platform.from_dict(pf.data, source=pf.source)
