"""What the planner hands back: a ranked table, a plot, a plan file and its launch lines.

The plan file is TOML that `train.py --plan FILE` applies like a config file: the run config
lives under `[run.<section>]` (model; parallel, incl. `ep_placement`, `zero` and, with more
than one stage, `layer_split`: the planned layers per stage, so the run cuts the stages the
estimate priced; comm: `alltoall`, `a2a_overlap` and `a2a_chunks`, the overlap mode and the
chunks it was priced with, `tuner.space.overlap_chunks`; train,
incl. `checkpointing`; balance, `redundant`, only when the plan has redundant expert slots),
so every choice of the plan is run as planned; `[plan]` records the request
and the prediction (and, after `--measure`, the measurement), so that a run can be compared
with what was predicted.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from trainer.layout import layer_split_spec, rank_chunks, stage_layers
from tuner.estimate import Estimate
from tuner.layout import ParallelPlan
from tuner.platform import Platform
from tuner.search import Candidate
from tuner.space import overlap_chunks

__all__ = ["format_table", "plan_toml", "run_sections", "launch_lines", "sbatch_script",
           "plot_frontier", "zero_summary", "redundant_summary", "overlap_summary", "overlap_label"]

_COLS = ("#", "pp", "ep", "dp", "M", "mbs", "schedule", "a2a", "overlap", "ckpt", "place", "zero",
         "mem GB", "saved GB", "step s", "compute", "all2all", "p2p", "bubble", "dp sync", "MFU %", "TFLOPS")


def _row(i: int, c: Candidate) -> list[str]:
    e = c.estimate
    assert e is not None
    p, t = e.plan, e.time
    sched = p.schedule + (f":{p.n_virtual}" if p.n_virtual > 1 else "")
    return [str(i), str(p.pp), str(p.ep), str(p.dp), str(p.microbatches), str(c.point["mbs"]),
            sched, p.alltoall, overlap_label(p), p.checkpointing, p.ep_placement, str(p.zero),
            f"{e.peak_memory / 1e9:.1f}", f"{(e.peak_memory_zero0 - e.peak_memory) / 1e9:.1f}",
            f"{e.step_time:.2f}", f"{t['compute']:.2f}", f"{t['alltoall']:.2f}", f"{t['p2p']:.2f}",
            f"{t['bubble']:.2f}", f"{t['dp_sync']:.2f}", f"{100 * e.mfu:.1f}",
            f"{e.tflops_per_gpu:.1f}"]


def overlap_label(p: ParallelPlan) -> str:
    """The plan's all-to-all overlap as the table shows it: "none", or mode / chunks
    ("layer/2", "fb/2")."""
    c = overlap_chunks(p.a2a_overlap)
    return f"{p.a2a_overlap}/{c}" if c else p.a2a_overlap


def format_table(ranked: list[Candidate], top: int = 10) -> str:
    """Fixed-width table of the best `top` candidates (times in seconds per step; "overlap":
    the all-to-all overlap mode / chunks; "saved GB": peak memory the layout's ZeRO level
    saves against the same layout with ZeRO-0)."""
    rows = [list(_COLS)] + [_row(i + 1, c) for i, c in enumerate(ranked[:top])]
    widths = [max(len(r[j]) for r in rows) for j in range(len(_COLS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def zero_summary(e: Estimate, attention: str = "sharded") -> str:
    """One line: the plan's ZeRO level, what it shards over which groups, the memory it saves."""
    p = e.plan
    g_rep, g_exp = p.replica_groups(attention)
    peak0, saved = e.peak_memory_zero0, e.peak_memory_zero0 - e.peak_memory
    if p.zero == 0:
        return (f"ZeRO-0: optimizer state and gradients replicated (replica groups: {g_rep} ranks "
                f"non-expert, {g_exp} experts)")
    what = {1: "optimizer state", 2: "optimizer state + gradients"}.get(
        p.zero, "parameters + gradients + optimizer state")
    dc = ", ".join(f"{k.replace('_', '-')} {v:.2f} s" for k, v in e.dp_collectives.items())
    if p.zero == 3:  # its collectives run per layer (`layer_collectives`), not after the step
        dc = (f"per-layer weight gathers and gradient reduce-scatters, "
              f"{e.time.get('zero3', 0.0):.2f} s exposed" + (f"; {dc}" if dc else ""))
    exp = f"{g_exp} (experts, DP)" if g_exp > 1 else "not over DP = 1 for experts"
    return (f"ZeRO-{p.zero}: {what} sharded over {g_rep} ranks (non-expert, DP x EP) and {exp}; "
            f"saves {saved / 1e9:.1f} GB per GPU at the peak ({e.peak_memory / 1e9:.1f} "
            f"GB instead of {peak0 / 1e9:.1f} GB with ZeRO-0); gradient sync: {dc}")


