"""Construction: the device, the parallelised model, its pipeline stages, the optimizer.

Order (fixed, every rank the same): the model is built on the meta device, the process groups
are created, the EP topology is found (and `auto` calibrated across nodes), experts are sharded
over EP, pipeline stages are cut, then each rank materialises only what it holds with the
values a 1-process run has, and initial weights come from --model.hf_path when given.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model import cross_entropy

from .common import log
from .config import ConfigError, RunConfig
from .distributed.grad_sync import GradSync
from .distributed.mesh import Mesh
from .distributed.parallel import parallelize
from .distributed.pipe import build_stages, moe_aux, split_layers
from .distributed.precision import resolve_precision
from .distributed.zero import build_optimizer as zero_optimizer
from .distributed.zero import effective_zero
from .layout import Layout
from .observe.memory import rss_peak, rss_reset_peak
from .setup import build_schedule

__all__ = ["pick_device", "build_model", "Pipeline", "build_pipeline", "apply_tp", "import_hf",
           "build_grad_sync", "build_optimizer", "FbMemory", "fb_budget", "resolve_a2a"]

# (run config, model config, layout, backend) -> (the busiest rank's predicted peak bytes with
# --comm.a2a_overlap=fb, fb's extra activation bytes on it): `tuner.fb_memory.fb_memory_of_run`
FbMemory = Callable[[RunConfig, Any, Layout, str], tuple[float, float]]


def pick_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (train.py checked there are enough GPUs), else CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build_model(cfg: RunConfig, mcfg: Any, mesh: Mesh, fb_memory: FbMemory | None = None):
    """(the model on the meta device with its experts sharded over EP, the all-to-all overlap
    it runs: `resolve_a2a`'s, `auto` decided by its rules, the candidates `auto`'s trial
    over the first steps times: `trial_candidates`, [] for no trial). Collective: process
    groups, topology discovery, `auto` calibration and its overlap's memory check."""
    from model import MoETransformer, set_checkpointing

    torch.manual_seed(cfg.train.seed)
    # Built on the meta device: each rank allocates only its experts and its pipeline stage's
    # layers, then initialises them with the values a 1-process run has (each tensor, each
    # expert, from its own seeded generator: MoETransformer.reset_parameters).
    with torch.device("meta"):
        model = MoETransformer(mcfg)
    set_checkpointing(model, cfg.train.checkpointing)
    mesh.build_groups(timedelta(seconds=cfg.train.timeout_s))
    topo = ep_topology(cfg, mesh, cfg.comm.alltoall)
    algo, overlap, chunks = resolve_a2a(cfg, mcfg, mesh, topo, fb_memory)
    if cfg.comm.route_groups == "node":
        node_blocks(mcfg, mesh, topo, check=True)
    nodes = topo.num_nodes if topo is not None else 1
    candidates = trial_candidates(cfg.comm.alltoall, cfg.comm.a2a_overlap, algo, overlap,
                                  chunks, nodes, mcfg.top_k) \
        if cfg.comm.auto_trial > 0 and mesh.ep > 1 and mesh.tp == 1 else []
    candidates = candidates if len(candidates) > 1 else []
    # auto across nodes plans each exchange with a model of the links, fitted here (also
    # where the trial may switch to it)
    cost_model = calibrate_auto(mesh, mcfg, topo) if nodes > 1 and mesh.ep > 1 and (
        algo == "auto" or any(c[0] == "auto" for c in candidates)) else None
    parallelize(model, mesh, alltoall=algo, topology=topo, cost_model=cost_model,
                redundant=cfg.balance.redundant, overlap=overlap, chunks=chunks)
    return model, overlap, candidates


