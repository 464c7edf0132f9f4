"""ZeRO-0/1/2/3, fp32 and bf16 weights, and overlapped gradient reduction on CPU (gloo): state
bytes per rank (the trainer's meter beside the planner's prediction), peak saved activations,
step time; compiled vs eager blocks (step time, compile time).

The tiny preset scaled so that optimizer state dominates (d_model 512: 13.7 M parameters, 12.6 M
of them experts; AdamW keeps 8 bytes of state per parameter) and a small batch per rank (2 x 64
tokens), so the step is mostly gradient reduction and optimizer work. Each layout is one spawn
of gloo processes; in it every configuration builds its own copy of the model (same seed) and
the configurations take turns step by step (round robin), so machine noise hits them alike.

Per configuration and rank: optimizer-state bytes (the tensors in `optim.state`), gradient
bytes held after the reduction, and the median step time (forward, backward, `finish`, clip,
optimizer step incl. the ZeRO parameter broadcast) over the measured steps; the max over ranks
is reported, and `held` = `trainer.observe.memory.state_bytes` (weights + grads + optimizer state incl.
fp32 masters) after the optimizer step, next to `tuner.estimate.stage_memory`'s state for the
same layout and precision (`planned`). Layouts: DP=2 and DP=4 (EP=1: every parameter has dp
replicas) for ZeRO-0/1/2/3, EP=2 x DP=2 for ZeRO-0/1/2/3 with overlap on and off, and
EP=2 x DP=2 with bf16 weights (fp32 masters) at ZeRO-0/1/2/3. Then one process runs the same
model eager and compiled (`--train.compile`'s regions), taking turns.

    flock /tmp/piper-bench.lock python benchmarks/bench_zero.py [--steps 8] [--warmup 2]

One row is appended to bench_zero.jsonl in runs/bench/zero/ (ignored by git) or `--out DIR`;
`--record` appends it to benchmarks/results/, the tracked record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import add_output_args, cpu_name, git_sha, output_dir  # noqa: E402

from comm import run_local  # noqa: E402

# name -> (zero, overlap, bucket_bytes, param dtype)
CONFIGS = {"zero0_flat": (0, False, 25 << 20, "fp32"), "zero0_overlap": (0, True, 4 << 20, "fp32"),
           "zero1_overlap": (1, True, 4 << 20, "fp32"), "zero1_flat": (1, False, 25 << 20, "fp32"),
           "zero2_overlap": (2, True, 4 << 20, "fp32"), "zero3": (3, True, 0, "fp32"),
           "zero0_bf16": (0, False, 25 << 20, "bf16"), "zero1_bf16": (1, True, 4 << 20, "bf16"),
           "zero2_bf16": (2, True, 4 << 20, "bf16"), "zero3_bf16": (3, True, 0, "bf16")}
_LEVELS = ["zero0_flat", "zero1_overlap", "zero2_overlap", "zero3"]
_BF16 = ["zero0_bf16", "zero1_bf16", "zero2_bf16", "zero3_bf16"]
LAYOUTS = {"dp2": (2, 1, _LEVELS), "dp4": (4, 1, _LEVELS),
           "ep2_dp2": (4, 2, ["zero0_flat", "zero0_overlap", "zero1_overlap", "zero1_flat",
                              "zero2_overlap", "zero3"]),
           "ep2_dp2_bf16": (4, 2, ["zero0_flat", *_BF16])}


def _worker(rank: int, world: int, _group, ep: int, names: list[str], steps: int, warmup: int,
            d_model: int, batch: int, seq: int) -> dict:
    from model import MoETransformer, cross_entropy, presets
    from trainer.distributed.grad_sync import GradSync
    from trainer.distributed.mesh import Mesh
    from trainer.distributed.parallel import parallelize
    from trainer.distributed.precision import Precision, to_working_dtype
    from trainer.distributed.zero import build_optimizer
    from trainer.distributed.zero3 import Zero3Sync, shard_model
    from trainer.observe.memory import SavedTensorMeter, state_bytes, tensor_bytes

    torch.set_num_threads(1)
    mesh = Mesh.plan(world, rank, pp=1, ep=ep).build_groups()
    mcfg = dataclasses.replace(presets.get("tiny"), d_model=d_model)
    runs = {}
    for name in names:
        zero, overlap, bucket, pdt = CONFIGS[name]
        dt = torch.bfloat16 if pdt == "bf16" else torch.float32
        with torch.device("meta"):
            model = MoETransformer(mcfg)
        parallelize(model, mesh, alltoall="flat")
        model.materialize(torch.device("cpu"), seed=0)
        fp32: dict = {}
        if zero == 3:  # FSDP2, the trainer's way (trainer/distributed/zero3.py)
            shard_model(model, mesh, Precision(dt, dt, torch.float32), "cpu")
            sync = Zero3Sync(model, mesh)
        else:
            fp32 = to_working_dtype(model, dt)
            sync = GradSync(model, mesh, zero=zero, bucket_bytes=bucket, overlap=overlap)
        opt = build_optimizer(model, sync, 1e-3, (0.9, 0.95), 1e-8, 0.1, fp32)
        del fp32
        runs[name] = {"model": model, "sync": sync, "opt": opt, "times": [], "bf16": pdt == "bf16",
                      "meter": SavedTensorMeter(model), "held": 0}
    g = torch.Generator().manual_seed(1000 + mesh.data_idx)
    for step in range(warmup + steps):
        tokens = torch.randint(0, mcfg.vocab_size, (batch, seq + 1), generator=g)
        for name in names:  # round robin: every configuration sees the same machine noise
            r = runs[name]
            model, sync, opt = r["model"], r["sync"], r["opt"]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            sync.start_step(1)
            r["meter"].reset_peak()
            with r["meter"], torch.autocast("cpu", dtype=torch.bfloat16, enabled=r["bf16"]):
                logits = model(tokens[:, :-1])
            ce = cross_entropy(logits, tokens[:, 1:])
            (ce + model.aux_loss()).backward()
            sync.finish()
            sync.clip(1.0)
            r["grad_bytes"] = tensor_bytes(g for p in model.parameters()
                                           for g in (p.grad, getattr(p, "main_grad", None)))
            opt.step()
            r["held"] = state_bytes(model, opt)  # weights + grads + optimizer state (+ masters)
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if step >= warmup:
                r["times"].append(dt)
            r["loss"] = float(ce.detach())
    out = {}
    for name in names:
        r = runs[name]
        opt, model = r["opt"], r["model"]
        out[name] = {"state_bytes": tensor_bytes(v for p in model.parameters()
                                                 for v in opt.state.get(p, {}).values()),
                     "param_bytes": tensor_bytes(model.parameters()),
                     "grad_bytes": r["grad_bytes"], "times": r["times"], "loss": r["loss"],
                     "held_bytes": r["held"], "act_peak_bytes": r["meter"].peak}
    return out


def planned(d_model: int, world: int, ep: int, batch: int, seq: int, name: str) -> dict:
    """The planner's per-rank state for one configuration (`tuner.estimate.stage_memory`),
    with the planner's own account of what the trainer holds
    (`tuner.layout.precision_policy("trainer", "gloo", param_dtype)`, trainer/distributed/precision.py):
    fp32: 4 + 4 + 8 B; bf16 at ZeRO-0/1/2: 2 B weights, 4 B main_grad, 4 B master + 8 B moments;
    bf16 at ZeRO-3 (FSDP2): the fp32 shard is the master, 4 + 4 + 8 B sharded, and the gathered
    layer is bf16 (2 B). ZeRO-1/2 shard per parameter, ZeRO-3 flat.
    "state_sharded" leaves out ZeRO-3's gathered layer (the meter measures after the step,
    when no layer is gathered)."""
    from model import presets
    from tuner.estimate import stage_memory
    from tuner.layout import Assumptions, ParallelPlan, precision_policy
    from tuner.platform import load_platform

    zero, _, _, pdt = CONFIGS[name]
    mcfg = dataclasses.replace(presets.get("tiny"), d_model=d_model)
    plan = ParallelPlan(pp=1, ep=ep, dp=world // ep, microbatches=1,
                        global_batch=batch * world, seq_len=seq, zero=zero)
    pol = precision_policy("trainer", "gloo", param_dtype=pdt)
    asm = Assumptions(activation_set="trainer",
                      zero_sharding="flat" if zero == 3 else "per-parameter")
    sm = stage_memory(mcfg, plan, load_platform(ROOT / "configs" / "platforms" / "local.toml"),
                      pol, asm)[0]
    return {"state": sm.state,
            "state_sharded": sm.state - sm.state_by_part.get("zero3_gathered", 0.0),
            "activations": sm.activations}


def _compile_worker(rank: int, world: int, _group, steps: int, d_model: int, batch: int,
                    seq: int) -> dict:
    """One process: the same model eager and with --train.compile's regions compiled
    (trainer/compile.py), taking turns step by step; the first step of each is timed apart
    (compile time = the compiled first step minus the eager first step)."""
    from model import MoETransformer, cross_entropy, presets
    from trainer.compile import compile_blocks, graph_count

    torch.set_num_threads(1)
    mcfg = dataclasses.replace(presets.get("tiny"), d_model=d_model)
    runs = {}
    for name in ("eager", "compiled"):
        model = MoETransformer(mcfg)
        model.reset_parameters(seed=0)
        if name == "compiled":
            compile_blocks(model)
        runs[name] = {"model": model, "times": [], "losses": [],
                      "opt": torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)}
    g = torch.Generator().manual_seed(1000)
    warm = None
    for step in range(1 + steps):
        tokens = torch.randint(0, mcfg.vocab_size, (batch, seq + 1), generator=g)
        for r in runs.values():
            t0 = time.perf_counter()
            logits = r["model"](tokens[:, :-1])
            ce = cross_entropy(logits, tokens[:, 1:])
            (ce + r["model"].aux_loss()).backward()
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            r["times"].append(time.perf_counter() - t0)
            r["losses"].append(float(ce.detach()))
        if step == 0:
            warm = graph_count()
    e, c = runs["eager"], runs["compiled"]
    return {"eager_step_s": statistics.median(e["times"][1:]),
            "compiled_step_s": statistics.median(c["times"][1:]),
            "compile_s": c["times"][0] - e["times"][0],
            "recompilations_after_warmup": graph_count() - (warm or 0),
            "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in
                                     zip(e["losses"], c["losses"], strict=True))}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--compile-steps", type=int, default=6,
                    help="steps of the compiled vs eager comparison (one process); 0 = skip")
    add_output_args(ap, "zero")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    table = []
    for lay in args.layouts.split(","):
        world, ep, names = LAYOUTS[lay]
        t0 = time.perf_counter()
        res = run_local(_worker, world, ep, names, args.steps, args.warmup, args.d_model,
                        args.batch, args.seq, timeout_s=1800)
        print(f"{lay}: {time.perf_counter() - t0:.0f} s", flush=True)
        base = None
        for name in names:
            per_rank = [r[name] for r in res]
            # a step ends with every rank's last collective: the slowest rank's median
            med = max(statistics.median(r["times"]) for r in per_rank)
            pred = planned(args.d_model, world, ep, args.batch, args.seq, name)
            row = {"layout": lay, "world": world, "ep": ep, "dp": world // ep, "config": name,
                   "state_bytes_max": max(r["state_bytes"] for r in per_rank),
                   "state_bytes_min": min(r["state_bytes"] for r in per_rank),
                   "grad_bytes_max": max(r["grad_bytes"] for r in per_rank),
                   "param_bytes": max(r["param_bytes"] for r in per_rank),
                   # the trainer's meter (trainer.observe.memory): weights + grads + optimizer state
                   "held_bytes_max": max(r["held_bytes"] for r in per_rank),
                   "act_peak_bytes_max": max(r["act_peak_bytes"] for r in per_rank),
                   "planned_state": pred["state"], "planned_state_sharded": pred["state_sharded"],
                   "planned_act": pred["activations"], "step_s_median": med,
                   "final_loss_rank0": per_rank[0]["loss"]}
            if base is None:
                base = row
            row["state_vs_zero0"] = row["state_bytes_max"] / base["state_bytes_max"]
            row["held_vs_zero0"] = row["held_bytes_max"] / base["held_bytes_max"]
            row["planned_error"] = pred["state_sharded"] / row["held_bytes_max"] - 1
            row["step_vs_zero0"] = med / base["step_s_median"]
            table.append(row)
            print(f"  {name:14s} held/rank {row['held_bytes_max'] / 1e6:7.2f} MB "
                  f"({row['held_vs_zero0']:.2f} x zero0; planner {pred['state_sharded'] / 1e6:.2f}"
                  f" MB, {100 * row['planned_error']:+.1f} %)  AdamW state "
                  f"{row['state_bytes_max'] / 1e6:6.2f} MB  grads {row['grad_bytes_max'] / 1e6:6.2f}"
                  f" MB  activations {row['act_peak_bytes_max'] / 1e6:6.2f} MB  step "
                  f"{1e3 * med:7.1f} ms ({row['step_vs_zero0']:.2f} x zero0)", flush=True)
    comp = None
    if args.compile_steps:
        (comp,) = run_local(_compile_worker, 1, args.compile_steps, args.d_model, args.batch,
                            args.seq, timeout_s=1800)
        comp["compiled_vs_eager"] = comp["compiled_step_s"] / comp["eager_step_s"]
        print(f"compiled blocks: step {1e3 * comp['compiled_step_s']:.1f} ms vs eager "
              f"{1e3 * comp['eager_step_s']:.1f} ms ({comp['compiled_vs_eager']:.2f} x), compile "
              f"{comp['compile_s']:.1f} s, recompilations after warm-up "
              f"{comp['recompilations_after_warmup']}, max rel loss diff "
              f"{comp['max_rel_loss_diff']:.1e}", flush=True)
    rec = {"sha": git_sha(), "cpu": cpu_name(), "device": "cpu", "backend": "gloo",
           "d_model": args.d_model, "batch_per_rank": args.batch, "seq": args.seq,
           "steps": args.steps, "warmup": args.warmup, "time": time.time(), "table": table,
           "compile": comp}
    res = output_dir(args) / "bench_zero.jsonl"
    with open(res, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"appended to {res}")


if __name__ == "__main__":
    main()