def overlap_summary(e: Estimate) -> str:
    """One line: the plan's all-to-all overlap, what it hides, and (fb) the activations it
    holds beyond the plain schedule's."""
    p = e.plan
    exposed = e.time.get("alltoall", 0.0)
    if p.ep == 1:
        return "all-to-all overlap: none (ep=1: no exchange)"
    if p.a2a_overlap == "none":
        return (f"all-to-all overlap: none; every exchange exposed ({exposed:.3g} s per step "
                f"on the busiest rank)")
    how = {"layer": "chunked inside each MoE layer, beside the shared/dense branch and the "
                    "other chunks' expert GEMMs",
           "fb": "one micro-batch's forward beside another's backward, each micro-batch "
                 "chunked as well"}.get(p.a2a_overlap, p.a2a_overlap)
    extra = ""
    if p.a2a_overlap == "fb":
        peak = max(range(len(e.stages)), key=lambda r: e.stages[r].total)
        extra = (f"; fb holds the paired schedule's in-flight micro-batches: activations "
                 f"{e.stages[peak].activations / 1e9:.3g} GB on the peak rank")
    return (f"all-to-all overlap: {overlap_label(p)} ({how}): {exposed:.3g} s per step "
            f"exposed on the busiest rank, {e.alltoall_hidden:.3g} s hidden (the most on any "
            f"rank){extra}")


def redundant_summary(e: Estimate) -> str:
    """One line: the plan's redundant expert slots, the memory they take at the peak and the
    replica gradient sum ("" when the plan has none)."""
    p = e.plan
    if not p.redundant:
        return ""
    t = e.dp_collectives.get("replica_sum", 0.0)
    return (f"redundant expert slots: {p.redundant} per MoE layer on each EP rank (E/EP + "
            f"{p.redundant} slots), {e.redundant_memory / 1e9:.2f} GB per GPU at the peak "
            f"of its {e.peak_memory / 1e9:.1f} GB (weights, gradients, optimizer state at "
            f"ZeRO-{p.zero}); replica "
            f"gradient sum (all-to-all) over EP = {p.ep}: {t:.3f} s per step")


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_sections(p: ParallelPlan, n_layers: int | None = None) -> dict[str, dict]:
    """The trainer config sections (`train.py` `--section.field`) that run plan `p`: what a
    plan file's [run.*] holds and what `tuner.launch.train_args` passes. With `n_layers` and
    more than one pipeline stage, `parallel.layer_split` states the stage split
    (`trainer.layout.stage_layers`, the one both sides use). `comm.a2a_overlap` is the plan's
    mode and `comm.a2a_chunks` the chunks the search priced it with
    (`tuner.space.overlap_chunks`: 2 for layer and fb, stated because the trainer's
    `a2a_chunks=auto` runs an explicit fb with 1; "auto" for none and auto)."""
    split = {"layer_split": layer_split_spec(stage_layers(n_layers, p.pp, p.n_virtual))} \
        if n_layers is not None and p.pp * p.n_virtual > 1 else {}
    return {
        "parallel": {"pp": p.pp, "ep": p.ep, "dp": p.dp, "schedule": p.schedule,
                     "microbatches": p.microbatches, "n_virtual": p.n_virtual,
                     "ep_placement": p.ep_placement, "zero": p.zero, **split},
        "comm": {"alltoall": p.alltoall, "a2a_overlap": p.a2a_overlap,
                 "a2a_chunks": overlap_chunks(p.a2a_overlap) or "auto"},
        "train": {"global_batch": p.global_batch, "seq_len": p.seq_len,
                  "checkpointing": p.checkpointing},
        **({"balance": {"redundant": p.redundant}} if p.redundant else {}),
    }