def resolve_a2a(cfg: RunConfig, mcfg: Any, mesh: Mesh, topo,
                fb_memory: FbMemory | None = None) -> tuple[str, str, int]:
    """(alltoall, a2a_overlap, a2a_chunks) the EP dispatcher runs, `auto` decided and logged.

    alltoall=auto: dedup where the EP group spans nodes, top-k > 1 and the expected inter-node
    bytes of dedup (`comm.collectives.dedup.dedup_byte_ratio`, uniform routing, or bound to topk_group
    nodes with --comm.route_groups=node) are at most DEDUP_AUTO_MAX_RATIO of flat's; else
    comm's per-call flat / HALO choice. a2a_overlap=auto: `trainer.layout.auto_overlap`, the
    rule the planner prices too: none under tensor parallel or inside one node; across nodes
    fb with 2 chunks where fb runs (>= 2 micro-batches, a pairable schedule, no full
    recompute) and its memory is known to fit, else layer with 2 chunks. The memory:
    `fb_memory` (train.py passes the planner's `tuner.fb_memory.fb_memory_of_run`: the busiest
    rank's predicted peak with fb's in-flight micro-batches, and their extra activations)
    against `fb_budget` (0.9 of the free device memory now, before any weight is allocated;
    on CPU of the host's available memory per local rank), the least budget over all ranks;
    without `fb_memory` the memory is not known and auto runs layer. fb also needs every EP
    group across nodes (all ranks pair their micro-batches or none do): a run where one
    group lies in a node runs layer where its groups span nodes. a2a_chunks=auto: 2 under
    auto and layer (a fixed choice, not priced; the planner's `tuner.costs.a2a_exposed`
    prices 1, 2, 4, 8); 1 under an explicit fb, where the other micro-batch's work runs
    beside it.

    These rules are auto's prior: where --comm.auto_trial > 0 and auto has more than one
    choice left (`trial_candidates`), the first training steps time them and the fastest runs
    on (`trainer.a2a_trial.StepTrial`)."""
    from comm.collectives.dedup import DEDUP_AUTO_MAX_RATIO, dedup_byte_ratio

    from .layout import auto_overlap, fb_problems
    from .setup import a2a_chunks

    c = cfg.comm
    algo, overlap, chunks = c.alltoall, c.a2a_overlap, a2a_chunks(c.a2a_chunks)
    if mesh.ep == 1:
        return algo, "none", 1
    nodes = topo.num_nodes if topo is not None else 1
    if mesh.tp > 1:  # the pipelined expert path is not built with tensor parallel
        if overlap == "auto" or algo == "auto":
            log("comm.alltoall / a2a_overlap=auto: no dedup, no overlap under tensor parallel "
                f"(tp={mesh.tp})", mesh.rank)
        return algo, "none", 1
    if algo == "auto" and nodes > 1 and mcfg.top_k > 1:
        bound = min(mcfg.topk_group, nodes) if c.route_groups == "node" else 0
        ratio = dedup_byte_ratio(nodes, mcfg.top_k, mcfg.n_routed_experts, mcfg.d_model, 4,
                                 bound)
        if ratio <= DEDUP_AUTO_MAX_RATIO:
            algo = "dedup"
        log(f"comm.alltoall=auto: {algo} (EP over {nodes} nodes at top-{mcfg.top_k}"
            f"{f', tokens on <= {bound} nodes' if bound else ''}: dedup sends an expected "
            f"{ratio:.2f}x flat's inter-node bytes; it runs at <= {DEDUP_AUTO_MAX_RATIO})",
            mesh.rank)
    if overlap == "auto":
        par, t = cfg.parallel, cfg.train
        peak = extra = budget = None
        every_group_spans = True
        # every input below is the same on every rank (the config, the planner's estimate),
        # so every rank takes this branch or none does: the collective in it is safe
        if fb_memory is not None and not fb_problems(par.microbatches, mesh.pp, par.schedule,
                                                     t.checkpointing):
            try:
                peak, extra = fb_memory(cfg, mcfg, mesh.layout, _backend())
            except ValueError as e:  # a layout the planner does not model: not known
                log(f"comm.a2a_overlap=auto: fb's memory not estimated ({e})", mesh.rank)
            if peak is not None:
                budget, least_nodes = _world_min([fb_budget(), float(nodes)])
                budget = None if budget < 0 else budget
                every_group_spans = least_nodes > 1
        overlap, auto_chunks, why = auto_overlap(
            nodes, tp=mesh.tp, microbatches=par.microbatches, pp=mesh.pp, schedule=par.schedule,
            recompute=t.checkpointing, fb_peak=peak, budget=budget, fb_extra=extra)
        if overlap == "fb" and not every_group_spans:
            overlap, why = "layer", (f"{why}; not fb: an EP group of the run lies in one node "
                                     f"(every rank pairs its micro-batches or none does)")
        log(f"comm.a2a_overlap=auto: {overlap} ({why})", mesh.rank)
        if overlap != "none" and not chunks:
            chunks = auto_chunks
            log(f"comm.a2a_chunks=auto: {chunks} (a2a_overlap=auto)", mesh.rank)
    if overlap == "layer" and not chunks:
        chunks = 2
        log("comm.a2a_chunks=auto: 2", mesh.rank)
    if overlap == "fb" and not chunks:  # the other micro-batch's work hides the exchange
        chunks = 1
        log("comm.a2a_chunks=auto: 1 (a2a_overlap=fb)", mesh.rank)
    return algo, overlap, max(chunks, 1)


