"""Lose a node on the emulated cluster, keep training, grow back when it returns (issue 30).

    python benchmarks/elastic_emulated.py [--nodes 3] [--per-node 2] [--nic-mbit 1000]
                                          [--kill-step 4] [--steps 40] [--record]

comm.emulate builds one network namespace per node (root and iproute2 needed; everything is
torn down at the end). One torchrun agent per namespace joins an elastic c10d rendezvous of
1..N nodes at node 0 (`_chaos_nodes.Cluster`, `--local-addr` the node's address,
GLOO_SOCKET_IFNAME=eth0) and trains PP=3 x EP=2 (a pipeline stage per node, EP inside it)
with `--train.resume=auto --train.replan=auto`. After step K every process of the last node
is killed (SIGKILL: agent and workers); the survivors re-plan for N-1 nodes with a platform
file of `--per-node` GPUs per node (this machine's measured local.toml, node size changed)
and continue; then the node's agent starts again and the job grows back at the next restart
point (the agents' membership change), to the configured layout. The row: the layouts, the
steps lost, seconds from the kill to the first step on N-1 nodes and from the return to the
first step on N, and the losses against an uninterrupted run of the same steps and layout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from _chaos_nodes import node_row, run_node_fault  # noqa: E402
from _common import add_output_args, cpu_name, git_sha, output_dir  # noqa: E402
from chaos import OTHER_LAYOUT_REL, SAME_LAYOUT_REL, SMALL, free_port, losses, run_plain  # noqa: E402

LAYOUT = ["--parallel.pp=3", "--parallel.ep=2", "--parallel.microbatches=3",
          "--train.global_batch=12"]


def platform_file(path: Path, per_node: int, nic_mbit: float) -> Path:
    """local.toml (this machine, measured) with `per_node` GPUs per node and the emulated NIC."""
    text = (ROOT / "configs" / "platforms" / "local.toml").read_text()
    text = re.sub(r"(?m)^gpus_per_node = .*$", f"gpus_per_node = {per_node}", text)
    text = re.sub(r"(?m)^nics_per_node = .*$", "nics_per_node = 1", text)
    text = re.sub(r"(?m)^nic_bandwidth_gbs = .*$", f"nic_bandwidth_gbs = {nic_mbit / 8000}", text)
    text = re.sub(r'(?m)^name = .*$', 'name = "emulated"', text)
    path.write_text(text)
    return path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--nic-mbit", type=float, default=1000.0)
    ap.add_argument("--kill-step", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--limit-s", type=float, default=420)
    ap.add_argument("--work-dir", default="/tmp/piper-elastic-emu")
    add_output_args(ap, "elastic_emulated")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from comm.tools.emulate import EmulatedCluster, EmulatorError
    from trainer.data import default_corpus_files

    base = Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True)
    corpus = base / "corpus.txt"
    corpus.write_bytes(b"".join(f.read_bytes() for f in default_corpus_files()[:20])[:200_000])
    plat = platform_file(base / "emulated.toml", args.per_node, args.nic_mbit)
    common = [*SMALL, *LAYOUT, f"--train.steps={args.steps}", "--train.ckpt_every=3",
              "--data", str(corpus)]
    n = args.nodes * args.per_node
    ref = run_plain(common, base / "reference", nproc=n, limit_s=args.limit_s)
    if ref.rc != 0:
        sys.exit(f"the uninterrupted reference failed (rc {ref.rc}):\n{ref.stderr[-3000:]}")
    out = base / "node-return"
    try:
        with EmulatedCluster(args.nodes, args.per_node, args.nic_mbit) as cluster:
            res = run_node_fault("node-return", args.kill_step, out,
                                 [*common, "--train.resume=auto", "--train.replan=auto",
                                  f"--train.platform={plat}"],
                                 args.nodes, args.per_node, free_port(), args.steps,
                                 args.limit_s, emulated=cluster)
    except EmulatorError as e:
        sys.exit(f"elastic_emulated: {e}")
    row = node_row("node-return", res, losses(out), losses(ref.out), args.steps,
                   SAME_LAYOUT_REL, OTHER_LAYOUT_REL, args.limit_s)
    row.update(nodes=args.nodes, per_node=args.per_node, nic_mbit=args.nic_mbit,
               kill_step=args.kill_step, steps=args.steps, layout="pp3-ep2",
               git=git_sha(), device=f"cpu: {cpu_name()}", time=time.time())
    rec = output_dir(args) / "elastic_emulated.jsonl"
    with open(rec, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))
    if row["outcome"] != "continued-replan":
        print(res["log"][-6000:])
    print(f"row appended to {rec}")
    return 0 if row["outcome"] == "continued-replan" else 1


if __name__ == "__main__":
    sys.exit(main())
