"""Set-up: validate the request and resolve it into a model config, a mesh and a corpus.

Everything that can be wrong with the request (preset, overrides, mesh vs world size, EP vs
expert count, data path, sequence length, resume checkpoint) is checked in `prepare()` before
any process group work or training step.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from comm.tools.affinity import check_mode
from model.attention import DOC_ATTENTION

from .checkpoint import CheckpointError, check_same_model, find_latest, read_meta
from .config import ConfigError, RunConfig
from .data import Blend, Corpus, load_data
from .distributed.mesh import Mesh
from .distributed.precision import check_precision
from .distributed.tensor_parallel import tp_problems
from .distributed.zero import check_zero
from .layout import (
    RECOMPUTE,
    TRAINER_A2A_OVERLAP,
    TRAINER_ALLTOALL,
    check,
    check_choice,
    check_redundant,
    divisors,
    fb_problems,
    pipelined_expert_path,
)
from .observe.metrics import check_observability
from .observe.profiling import parse_profile_steps

__all__ = ["Prepared", "prepare", "build_model_config", "build_schedule", "model_name",
           "peak_flops", "REPLAN_MODES", "check_elastic", "layout_problem", "replan_platform",
           "platform_file"]

# bf16 dense matrix peak per device (docs/reference.md 3); unknown devices: --train.peak_tflops
_GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "MI250X": 191.5, "MI250": 191.5}


def build_model_config(cfg: RunConfig, hf=None):
    """The run's ModelConfig: the preset's (or, with `hf`, an opened `model.HFCheckpoint` of
    --model.hf_path, its config.json's), then the [model] overrides."""
    from model import presets

    if hf is not None:
        mcfg = hf.model_config()
    else:
        try:
            mcfg = presets.get(cfg.model.preset)
        except KeyError as e:
            raise ConfigError(str(e.args[0]) if e.args else str(e)) from None
    if cfg.model.overrides:
        valid = {f.name for f in dataclasses.fields(mcfg)}
        bad = sorted(set(cfg.model.overrides) - valid)
        if bad:
            raise ConfigError(f"unknown model field(s) {bad}; valid ModelConfig fields: {sorted(valid)}")
        try:
            mcfg = dataclasses.replace(mcfg, **cfg.model.overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model overrides {cfg.model.overrides}: {e}") from None
    return mcfg


@dataclass
class Prepared:
    cfg: RunConfig
    mcfg: Any
    mesh: Mesh
    corpus: Corpus | Blend
    resume_path: Path | None
    hf: Any = None  # model.HFCheckpoint of --model.hf_path (headers only), or None
    hf_skipped: tuple[int, ...] = ()  # checkpoint layers a run with fewer layers does not load
    # what checkpoints record for elastic restarts (trainer.elastic.resolve): the world the
    # configured layout is for, and whether this attempt runs a re-planned layout
    elastic: dict = dataclasses.field(default_factory=dict)
    # --comm.a2a_overlap=auto: the planner's memory of this run under fb (train.py passes
    # `tuner.fb_memory.fb_memory_of_run`, the trainer sits below the tuner); None: not known,
    # so auto does not pick fb (`trainer.build.resolve_a2a`)
    fb_memory: Callable[..., tuple[float, float]] | None = None
    # the cores train.py pinned this rank to (--train.cpu_affinity, comm.tools.affinity);
    # None: placement left to the OS
    cpu_cores: list[int] | None = None


def prepare(cfg: RunConfig, world_size: int, rank: int) -> Prepared:
    """All request validation, before any training work. Raises a ValueError subclass."""
    hf = hf_skipped = None
    if cfg.model.hf_path:
        from model.hf_checkpoint import HFCheckpoint

        hf = HFCheckpoint(cfg.model.hf_path)  # config.json and safetensors headers only
    mcfg = build_model_config(cfg, hf)
    if hf is not None:
        try:
            hf_skipped = hf.validate(mcfg)  # missing / extra / mis-shaped tensors, named
        except ValueError as e:
            raise ConfigError(f"--model.hf_path: {e}") from None
    par = cfg.parallel
    _check_virtual(par)
    mesh = Mesh.plan(world_size, rank, pp=par.pp, ep=par.ep, dp=par.dp, placement=par.ep_placement,
                     vpp=par.n_virtual, tp=par.tp)
    E = mcfg.n_routed_experts
    if not isinstance(par.sp, bool):
        raise ConfigError(f"parallel.sp={par.sp!r}; valid: true, false")
    tp_probs = tp_problems(par.tp, par.sp, par.etp, mcfg, cfg.train.seq_len, par.pp)
    if tp_probs:
        raise ConfigError("; ".join(tp_probs))
    if par.tp > 1 and pipelined_expert_path(cfg.comm.alltoall, cfg.comm.a2a_overlap):
        raise ConfigError(f"parallel.tp={par.tp} with comm.alltoall={cfg.comm.alltoall!r} / "
                          f"comm.a2a_overlap={cfg.comm.a2a_overlap!r}: the pipelined expert path "
                          f"(dedup, layer and fb overlap) is not built with tensor parallel yet; use "
                          f"alltoall flat, halo or auto and a2a_overlap none or auto (auto "
                          f"keeps it off under TP)")
    if mesh.pp > 1 and mcfg.tie_embeddings:
        raise ConfigError("tie_embeddings=True with pp > 1 is not supported (the embedding and the "
                          "head would live on different stages); use pp=1 or untied embeddings")
    # the layout's own rules (trainer.layout, the planner's too): ep | experts, the stage split
    check(mesh.layout, mcfg.n_layers, E, layer_split=par.layer_split, n_heads=mcfg.n_heads,
          n_kv_heads=mcfg.n_kv_heads if mcfg.attention == "gqa" else None)
    if mesh.pp > 1:
        _check_microbatches(cfg, mesh)
    # with pp=1 the schedule is unused, but a wrong value is still a mistake worth naming
    _check_schedule(par, mesh.pp)
    if par.grad_overlap not in ("auto", "true", "false"):
        raise ConfigError(f"parallel.grad_overlap={par.grad_overlap!r}; valid: auto, true, false")
    zero_note = check_zero(cfg, mesh)  # a replica group of one rank: ZeRO has no effect there
    if zero_note and rank == 0:
        print(f"note: {zero_note}", file=sys.stderr, flush=True)
    _check_redundant(cfg.balance.redundant, E, mesh.ep)
    check_choice("comm.alltoall", cfg.comm.alltoall, TRAINER_ALLTOALL)
    check_choice("comm.a2a_overlap", cfg.comm.a2a_overlap, TRAINER_A2A_OVERLAP)
    a2a_chunks(cfg.comm.a2a_chunks)
    if isinstance(cfg.comm.auto_trial, bool) or not isinstance(cfg.comm.auto_trial, int) \
            or cfg.comm.auto_trial < 0:
        raise ConfigError(f"comm.auto_trial={cfg.comm.auto_trial!r}; valid: an integer >= 0 "
                          f"(rounds of auto's trial; 0 = no trial)")
    if cfg.comm.a2a_overlap == "fb":
        check_fb(cfg, mesh.pp)
    check_choice("comm.route_groups", cfg.comm.route_groups, ("none", "node"))
    if cfg.comm.route_groups == "node" and cfg.balance.redundant:
        raise ConfigError(f"comm.route_groups=node with balance.redundant="
                          f"{cfg.balance.redundant} is not built (replicas are placed "
                          f"without regard to nodes); use balance.redundant=0")
    if cfg.comm.topology:
        from comm import Topology

        if not Path(cfg.comm.topology).is_file():
            raise ConfigError(f"comm.topology={cfg.comm.topology!r} does not exist; pass a TOML "
                              f"topology file (see comm/topology/file.py) or omit it to discover")
        topo = Topology.from_file(cfg.comm.topology)  # raises ValueError naming the bad node
        if topo.world_size != world_size:
            raise ConfigError(f"comm.topology={cfg.comm.topology!r} describes {topo.world_size} "
                              f"ranks but the run has {world_size}")
    t = cfg.train
    check_choice("train.checkpointing", t.checkpointing, RECOMPUTE)
    if t.seq_len < 1 or t.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} is outside what the model supports: "
                          f"1..{mcfg.max_seq_len} (model max_seq_len)")
    if t.global_batch < 1 or t.global_batch % mesh.n_data_shards:
        raise ConfigError(f"train.global_batch={t.global_batch} must be a positive multiple of the "
                          f"{mesh.n_data_shards} data shards (dp={mesh.dp} x ep={mesh.ep}"
                          + (f" / tp={mesh.tp})" if mesh.tp > 1 else ")"))
    if mesh.pp == 1:  # gradient accumulation (pipeline micro-batches were checked above)
        _check_microbatches(cfg, mesh)
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps} must be >= 1")
    o = cfg.optim
    # lr = 0 is allowed (weights stay bitwise unchanged: import/export round trips, evaluation)
    if not (math.isfinite(o.lr) and o.lr >= 0) or not (math.isfinite(o.min_lr) and o.min_lr >= 0):
        raise ConfigError(f"optim.lr={o.lr}, optim.min_lr={o.min_lr}: need a finite lr >= 0 and "
                          f"min_lr >= 0")
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} exceeds optim.lr={o.lr}: the cosine schedule "
                          f"decays from lr to min_lr; use min_lr <= lr")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    for name, b in (("beta1", o.beta1), ("beta2", o.beta2)):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optim.{name}={b} must be in [0, 1)")
    if o.weight_decay < 0 or o.grad_clip < 0 or o.eps <= 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay}, grad_clip={o.grad_clip} must be "
                          f">= 0 and optim.eps={o.eps} > 0")
    for name in ("ckpt_every", "eval_every", "stop_after", "max_nonfinite_steps"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    if t.eval_batches < 1 or t.log_every < 1 or t.ckpt_keep < 1:
        raise ConfigError(f"train.eval_batches={t.eval_batches}, log_every={t.log_every}, "
                          f"ckpt_keep={t.ckpt_keep} must be >= 1")
    if t.memory_report_every < 1:
        raise ConfigError(f"train.memory_report_every={t.memory_report_every} must be >= 1 "
                          f"(1 = meter every step)")
    _check_debug(cfg.debug, world_size)
    if cfg.balance.enabled:
        from balance import METHODS, MigrationPolicy

        bal = cfg.balance
        if bal.method != "default" and bal.method not in METHODS:
            raise ConfigError(f"balance.method={bal.method!r}; valid: default, {', '.join(METHODS)}")
        MigrationPolicy(threshold=bal.threshold, window=bal.window, cooldown=bal.cooldown,
                        max_swaps=bal.max_swaps)  # raises ValueError naming a bad value
    check_mode(t.cpu_affinity)  # the affinity module's own check (ValueError naming the value)
    if t.nan_policy not in ("skip", "stop"):
        raise ConfigError(f"train.nan_policy={t.nan_policy!r}; valid: skip, stop")
    if t.timeout_s <= 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be > 0 seconds")
    check_precision(t)
    check_observability(t)
    check_elastic(cfg)
    parse_profile_steps(t.profile_steps, t.steps)
    d = cfg.data
    if d.doc_attention not in DOC_ATTENTION:
        raise ConfigError(f"--data.doc_attention={d.doc_attention!r}; valid: "
                          f"{', '.join(DOC_ATTENTION)}")
    if d.doc_mask and d.doc_attention == "flex" and not torch.cuda.is_available():
        raise ConfigError("--data.doc_attention=flex needs a CUDA GPU to train: torch's "
                          "flex_attention has no CPU backward; use auto (= varlen off CUDA), "
                          "varlen or dense")
    corpus = load_data(d.path, d.val_fraction, blend=d.blend, sampling=d.sampling,
                       loss_mask=d.loss_mask)
    corpus.check(t.seq_len, mcfg.vocab_size)
    if t.export_hf:
        from .export import check_out_dir, pick_model_type

        try:  # nothing is overwritten, and the model must be a transformers model type
            check_out_dir(Path(t.export_hf), False, "train.export_hf",
                          "choose a new folder (nothing is overwritten)")
            # the meta.json entries export reads at the end of the run
            pick_model_type(mcfg, {"run": cfg.to_dict(),
                                   "hf": {"model_type": hf.model_type} if hf else None}, None)
        except ValueError as e:
            raise ConfigError(f"train.export_hf: {e}") from None
    if cfg.data.doc_mask and corpus.eos_id is None:
        raise ConfigError(f"--data.doc_mask=true needs documents that end with an EOS token: a "
                          f"tokenized .bin with its sidecar naming eos_id (python -m trainer.data "
                          f"prepare); {corpus.source} has none")
    resume_path = None
    if t.resume:
        root = Path(t.out_dir) / "checkpoints"
        if t.resume in ("latest", "auto"):
            resume_path = find_latest(root)
            if resume_path is None and t.resume == "latest":
                raise CheckpointError(f"--resume: no complete checkpoint under {str(root)!r}; "
                                      f"use --train.resume=auto to start fresh when there is none")
        else:
            resume_path = Path(t.resume)
        if resume_path is not None:
            meta = read_meta(resume_path)  # fails early on an incomplete/corrupt checkpoint
            check_same_model(resume_path, meta, mcfg.to_dict())
    if hf_skipped and rank == 0:
        print(f"warning: --model.hf_path {cfg.model.hf_path!r} has {len(hf_skipped) + mcfg.n_layers}"
              f" layers, the run builds {mcfg.n_layers} (model.n_layers): checkpoint layers "
              f"{list(hf_skipped)} are skipped", file=sys.stderr, flush=True)
    return Prepared(cfg, mcfg, mesh, corpus, resume_path, hf, tuple(hf_skipped or ()))


def a2a_chunks(value: object) -> int:
    """--comm.a2a_chunks as an int >= 1, or 0 for auto; a ConfigError naming the value else."""
    text = str(value).strip()
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or isinstance(value, bool):
        raise ConfigError(f"comm.a2a_chunks={value!r}; valid: an integer >= 1, or auto")
    return n


def _check_debug(d, world_size: int) -> None:
    """The [debug] knobs (tests and benchmarks), checked whether or not the run uses them."""
    if not 0 <= d.fault_rank < world_size:
        raise ConfigError(f"debug.fault_rank={d.fault_rank} is not a rank of this run: "
                          f"valid 0..{world_size - 1}")
    for name in ("fault_nan_step", "fault_stall_step", "force_every"):
        if getattr(d, name) < 0:
            raise ConfigError(f"debug.{name}={getattr(d, name)} must be >= 0 (0 = off)")
    if not math.isfinite(d.skew):
        raise ConfigError(f"debug.skew={d.skew} must be a finite number (0 = off)")


def _check_redundant(r: int, E: int, ep: int) -> None:
    """balance.redundant: `trainer.layout.check_redundant`'s rule, named by its flag."""
    try:
        check_redundant(r, E, ep, "balance.redundant")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def model_name(cfg: RunConfig) -> str:
    return cfg.model.hf_path or cfg.model.preset


def build_schedule(par, pp: int, fb: bool = False):
    """The pipeline schedule of the run config's parallel section (validated by the builder);
    `fb`: its paired form for --comm.a2a_overlap=fb (`pipeline.schedule.build_fb`)."""
    import pipeline
    from pipeline.schedule import build_fb

    kw = {"n_virtual": par.n_virtual} if par.schedule == "interleaved-1f1b" else {}
    if fb:
        return build_fb(par.schedule, pp, par.microbatches, **kw)
    return pipeline.build(par.schedule, pp, par.microbatches, **kw)


def _check_microbatches(cfg: RunConfig, mesh: Mesh) -> None:
    """Micro-batches split each data shard's sequences: pipeline micro-batches with pp > 1,
    gradient accumulation with pp = 1."""
    par = cfg.parallel
    per_shard = cfg.train.global_batch // max(1, mesh.n_data_shards)
    if par.microbatches < 1 or per_shard % par.microbatches:
        raise ConfigError(
            f"parallel.microbatches={par.microbatches} must divide the {per_shard} sequences each "
            f"data shard gets per step (train.global_batch={cfg.train.global_batch} / "
            f"{mesh.n_data_shards} shards); valid: {divisors(per_shard)}")




def check_fb(cfg: RunConfig, pp: int) -> None:
    """--comm.a2a_overlap=fb pairs one micro-batch's backward with another's forward: it needs
    two micro-batches, a schedule it can pair, and no block recompute in the backward
    (`trainer.layout.fb_problems`, the rule `auto` keeps to as well)."""
    problems = fb_problems(cfg.parallel.microbatches, pp, cfg.parallel.schedule,
                           cfg.train.checkpointing)
    if problems:
        raise ConfigError("; ".join(f"comm.a2a_overlap=fb with {p}" for p in problems))


def _check_virtual(par) -> None:
    if par.n_virtual < 1 or (par.n_virtual > 1 and par.schedule != "interleaved-1f1b"):
        raise ConfigError(f"parallel.n_virtual={par.n_virtual}: values > 1 need "
                          f"parallel.schedule='interleaved-1f1b' (got {par.schedule!r})")


def _check_schedule(par, pp: int) -> None:
    """The schedule name and its numbers; with pp=1 too, where they are not used
    (`parallel.n_virtual` is checked before the mesh is planned, `_check_virtual`)."""
    if par.microbatches < 1:
        raise ConfigError(f"parallel.microbatches={par.microbatches} must be >= 1")
    try:
        build_schedule(par, pp)
    except ValueError as e:
        raise ConfigError(f"parallel.schedule={par.schedule!r} with pp={pp}, "
                          f"microbatches={par.microbatches}: {e}") from None


def peak_flops(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return tf * 1e12, f"{name} bf16 peak"
        return 0.0, f"{name}: unknown peak (set --train.peak_tflops)"
    # CPU: no published peak for an arbitrary host; measure this process's fp32 matmul rate.
    # Best of several short runs, so a busy neighbour lowers the estimate as little as possible.
    n = 768
    a = torch.randn(n, n)
    a @ a
    best = 0.0
    for _ in range(8):
        t0 = time.perf_counter()
        a @ a
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best, "best measured fp32 matmul rate of this process"


# -- elastic restarts (trainer/elastic.py decides; the checks are prepare()'s) ------------------
REPLAN_MODES = ("auto", "off")
# platform names resolve here (tuner.platform.PLATFORM_DIR, which owns the format; the trainer
# sits below the tuner and only checks that the file exists, the planner reads it)
PLATFORM_DIR = Path(__file__).resolve().parents[1] / "configs" / "platforms"


def platform_file(name: str) -> Path | None:
    """The platform TOML `--train.platform` names (a path, or a name under configs/platforms)."""
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        return p
    q = PLATFORM_DIR / f"{name}.toml"
    return q if q.is_file() else None


def replan_platform(cfg: RunConfig) -> str:
    """The platform a re-plan prices layouts on: --train.platform, default `local`."""
    return cfg.train.platform or "local"


def check_elastic(cfg: RunConfig) -> None:
    """--train.replan, --train.replan_trials, --train.platform: a ConfigError naming the bad
    value and what is valid (checked on every run, whether it re-plans or not)."""
    t = cfg.train
    check_choice("train.replan", t.replan, REPLAN_MODES)
    if isinstance(t.replan_trials, bool) or t.replan_trials < 1:
        raise ConfigError(f"train.replan_trials={t.replan_trials} must be >= 1 (planner trials "
                          f"when an attempt re-plans; default 100)")
    if (t.platform or t.replan == "auto") and platform_file(replan_platform(cfg)) is None:
        names = sorted(p.stem for p in PLATFORM_DIR.glob("*.toml"))
        raise ConfigError(f"train.platform={replan_platform(cfg)!r} is not a platform file; valid: "
                          f"{', '.join(names)} (in {PLATFORM_DIR}) or a path to a .toml file "
                          f"(python -m tuner measure writes one for this machine)")
    if t.replan == "auto" and not t.resume:
        raise ConfigError("train.replan=auto re-plans when an attempt resumes a checkpoint of "
                          "another world size; it needs --train.resume=auto (or latest, or a "
                          "checkpoint path)")


def layout_problem(cfg: RunConfig, mcfg: Any, world: int) -> str:
    """Why `cfg`'s layout cannot run on `world` ranks ('' when it can): the mesh, the layer
    and expert split, micro-batches, schedule, ZeRO and redundant-slot rules of `prepare()`."""
    par = cfg.parallel
    try:
        _check_virtual(par)
        mesh = Mesh.plan(world, 0, pp=par.pp, ep=par.ep, dp=par.dp, placement=par.ep_placement,
                         vpp=par.n_virtual, tp=par.tp)
        check(mesh.layout, mcfg.n_layers, mcfg.n_routed_experts, layer_split=par.layer_split,
              n_heads=mcfg.n_heads,
              n_kv_heads=mcfg.n_kv_heads if mcfg.attention == "gqa" else None)
        if mesh.pp > 1 and mcfg.tie_embeddings:
            return "tie_embeddings=True needs pp=1"
        t = cfg.train
        if t.global_batch % mesh.n_data_shards:
            return (f"train.global_batch={t.global_batch} is not a multiple of the "
                    f"{mesh.n_data_shards} data shards (dp={mesh.dp} x ep={mesh.ep})")
        _check_microbatches(cfg, mesh)
        _check_schedule(par, mesh.pp)
        if cfg.comm.a2a_overlap == "fb":
            check_fb(cfg, mesh.pp)
        check_zero(cfg, mesh)
        _check_redundant(cfg.balance.redundant, mcfg.n_routed_experts, mesh.ep)
    except ValueError as e:
        return str(e)
    return ""