def trial_candidates(alltoall: str, a2a_overlap: str, rule_algo: str, rule_overlap: str,
                     chunks: int, nodes: int, top_k: int) -> list[tuple[str, str, int]]:
    """What `auto`'s trial (`trainer.a2a_trial`) times, the rules' own choice first (it wins
    ties): with alltoall=auto over several nodes the rule's algorithm, auto (comm's per-call
    flat / HALO choice), flat (auto without its per-call planning: on the emulator's shared
    cores that planning cost 5-10 % of a step) and, at top-k > 1, dedup; with
    a2a_overlap=auto, where the rule would overlap, its overlap (layer or fb, at `chunks`)
    against none. Fixed choices are not re-opened. One candidate: no trial."""
    algos = [rule_algo]
    if alltoall == "auto" and nodes > 1:
        algos += [a for a in ("auto", "flat", "dedup" if top_k > 1 else "")
                  if a and a != rule_algo]
    ovs = [(rule_overlap, chunks if rule_overlap != "none" else 1)]
    if a2a_overlap == "auto" and rule_overlap != "none":
        ovs.append(("none", 1))
    return [(a, o, k) for a in algos for o, k in ovs]


FB_BUDGET_SHARE = 0.9  # of the free memory: allocator slack, as the platforms' usable_fraction


def fb_budget() -> float:
    """Bytes this rank may plan to use, for auto's fb memory check: FB_BUDGET_SHARE of the
    CUDA device's free memory (`torch.cuda.mem_get_info`, at start-up: before any weight is
    allocated, after the context and whatever else holds the device), on CPU of the host's
    available memory (/proc/meminfo MemAvailable) over the LOCAL_WORLD_SIZE ranks sharing it;
    -1 where neither can be read (not known)."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return FB_BUDGET_SHARE * free
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return -1.0
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return FB_BUDGET_SHARE * kb * 1024 / local


def _backend() -> str:
    """The process group's backend as the planner's precision policy reads it."""
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "nccl" if torch.cuda.is_available() else "gloo"


def _world_min(values: list[float]) -> list[float]:
    """Each value's least over all ranks (unchanged without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def node_blocks(mcfg: Any, mesh: Mesh, topo, check: bool = False) -> list[list[int]]:
    """--comm.route_groups=node: the EP group's ranks per node (the blocks migration keeps
    experts in). With `check`, a ConfigError unless routing groups can be bound to nodes: an
    EP group over N > 1 nodes of equal size holding consecutive EP ranks (then expert e's
    initial slot e is on node e // (E / N)) and n_group a multiple of N (each node holds
    n_group / N whole groups, so a token's topk_group groups lie on <= topk_group nodes)."""
    N = topo.num_nodes if topo is not None else 1
    if check:
        if mesh.ep == 1 or N == 1:
            raise ConfigError(f"comm.route_groups=node needs an EP group spanning nodes; it "
                              f"has ep={mesh.ep} on {N} node(s)")
        G = mesh.ep // N
        if any(tuple(topo.node_ranks(m)) != tuple(range(m * G, (m + 1) * G))
               for m in range(N)):
            raise ConfigError("comm.route_groups=node needs every node to hold consecutive "
                              f"EP ranks in equal numbers; the EP group's nodes hold "
                              f"{[list(topo.node_ranks(m)) for m in range(N)]}")
        if mcfg.n_group < 2 or mcfg.n_group % N:
            raise ConfigError(f"comm.route_groups=node: model.n_group={mcfg.n_group} must be a "
                              f"multiple of the EP group's {N} nodes (> 1), e.g. "
                              f"--model.n_group={N} --model.topk_group=1")
        log(f"comm.route_groups=node: {mcfg.n_group} routing groups on {N} nodes "
            f"({mcfg.n_group // N} per node): a token reaches at most "
            f"{min(mcfg.topk_group, N)} node(s)", mesh.rank)
    return [list(topo.node_ranks(m)) for m in range(N)] if topo is not None else []


