"""What does the EP path add to one MoE decoder layer? (issue 33, item 7: the EP rows the
planner under-predicts on this machine)

Run under torchrun with W processes. Every rank builds one tiny-preset decoder block
(`model.transformer.Block`) twice from the same seed: one keeps all its experts (the local
layer, what `tuner measure`'s `layer_overhead` times), the other has its MoE layer sharded
over the W ranks through the real `EPDispatcher` (flat; `trainer.distributed.parallel.
shard_layer`). Both run forward + backward on the same input, alternated round by round so
they share the machine's load; each round is timed after a barrier, the slowest rank's time
counting (an EP layer ends when its last member is done). Two sizes: the `layer_overhead`
probe's (width 32, 4 tokens: the math is negligible, what is left is per-op and per-exchange
cost) and the tiny preset at --tokens tokens per rank (every rank its own input, so the
routing differs across ranks as in training). Prints the medians and the EP / local
difference per layer; rows go to probe_ep_overhead.jsonl (runs/bench/probe_ep_overhead/,
--out, or --record: benchmarks/results/).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \\
        benchmarks/probe_ep_overhead.py --rounds 21 --tokens 2048
"""

from __future__ import annotations

import argparse
import dataclasses
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
from _common import add_output_args, cpu_name, git_sha, output_dir, print_written  # noqa: E402

from comm.ep.dispatcher import EPDispatcher  # noqa: E402
from model import presets  # noqa: E402
from model.transformer import Block  # noqa: E402
from trainer.distributed.parallel import shard_layer  # noqa: E402

PROBE = dict(d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, moe_ffn_dim=32)  # layer_overhead's


def _moe_layer(block: torch.nn.Module):
    return next(m for m in block.modules() if hasattr(m, "experts") and hasattr(m, "dispatcher"))


def _timed(fn, group) -> float:
    dist.barrier(group)
    t = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(dt, dist.ReduceOp.MAX, group=group)
    return float(dt)


def probe(label: str, overrides: dict, tokens: int, rounds: int, warmup: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(presets.get("tiny"), **overrides)
    torch.manual_seed(0)
    local = Block(cfg, 0)
    torch.manual_seed(0)
    ep = Block(cfg, 0)
    layer = _moe_layer(ep)
    shard_layer(layer, EPDispatcher(dist.group.WORLD, world, layer.n_slots, "flat"), rank)
    torch.manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(1, tokens, cfg.d_model, requires_grad=True)
    runs = {"local": lambda: local(x).sum().backward(), "ep": lambda: ep(x).sum().backward()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + rounds):
        for k in (("local", "ep") if i % 2 else ("ep", "local")):
            t = _timed(runs[k], dist.group.WORLD)
            if i >= warmup:
                times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"probe": label, "tokens": tokens, "world": world, "experts": layer.n_slots,
            "top_k": cfg.top_k, "d_model": cfg.d_model, "rounds": rounds,
            "local_s": med["local"], "ep_s": med["ep"], "ep_extra_s": med["ep"] - med["local"]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank of the tiny-preset probe")
    add_output_args(p, "probe_ep_overhead")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.rounds < 1 or args.warmup < 0 or args.tokens < 1:
        p.error(f"--rounds {args.rounds}, --warmup {args.warmup}, --tokens {args.tokens}: need "
                f"rounds >= 1, warmup >= 0, tokens >= 1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if 8 % dist.get_world_size():
        raise SystemExit(f"world size {dist.get_world_size()} must divide the tiny preset's 8 "
                         f"experts (2, 4 or 8 processes)")
    rows = [probe("layer_overhead probe (width 32)", PROBE, 4, args.rounds, args.warmup),
            probe("tiny preset", {}, args.tokens, args.rounds, args.warmup)]
    if dist.get_rank() == 0:
        out = output_dir(args) / "probe_ep_overhead.jsonl"
        with out.open("a") as f:
            for r in rows:
                r.update(git_sha=git_sha(), device=cpu_name(), cores=os.cpu_count(),
                         time=time.strftime("%Y-%m-%dT%H:%M"), load_after=os.getloadavg()[0])
                print(f"{r['probe']:32} {r['tokens']:5d} tokens x {r['world']} ranks: local "
                      f"{r['local_s'] * 1e3:8.2f} ms, EP {r['ep_s'] * 1e3:8.2f} ms, EP adds "
                      f"{r['ep_extra_s'] * 1e3:7.2f} ms per layer fwd+bwd")
                f.write(json.dumps(r) + "\n")
        print_written(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
