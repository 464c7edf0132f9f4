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
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import add_output_args, cpu_name, git_sha, output_dir, print_written  # noqa: E402

from model import presets  # noqa: E402
from tuner.measure import ep_layer_times, probe_config  # noqa: E402


def probe(label: str, cfg, tokens: int, rounds: int, warmup: int, chunks: int = 1) -> dict:
    world = dist.get_world_size()
    overlap = "layer" if chunks > 1 else "none"
    got = ep_layer_times(dist.group.WORLD, world, rounds, cfg, tokens, warmup, overlap, chunks)
    if got is None:
        raise SystemExit(f"the {cfg.n_routed_experts} experts do not split over {world} ranks")
    local_s, ep_s = got
    return {"probe": label, "tokens": tokens, "world": world, "experts": cfg.n_routed_experts,
            "top_k": cfg.top_k, "d_model": cfg.d_model, "rounds": rounds,
            "a2a_overlap": overlap, "chunks": chunks,
            "local_s": local_s, "ep_s": ep_s, "ep_extra_s": ep_s - local_s}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank of the tiny-preset probe")
    p.add_argument("--chunks", default="1",
                   help="comma-separated chunk counts of the EP layer's dispatcher: 1 = one "
                        "exchange (--comm.a2a_overlap=none), c > 1 = the layer pipeline in c "
                        "chunks (--comm.a2a_overlap=layer --comm.a2a_chunks=c)")
    add_output_args(p, "probe_ep_overhead")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    try:
        chunk_list = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        chunk_list = []
    if args.rounds < 1 or args.warmup < 0 or args.tokens < 1 or not chunk_list \
            or min(chunk_list) < 1:
        p.error(f"--rounds {args.rounds}, --warmup {args.warmup}, --tokens {args.tokens}, "
                f"--chunks {args.chunks!r}: need rounds >= 1, warmup >= 0, tokens >= 1, chunks "
                f"a comma-separated list of ints >= 1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if 8 % dist.get_world_size():
        raise SystemExit(f"world size {dist.get_world_size()} must divide the tiny preset's 8 "
                         f"experts (2, 4 or 8 processes)")
    rows = [probe(label, cfg, tokens, args.rounds, args.warmup, c) for c in chunk_list
            for label, cfg, tokens in (("layer_overhead probe (width 32)", probe_config(), 4),
                                       ("tiny preset", presets.get("tiny"), args.tokens))]
    if dist.get_rank() == 0:
        out = output_dir(args) / "probe_ep_overhead.jsonl"
        with out.open("a") as f:
            for r in rows:
                r.update(git_sha=git_sha(), device=cpu_name(), cores=os.cpu_count(),
                         time=time.strftime("%Y-%m-%dT%H:%M"), load_after=os.getloadavg()[0])
                print(f"{r['probe']:32} {r['tokens']:5d} tokens x {r['world']} ranks, "
                      f"{r['chunks']} chunk(s): local "
                      f"{r['local_s'] * 1e3:8.2f} ms, EP {r['ep_s'] * 1e3:8.2f} ms, EP adds "
                      f"{r['ep_extra_s'] * 1e3:7.2f} ms per layer fwd+bwd")
                f.write(json.dumps(r) + "\n")
        print_written(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