def ep_topology(cfg: RunConfig, mesh: Mesh, algo: str):
    """The EP group's topology (collective: every rank calls it): HALO, dedup and auto plan
    with it, and every dispatcher counts the rows it sends off its node with it."""
    if mesh.ep == 1 or not dist.is_initialized():
        return None
    from comm import Topology

    path = cfg.comm.topology
    full = Topology.from_file(path) if path else Topology.discover(dist.group.WORLD)
    if full.world_size != mesh.world_size:
        raise ConfigError(f"topology {path or '(discovered)'} describes {full.world_size} ranks "
                          f"but the run has {mesh.world_size}")
    log(full.summary(), mesh.rank)
    return full.for_group(mesh.ep_group)


def calibrate_auto(mesh: Mesh, mcfg: Any, topo):
    """Fit the flat-vs-HALO cost model on this EP group's real links, once, so that `auto`
    decides with measured numbers (collective over every EP group at once)."""
    from comm import calibrate

    t0 = time.perf_counter()
    log("calibrating the all-to-all cost model for comm.alltoall=auto (EP group spans "
        f"{topo.num_nodes} nodes) ...", mesh.rank)
    model = calibrate(mesh.ep_group, topo, row_numel=mcfg.d_model)
    log(f"calibrated in {time.perf_counter() - t0:.1f} s: NIC {model.nic_bandwidth / 1e6:.1f} "
        f"MB/s (HALO), {(model.flat_nic_bandwidth or model.nic_bandwidth) / 1e6:.1f} MB/s "
        f"(flat), intra-node {model.local_bandwidth / 1e6:.0f} MB/s, per message "
        f"{1e6 * model.alpha_net:.0f} us, HALO overhead {1e6 * model.halo_overhead_s:.0f} us",
        mesh.rank)
    return model


@dataclass
class Pipeline:
    """This rank's pipeline stages (global stage index -> Stage) and the runtimes that run
    them: `runtime` the training schedule, `eval_runtime` the forward-only one (evaluation,
    one micro-batch of the shard's whole batch)."""
    stages: dict
    schedule: Any
    runtime: Any
    eval_runtime: Any
    n_stages: int
    bounds: list[int]
    act_shape: tuple[int, int, int]  # one micro-batch's activation at a stage boundary