def plan_toml(e: Estimate, model_name: str, request: dict[str, object], hf_path: str = "") -> str:
    """The plan file for estimate `e` (see the module docstring); with `hf_path` the run starts
    from that Hugging Face checkpoint instead of the preset `model_name`."""
    p = e.plan
    n_layers = sum(len(s.layers) for s in e.stages)
    # the layers each pipeline rank was priced with are those of the split the file states
    priced = [list(s.layers) for s in e.stages]
    assert priced == [sum(c, []) for c in rank_chunks(n_layers, p.pp, p.n_virtual)], priced
    sections: dict[str, dict[str, object]] = {
        "plan": {
            **request,
            "predicted_step_time_s": round(e.step_time, 4),
            "predicted_mfu": round(e.mfu, 4),
            "predicted_tflops_per_gpu": round(e.tflops_per_gpu, 2),
            "predicted_peak_memory_gb": round(e.peak_memory / 1e9, 2),
            "predicted_peak_memory_zero0_gb": round(e.peak_memory_zero0 / 1e9, 2),
            **({"predicted_redundant_memory_gb": round(e.redundant_memory / 1e9, 3)}
               if p.redundant else {}),
            **{f"predicted_{k}_s": round(v, 4) for k, v in e.time.items()},
        },
        "run.model": {"hf_path": hf_path} if hf_path else {"preset": model_name},
        **{f"run.{name}": body for name, body in run_sections(p, n_layers).items()},
    }
    out = ["# Written by `python -m tuner plan`; run with: train.py --plan <this file>",
           "# [plan] is the request and the prediction; [run.*] is applied like a config file."]
    for name, body in sections.items():
        out.append(f"\n[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(out) + "\n"


def launch_lines(plan_path: Path, n_gpus: int, platform: Platform, port: int = 29500) -> list[str]:
    """Exact torchrun command lines: one per node for several nodes, one line otherwise."""
    g = platform.gpus_per_node
    plan = shlex.quote(str(plan_path))
    if n_gpus <= g:
        return [f"torchrun --standalone --nnodes 1 --nproc-per-node {n_gpus} train.py --plan {plan}"]
    nodes = n_gpus // g
    return [
        f"# on each of the {nodes} nodes, with NODE_RANK = 0..{nodes - 1} and MASTER_ADDR = node 0:",
        f"torchrun --nnodes {nodes} --nproc-per-node {g} --node-rank $NODE_RANK "
        f"--master-addr $MASTER_ADDR --master-port {port} train.py --plan {plan}",
    ]


def sbatch_script(plan_path: Path, n_gpus: int, platform: Platform, job_name: str,
                  account: str = "<PROJECT>", hours: int = 2, port: int = 29500) -> str:
    """A Slurm batch script that starts one torchrun per node (Frontier-style `srun`)."""
    g = platform.gpus_per_node
    nodes = max(1, n_gpus // g)
    per_node = min(n_gpus, g)
    plan = shlex.quote(str(plan_path))
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --account={account}
#SBATCH --nodes={nodes}
#SBATCH --time={hours:02d}:00:00
#SBATCH --output={job_name}-%j.out
# {platform.description or platform.name}: {nodes} node(s) x {per_node} GPUs = {n_gpus}
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT={port}
srun --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node} bash -c \\
  'torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per_node} --node-rank "$SLURM_NODEID" \\
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" train.py --plan {plan}'
"""


def plot_frontier(cands: list[Candidate], usable_hbm: float, path: Path, title: str) -> Path:
    """Predicted MFU against peak memory of every evaluated layout, with the feasible
    frontier (best MFU reachable at or below each memory) and the HBM limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((c.estimate.peak_memory / 1e9, 100 * c.estimate.mfu) for c in cands if c.estimate)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if pts:
        ax.scatter([m for m, _ in pts], [u for _, u in pts], s=14, alpha=0.6, label="evaluated layouts")
        front, best = [], -1.0
        for m, u in pts:
            if u > best:
                best = u
                front.append((m, u))
        ax.step([m for m, _ in front], [u for _, u in front], where="post", color="C3",
                label="feasible frontier")
    ax.axvline(usable_hbm / 1e9, color="k", ls="--", lw=1, label="usable HBM")
    ax.set_xlabel("predicted peak memory per GPU (GB)")
    ax.set_ylabel("predicted MFU (%)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
