"""What does a real pipeline take beyond its actions? (issue 33, item 7: the pipelined
2-process rows the planner under-predicts on this machine)

Run under torchrun with 2 processes, one per pipeline rank (each pinned to its own core where
the machine has 2). For each case (schedule, micro-batches, tokens per micro-batch, tiny
decoder blocks per stage, virtual stages per rank) every rank builds its stages' blocks and a
`pipeline.PipelineRuntime`; each round first times every stage's forward and backward of one
micro-batch alone (both ranks at once, after a barrier), then one pipelined step. Then rank 0
replays the schedule (`pipeline.analysis.simulate`) with the measured actions, each plus one
P2P hand-over as `tuner.comms.p2p_time` prices it on --platform, and solves for the d that,
added to every action, makes the replay take the measured step (bisection; the replay grows
by the critical path's action count per unit of d). `tuner measure` fits the same d on its
1F1B probe (`Platform.pipeline_action_overhead`); the cases here say whether it carries over
to other schedules and sizes. Rows go to probe_pipeline_actions.jsonl (runs/bench/
probe_pipeline_actions/, --out, or --record: benchmarks/results/).

    OMP_NUM_THREADS=1 flock /tmp/piper-bench.lock python -m torch.distributed.run \\
        --nproc-per-node 2 benchmarks/probe_pipeline_actions.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import (  # noqa: E402
    add_output_args,
    cpu_name,
    git_sha,
    output_dir,
    previous,
    print_written,
)

import pipeline  # noqa: E402
from model import presets  # noqa: E402
from model.transformer import Block  # noqa: E402
from tuner import load_platform  # noqa: E402
from tuner.comms import p2p_time  # noqa: E402
from tuner.layout import FP32_TRAINER_PRECISION  # noqa: E402
from tuner.measure import fit_action_overhead, replay_span  # noqa: E402

# (schedule, micro-batches, tokens per micro-batch, blocks per stage, virtual stages per rank)
CASES = [("1f1b", 4, 512, 2, 1), ("1f1b", 4, 1024, 2, 1), ("gpipe", 4, 1024, 2, 1),
         ("interleaved-1f1b", 4, 1024, 1, 2), ("1f1b", 8, 512, 1, 1)]


def measure(name: str, m: int, tokens: int, blocks: int, v: int, rounds: int) -> dict | None:
    """This rank's medians of each own stage's F and B and of the pipelined step (rank 0 gets
    every rank's; the others None)."""
    rank, cfg = dist.get_rank(), presets.get("tiny")
    n_stages = 2 * v
    torch.manual_seed(rank)
    mods = {s: torch.nn.Sequential(*[Block(cfg, i) for i in range(blocks)])
            for s in range(n_stages) if s % 2 == rank}
    shape = (max(1, tokens // cfg.max_seq_len), min(tokens, cfg.max_seq_len), cfg.d_model)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(shape, generator=gen) for _ in range(m)]
    ys = [torch.randn(shape, generator=gen) for _ in range(m)]
    sched = pipeline.build(name, 2, m, **({"n_virtual": v} if v > 1 else {}))
    rt = pipeline.PipelineRuntime(sched, mods, F.mse_loss, act_shape=shape,
                                  group=dist.group.WORLD)
    times: dict[str, list[float]] = {"step": []}
    for i in range(2 + rounds):  # the first two warm up
        for s, mod in mods.items():
            dist.barrier()
            x = xs[0].clone().requires_grad_(s > 0)
            t0 = time.perf_counter()
            y = mod(x)
            loss = F.mse_loss(y, ys[0]) if s == n_stages - 1 else (y * ys[0]).sum()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            mod.zero_grad(set_to_none=True)
            if i >= 2:
                times.setdefault(f"F{s}", []).append(t1 - t0)
                times.setdefault(f"B{s}", []).append(t2 - t1)
        dist.barrier()
        t3 = time.perf_counter()
        rt.step(xs if rank == 0 else None, ys if rank == 1 else None)  # last stage: rank 1
        if i >= 2:
            times["step"].append(time.perf_counter() - t3)
        for mod in mods.values():
            mod.zero_grad(set_to_none=True)
    mine = {k: statistics.median(v_) for k, v_ in times.items()}
    got: list[dict | None] = [None, None]
    dist.all_gather_object(got, mine)
    if rank:
        return None
    cost = {k: t for r in got if r for k, t in r.items() if k != "step"}
    return {"schedule": name, "microbatches": m, "tokens": tokens, "blocks": blocks,
            "n_virtual": v, "step_s": got[0]["step"] if got[0] else 0.0, "actions_s": cost}


def per_action(row: dict, hop: float) -> tuple[float, float, float]:
    """(replay s, critical actions, d s): the replay with the measured actions + one hop each,
    its slope in d, and the d >= 0 that makes it take the measured step (`tuner measure`'s
    fit, `tuner.measure.fit_action_overhead`)."""
    sched = pipeline.build(row["schedule"], 2, row["microbatches"],
                           **({"n_virtual": row["n_virtual"]} if row["n_virtual"] > 1 else {}))

    def cost(a: object) -> float:
        return row["actions_s"][f"{a.kind}{a.stage}"] + hop  # type: ignore[attr-defined]

    base = replay_span(sched, cost)
    return (base, (replay_span(sched, cost, 1e-3) - base) / 1e-3,
            fit_action_overhead(sched, cost, row["step_s"]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--platform", default=None,
                   help="the 2-process platform whose P2P price the replay uses (default: the "
                        "output folder's tuner_validate_platform_w2.toml, else the recorded one)")
    add_output_args(p, "probe_pipeline_actions")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: need >= 1")
    if args.platform is None:
        args.platform = str(previous(output_dir(args), "tuner_validate_platform_w2.toml"))
    pf = load_platform(args.platform)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit(f"run with 2 processes (one per pipeline rank), not {dist.get_world_size()}")
    torch.set_num_threads(1)
    if len(os.sched_getaffinity(0)) == 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[dist.get_rank()]})
    rows = [measure(*c, args.rounds) for c in CASES]
    if dist.get_rank() == 0:
        out = output_dir(args) / "probe_pipeline_actions.jsonl"
        cfg = presets.get("tiny")
        with out.open("a") as f:
            for r in rows:
                assert r is not None
                hop = p2p_time(r["tokens"] * cfg.d_model * FP32_TRAINER_PRECISION.p2p_bytes,
                               False, pf)
                base, slope, d = per_action(r, hop)
                r.update(replay_s=base, critical_actions=slope, action_overhead_s=d,
                         hop_s=hop, platform=args.platform, git_sha=git_sha(),
                         device=cpu_name(), cores=os.cpu_count(),
                         time=time.strftime("%Y-%m-%dT%H:%M"))
                print(f"{r['schedule']:16} v{r['n_virtual']} m{r['microbatches']} "
                      f"{r['tokens']:5d} tokens x {r['blocks']} blocks: step "
                      f"{r['step_s'] * 1e3:6.1f} ms, replay {base * 1e3:6.1f} ms "
                      f"(x{r['step_s'] / base:.3f}), {slope:.0f} actions on its critical path, "
                      f"{d * 1e3:.2f} ms per action")
                f.write(json.dumps(r) + "\n")
        print_written(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
