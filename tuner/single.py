"""`python -m tuner estimate`: one layout priced, no search.

The layout is given by its degrees; the data-parallel degrees follow from the GPU count by
parallel folding (`tuner.layout.fold_degrees`): gpus = pp x tp x cp x dp on the dense side
and = pp x etp x ep x edp on the expert side, the EP groups formed from the DP x TP x CP ranks
of a stage (ep x etp must divide tp x cp x dp). Micro-batches: M = global batch / (dp x mbs),
mbs sequences per dense-side data-parallel rank and micro-batch.

`summary` is the machine-readable result (`--json` prints it as the last stdout line): the
keys `step_time_s`, `tokens_per_s_per_gpu`, `model_tflops_per_gpu`, `mfu`, `peak_memory_gb`,
`stage_layers`, `runnable`, `not_runnable_because` are a contract other tools read; more keys
may be added, none of these renamed. A layout `train.py` cannot run yet (TP, CP, ETP, ZeRO-3,
dedup, overlap, FP8) is priced all the same and says what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model import ModelConfig
from tuner.estimate import Estimate, estimate
from tuner.layout import (
    Assumptions,
    ParallelPlan,
    PrecisionPolicy,
    fold_degrees,
    not_runnable,
    plan_stage_layers,
)
from tuner.platform import Platform

__all__ = ["EstimateRequest", "plan_of", "summary", "format_report"]


@dataclass(frozen=True)
class EstimateRequest:
    """The flags of `python -m tuner estimate` (degrees, batch, choices)."""

    gpus: int
    seq: int
    global_batch: int
    mbs: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    zero: int = 0
    recompute: str = "none"
    dispatch: str = "flat"
    a2a_overlap: str = "none"
    precision: str = "bf16"
    schedule: str = ""  # "" = 1f1b, or interleaved-1f1b when vpp > 1
    ep_placement: str = "local"
    redundant: int = 0


def plan_of(req: EstimateRequest) -> ParallelPlan:
    """The `ParallelPlan` of a request; a ValueError naming the bad numbers otherwise."""
    for name in ("gpus", "seq", "global_batch", "mbs", "vpp"):
        v = getattr(req, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} {v!r} must be an int >= 1")
    dp, edp = fold_degrees(req.gpus, req.pp, req.tp, req.cp, req.ep, req.etp)
    if req.global_batch % (dp * req.mbs):
        raise ValueError(
            f"--global-batch {req.global_batch} is not divisible by dp={dp} x mbs={req.mbs} = "
            f"{dp * req.mbs} (dp = gpus / (pp x tp x cp) = {req.gpus} / ({req.pp} x {req.tp} x "
            f"{req.cp})): every data-parallel rank needs whole micro-batches")
    schedule = req.schedule or ("interleaved-1f1b" if req.vpp > 1 else "1f1b")
    if req.vpp > 1 and req.pp < 2:
        raise ValueError(f"--vpp {req.vpp} needs --pp >= 2 (virtual stages interleave a "
                         f"pipeline); got --pp {req.pp}")
    if req.vpp > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"--vpp {req.vpp} needs --schedule interleaved-1f1b (got {schedule!r})")
    return ParallelPlan(
        pp=req.pp, ep=req.ep, dp=edp, microbatches=req.global_batch // (dp * req.mbs),
        global_batch=req.global_batch, seq_len=req.seq, schedule=schedule, n_virtual=req.vpp,
        alltoall=req.dispatch, checkpointing=req.recompute, ep_placement=req.ep_placement,
        zero=req.zero, redundant=req.redundant, tp=req.tp, cp=req.cp, etp=req.etp,
        a2a_overlap=req.a2a_overlap, precision=req.precision)


def _megatron(cfg: ModelConfig, e: Estimate, pf: Platform) -> dict[str, float]:
    """Megatron-Core's model TFLOP/s per GPU and MFU, when tuner.flops provides the formula."""
    try:
        from tuner.flops import megatron_flops_per_token
    except ImportError:
        return {}
    p = e.plan
    flops = megatron_flops_per_token(cfg, p.seq_len) * p.global_batch * p.seq_len
    t = flops / (e.step_time * p.n_gpus)
    return {"megatron_tflops_per_gpu": t / 1e12, "megatron_mfu": t / pf.peak_flops}