def build_pipeline(cfg: RunConfig, mcfg: Any, mesh: Mesh, model, precision,
                   device: torch.device, fb: bool = False) -> Pipeline:
    """This rank's stages and runtimes; `fb`: the paired schedule of --comm.a2a_overlap=fb
    (the overlap `build_model` resolved is fb)."""
    import pipeline

    par, t = cfg.parallel, cfg.train
    n_stages = mesh.pp * par.n_virtual
    bounds = split_layers(mcfg.n_layers, n_stages, par.layer_split)
    stages = build_stages(model, mesh.pp, mesh.pp_idx, par.n_virtual, bounds,
                          precision.autocast, stream_dtype=precision.param)
    schedule = build_schedule(par, mesh.pp, fb=fb)
    per_shard = t.global_batch // mesh.n_data_shards
    # under sequence parallel a stage boundary carries this TP rank's slice of the sequence
    seq = t.seq_len // mesh.tp if mesh.tp > 1 and par.sp else t.seq_len
    act_shape = (per_shard // par.microbatches, seq, mcfg.d_model)
    runtime = pipeline.PipelineRuntime(schedule, stages, cross_entropy, act_shape, group=mesh.pp_group,
                                       device=device, aux_fn=moe_aux)
    evaluation = pipeline.PipelineRuntime(pipeline.forward_only(mesh.pp, 1, par.n_virtual), stages,
                                          cross_entropy, (per_shard, seq, mcfg.d_model),
                                          group=mesh.pp_group, device=device)
    return Pipeline(stages, schedule, runtime, evaluation, n_stages, bounds, act_shape)


def apply_tp(cfg: RunConfig, model, mesh: Mesh, device: torch.device) -> None:
    """Tensor (and sequence) parallel of the dense side over the mesh's TP groups, after the
    model is materialised with the 1-process values (trainer/distributed/tensor_parallel.py)."""
    if mesh.tp == 1:
        return
    from .distributed.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(model, mesh.tp_mesh(device.type), cfg.parallel.sp)


def import_hf(model, hf, hf_path: str, out: Path, mesh: Mesh, device: torch.device) -> None:
    """Initial weights from --model.hf_path: each rank reads only the tensors it holds (its
    stage's layers, its experts in their slots); what it read goes to
    <out_dir>/hf_import/rank_<r>.json."""
    from model.hf_checkpoint import load_hf_weights

    rank = mesh.rank
    t0 = time.perf_counter()
    log(f"loading weights from {hf_path} ({hf.model_type}, {len(hf.shapes):,} tensors in "
        f"{len(set(hf.files.values()))} file(s)) ...", rank)
    rss0 = rss_reset_peak()
    got = load_hf_weights(model, hf)
    hf.close()
    peak = rss_peak()
    rec = out / "hf_import"
    rec.mkdir(parents=True, exist_ok=True)
    (rec / f"rank_{rank}.json").write_text(json.dumps(
        {"rank": rank, "bytes": got["bytes"], "rss_before": rss0, "rss_peak": peak,
         "keys": sorted({k for k, _ in hf.reads})}))
    total = torch.tensor([float(got["bytes"])], dtype=torch.float64, device=device)
    mine = float(total)
    if mesh.world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    log(f"loaded in {time.perf_counter() - t0:.1f} s: rank 0 read {got['tensors']} tensors "
        f"({mine / 1e6:.1f} MB), the most any rank read {float(total) / 1e6:.1f} MB", rank)


def grad_overlap(cfg: RunConfig, device: torch.device) -> bool:
    """--parallel.grad_overlap: auto = on with ZeRO-1/2 or on a GPU, off for ZeRO-0 on CPU."""
    mode = cfg.parallel.grad_overlap
    if mode == "auto":
        return cfg.parallel.zero > 0 or device.type == "cuda"
    return mode == "true"


def build_grad_sync(cfg: RunConfig, model, mesh: Mesh, device: torch.device):
    """Gradient averaging over each parameter's replicas, and the global gradient norm.

    With overlap, gradients are reduced in buckets launched from the backward's hooks; without,
    after the backward in one flat buffer per group (the losses of earlier versions, bit for
    bit, at ZeRO-0). ZeRO-3: FSDP2 reduce-scatters; `Zero3Sync` scales and clips."""
    zero = effective_zero(cfg.parallel.zero, mesh)
    if zero == 3:
        from .distributed.zero3 import Zero3Sync

        return Zero3Sync(model, mesh)
    return GradSync(model, mesh, zero=zero, overlap=grad_overlap(cfg, device),
                    reduce_dtype=resolve_precision(cfg.train, device.type).reduce)


def build_optimizer(cfg: RunConfig, model, sync: GradSync, masters_from=None):
    """AdamW with weight decay on matrices (dim >= 2) only: torch.optim.AdamW at zero=0 with
    fp32 weights, `trainer.distributed.zero.ZeroOptimizer` at zero=1/2 (sharded by `sync`'s ownership)
    and for bf16 weights (fp32 masters, started from `masters_from`)."""
    o = cfg.optim
    return zero_optimizer(model, sync, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay,
                          masters_from)
