"""Cluster self-check: discover the topology, then prove flat / HALO / auto exact on it.

    torchrun --nnodes N --nproc-per-node G ... -m comm.selfcheck [--out result.json]
    python -m comm.emulate --nodes 2 --gpus-per-node 2 --nic-mbit 100 -- \
        python -m comm.selfcheck --out /tmp/check.json

Every rank builds every rank's input from a seed, so the expected output and gradient are
computed locally in plain torch (`comm.collectives.flat.reference_all_to_all`); each algorithm must also
equal `torch.distributed.all_to_all_single` bit for bit. Rank 0 writes a JSON summary (the
discovered topology and the checks that passed); the exit status is non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from comm.collectives.alltoall import all_to_all
from comm.collectives.flat import reference_all_to_all
from comm.cost import CostModel
from comm.topology import Topology

__all__ = ["check_all_to_all", "main"]


def _cases(world: int, seed: int) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, 7, (world, world), generator=g)
    empty = rand.clone()
    empty[0, :] = 0  # rank 0 sends nothing
    empty[:, world - 1] = 0  # the last rank receives nothing
    return {"random": rand.tolist(), "empty_ranks": empty.tolist(),
            "all_empty": [[0] * world for _ in range(world)]}


def check_all_to_all(group: dist.ProcessGroup | None, topo: Topology, seed: int = 0) -> list[str]:
    """Run every algorithm on several split patterns; raise AssertionError on a mismatch."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    passed = []
    for i, (name, S) in enumerate(_cases(world, seed).items()):
        g = torch.Generator().manual_seed(seed * 100 + i)
        xs = [torch.randn(sum(S[s]), 4, generator=g) for s in range(world)]
        ST = [list(col) for col in zip(*S, strict=True)]
        ws = [torch.randn(sum(ST[s]), 4, generator=g) for s in range(world)]
        y_ref = reference_all_to_all(xs, S)[rank]
        dx_ref = reference_all_to_all(ws, ST)[rank]
        vendor = torch.empty_like(y_ref)
        dist.all_to_all_single(vendor, xs[rank], [S[s][rank] for s in range(world)], S[rank],
                               group=group)
        if not torch.equal(vendor, y_ref):
            raise AssertionError(f"all_to_all_single disagrees with the reference on {name}")
        for algorithm in ("flat", "halo", "auto"):
            x = xs[rank].clone().requires_grad_(True)
            y, _ = all_to_all(x, S[rank], group, algorithm, topology=topo,
                              cost_model=CostModel.emulator())
            (y * ws[rank]).sum().backward()
            if x.grad is None:
                raise AssertionError(f"{algorithm} on {name}: no gradient reached the input")
            if not torch.equal(y, y_ref) or not torch.equal(x.grad, dx_ref):
                raise AssertionError(f"{algorithm} differs from all_to_all_single on {name}")
            passed.append(f"{name}/{algorithm}")
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m comm.selfcheck")
    p.add_argument("--out", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--backend", default="gloo")
    args = p.parse_args(argv)
    dist.init_process_group(args.backend)
    try:
        group = dist.group.WORLD
        topo = Topology.discover(group)
        ok, error = True, ""
        try:
            passed = check_all_to_all(group, topo)
        except AssertionError as e:
            ok, error, passed = False, str(e), []
        flags = torch.tensor([int(ok)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flags.item())
        if dist.get_rank() == 0:
            print(topo.summary(), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"ok": ok, "error": error, "passed": passed,
                               "world_size": topo.world_size, "num_nodes": topo.num_nodes,
                               "rank2node": list(topo.rank2node),
                               "rank2local": list(topo.rank2local)}, f)
        # every rank reaches this point before any tears its connections down: a rank that
        # destroys its process group while a peer still flushes gloo traffic can abort the peer
        dist.barrier()
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