def summary(cfg: ModelConfig, pf: Platform, e: Estimate, policy: str) -> dict[str, Any]:
    """The JSON object of one estimate (module docstring: the contract keys come first)."""
    p = e.plan
    why = not_runnable(p)
    out: dict[str, Any] = {
        "step_time_s": e.step_time,
        "tokens_per_s_per_gpu": e.tokens_per_s / p.n_gpus,
        "model_tflops_per_gpu": e.tflops_per_gpu,
        "mfu": e.mfu,
        "peak_memory_gb": e.peak_memory / 1e9,
        "stage_layers": plan_stage_layers(cfg.n_layers, p),
        "runnable": not why,
        "not_runnable_because": why,
        **_megatron(cfg, e, pf),
        "fits": e.fits,
        "usable_memory_gb": pf.usable_hbm / 1e9,
        "model": cfg.name, "platform": pf.name, "gpus": p.n_gpus,
        "layout": {"pp": p.pp, "vpp": p.n_virtual, "tp": p.tp, "cp": p.cp, "dp": p.attn_dp,
                   "ep": p.ep, "etp": p.etp, "edp": p.dp, "microbatches": p.microbatches,
                   "mbs": p.global_batch // (p.attn_dp * p.microbatches),
                   "schedule": p.schedule, "zero": p.zero, "recompute": p.checkpointing,
                   "dispatch": p.alltoall, "a2a_overlap": p.a2a_overlap,
                   "precision": p.precision, "ep_placement": p.ep_placement,
                   "redundant": p.redundant, "precision_policy": policy},
        "time_s": dict(e.time),
        "dp_collectives_s": dict(e.dp_collectives),
        "stages": [{"rank": s.rank, "layers": list(s.layers), "weights_gb": s.weights / 1e9,
                    "grads_gb": s.grads / 1e9, "optimizer_gb": s.optimizer / 1e9,
                    "activations_gb": s.activations / 1e9, "buffers_gb": s.buffers / 1e9,
                    "total_gb": s.total / 1e9} for s in e.stages],
        "notes": list(e.notes),
    }
    return out


def run(cfg: ModelConfig, pf: Platform, req: EstimateRequest, precision: PrecisionPolicy,
        assumptions: Assumptions) -> Estimate:
    """The estimate of one request (validated before any pricing)."""
    return estimate(cfg, plan_of(req), pf, precision, assumptions)


def format_report(s: dict[str, Any]) -> str:
    """The human-readable report of a `summary`."""
    L = s["layout"]
    lines = [
        f"{s['model']} on {s['gpus']} x {s['platform']}: pp={L['pp']} vpp={L['vpp']} "
        f"tp={L['tp']} cp={L['cp']} dp={L['dp']} | ep={L['ep']} etp={L['etp']} edp={L['edp']}; "
        f"{L['microbatches']} micro-batches of {L['mbs']} sequence(s), {L['schedule']}",
        f"  ZeRO-{L['zero']}, recompute {L['recompute']}, dispatch {L['dispatch']}, all-to-all "
        f"overlap {L['a2a_overlap']}, {L['precision']} GEMMs, state precision "
        f"{L['precision_policy']}",
        f"step time {s['step_time_s']:.4g} s, {s['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU",
        f"model TFLOP/s per GPU {s['model_tflops_per_gpu']:.4g}, MFU {100 * s['mfu']:.1f} % "
        f"(ours: ModelConfig.flops_per_token, 6 x matmul parameters + full s x s attention)",
    ]
    if "megatron_tflops_per_gpu" in s:
        lines.append(f"Megatron-Core formula: {s['megatron_tflops_per_gpu']:.4g} TFLOP/s per GPU, "
                     f"MFU {100 * s['megatron_mfu']:.1f} % (tuner.flops.megatron_flops_per_token,"
                     f" what published MoE tables report)")
    lines.append(f"peak memory {s['peak_memory_gb']:.2f} GB of {s['usable_memory_gb']:.2f} GB "
                 f"usable: {'fits' if s['fits'] else 'DOES NOT FIT'}")
    t = s["time_s"]
    lines.append("time per step (s, busiest rank): " + ", ".join(
        f"{k} {v:.4g}" for k, v in t.items() if v))
    for st in s["stages"]:
        lines.append(f"  stage rank {st['rank']}: layers {len(st['layers'])} "
                     f"({st['layers'][0]}-{st['layers'][-1]}), weights {st['weights_gb']:.2f}, "
                     f"grads {st['grads_gb']:.2f}, optimizer {st['optimizer_gb']:.2f}, "
                     f"activations {st['activations_gb']:.2f}, buffers {st['buffers_gb']:.2f} "
                     f"= {st['total_gb']:.2f} GB")
    lines.append(f"stage layers (stage s on pipeline rank s % pp): {s['stage_layers']}")
    if s["runnable"]:
        lines.append("runnable: yes (train.py runs this layout)")
    else:
        lines.append("runnable: no, train.py lacks: " + "; ".join(s["not_runnable_because"]))
    lines += [f"  assumption: {n}" for n in s["notes"]]
    return "\n".join(lines)
