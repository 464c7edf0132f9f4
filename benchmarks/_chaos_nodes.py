"""Node faults for the chaos harness (benchmarks/chaos.py): lose a node, keep training.

A helper module of the harness (not a script of its own; hence the leading underscore).

A "node" is one torchrun agent with its workers. Every node's agent joins one elastic c10d
rendezvous (`--nnodes 1:N`, `--rdzv-id`, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so each round
gets a fresh worker store) and runs train.py with `--train.resume=auto --train.replan=auto`.
Node 0's agent hosts the rendezvous store (`is_host=true`); the faults take another node:

  node-loss          SIGKILL every process of node 1 (agent and workers) after step K: the
                     survivors' collectives fail, their agent restarts them in a new round with
                     fewer ranks, and train.py re-plans the layout and resumes from the newest
                     complete checkpoint
  node-loss-in-save  the same while checkpoint step K is being written (its .tmp folder exists)
  node-return        node-loss, then node 1's agent starts again once the shrunk run has made
                     a step: the agents restart at the larger size (a membership change, not a
                     failure) and train.py goes back to the configured layout

On one machine (`launch_node`) the agents share 127.0.0.1; under the emulator
(`emulated=True`, comm.emulate's network namespaces) each agent runs in its node's
namespace with `--local-addr` its address, the store at node 0's.

Measured per run (`node_row`): the outcome, the steps lost (the newest step logged before the
loss minus the checkpoint the survivors resumed from), the seconds from the kill to the first
step the shrunk run logged, the seconds from the node's return to the first step at full size,
and the losses against an uninterrupted run of the same steps: equal (rel 1e-6) up to the
checkpoint resumed from, within the new layout's summation-order tolerance after it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NODE_FAULTS = ("node-loss", "node-loss-in-save", "node-return")
# rendezvous timing (seconds): a new round waits LAST_CALL for more nodes once the minimum has
# joined (so the first launch gathers every node); a node is dropped after KEEP_ALIVE x 3
# missed heartbeats
LAST_CALL_S = 5
KEEP_ALIVE_S = 1


@dataclass
class Node:
    index: int
    proc: subprocess.Popen
    log: Path


@dataclass
class Cluster:
    """The agents of one job; `namespaces` set when they run in comm.emulate's nodes."""

    n_nodes: int
    nproc: int
    port: int
    out: Path
    args: list[str]
    emulated: Any = None  # comm.emulate.EmulatedCluster
    nodes: dict[int, Node] = field(default_factory=dict)
    starts: int = 0

    def host(self) -> str:
        if self.emulated is None:
            return "127.0.0.1"
        from comm.tools.emulate import node_address

        return node_address(0)

    def launch_node(self, i: int) -> Node:
        """Start node i's agent (in its own session, so the whole node can be killed)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        env.pop("TRITON_INTERPRET", None)
        conf = (f"is_host={'true' if i == 0 else 'false'},join_timeout=300,"
                f"last_call_timeout={LAST_CALL_S},close_timeout=30,"
                f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt=3")
        pre: list[str] = []
        local: list[str] = []
        if self.emulated is not None:
            from comm.tools.emulate import node_address

            pre = ["ip", "netns", "exec", self.emulated.namespace(i)]
            local = ["--local-addr", node_address(i)]
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        cmd = [*pre, sys.executable, "-m", "torch.distributed.run", "--nnodes",
               f"1:{self.n_nodes}", "--nproc-per-node", str(self.nproc), "--max-restarts", "4",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.host()}:{self.port}",
               "--rdzv-id", f"chaos-{self.port}", "--rdzv-conf", conf, *local, "train.py",
               *self.args, f"--train.out_dir={self.out}"]
        self.starts += 1
        log = self.out / f"node{i}.start{self.starts}.log"
        self.out.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:  # a file, not a pipe: nobody reads while it runs
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node = Node(i, proc, log)
        self.nodes[i] = node
        return node

    def kill_node(self, i: int) -> None:
        """SIGKILL node i's agent and its workers (torchrun starts each in its own session)."""
        node = self.nodes[i]
        pids = _descendants(node.proc.pid)
        for pid in [node.proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.proc.wait()

    def kill_all(self) -> None:
        for i, node in self.nodes.items():
            if node.proc.poll() is None:
                self.kill_node(i)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def _steps(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl") if "loss" in r}


def _wait(cond, deadline: float, alive, interval: float = 0.02) -> bool:
    while time.monotonic() < deadline and alive():
        if cond():
            return True
        time.sleep(interval)
    return cond()


def _first_new_step(out: Path, after_wall: float, world: int, deadline: float, alive
                    ) -> tuple[float | None, dict[str, Any] | None]:
    """Wall time at which the first step of an attempt of `world` ranks that started after
    `after_wall` (its elastic.jsonl row) shows in metrics.jsonl, and that row. The resumed
    run first truncates metrics.jsonl to its checkpoint's step s (trainer.observe.console): a row of
    step s + 1 counts once the file has been seen without one."""
    found: dict[str, Any] = {}
    truncated = [False]

    def ready() -> bool:
        if not found:
            rows = [r for r in _rows(out / "elastic.jsonl")
                    if r["time"] > after_wall and r["world_after"] == world]
            if not rows:
                return False
            found.update(rows[0])
        got = _steps(out)
        if not truncated[0]:
            truncated[0] = max(got, default=0) <= found["step"]
            return False
        return (found["step"] + 1) in got

    ok = _wait(ready, deadline, alive)
    return (time.time() if ok else None), (found or None)


def run_node_fault(fault: str, k: int, out: Path, args: list[str], n_nodes: int, nproc: int,
                   port: int, steps: int, limit_s: float, emulated: Any = None
                   ) -> dict[str, Any]:
    """One node fault at step k; the raw measurements (classified by `node_row`)."""
    c = Cluster(n_nodes, nproc, port, out, args, emulated)
    t0 = time.monotonic()
    deadline = t0 + limit_s
    for i in range(n_nodes):
        c.launch_node(i)
    victim = n_nodes - 1
    res: dict[str, Any] = {"victim_node": victim, "injected": False}

    def alive() -> bool:
        return c.nodes[0].proc.poll() is None

    try:
        if fault == "node-loss-in-save":
            tmp = out / "checkpoints" / f"step_{k:08d}.tmp"
            hit = _wait(tmp.is_dir, deadline, alive, 0.001)
        else:
            hit = _wait(lambda: max(_steps(out), default=0) >= k, deadline, alive, 0.01)
        if hit:
            res["logged_before"] = max(_steps(out), default=0)
            t_kill = time.time()
            c.kill_node(victim)
            res["injected"] = True
            when, row = _first_new_step(out, t_kill, (n_nodes - 1) * nproc, deadline, alive)
            if when is not None and row is not None:
                res["loss_to_step_s"] = round(when - t_kill, 2)
                res["resumed_at"] = row["step"]
                res["replan"] = {"event": row["event"], "changed": row["changed"],
                                 "plan_s": row.get("plan_s")}
            if fault == "node-return" and when is not None:
                t_back = time.time()
                c.launch_node(victim)
                when2, row2 = _first_new_step(out, t_back, n_nodes * nproc, deadline, alive)
                if when2 is not None and row2 is not None:
                    res["return_to_step_s"] = round(when2 - t_back, 2)
                    res["regrown_at"] = row2["step"]
                    res["regrow"] = {"event": row2["event"], "changed": row2["changed"]}
        try:
            res["rc"] = c.nodes[0].proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            res["rc"] = None
        if fault == "node-return" and victim in c.nodes and res.get("rc") == 0:
            try:
                res["rc_returned"] = c.nodes[victim].proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                res["rc_returned"] = None
    finally:
        c.kill_all()
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["log"] = "\n".join(n.log.read_text()[-4000:] for n in c.nodes.values())
    return res


def node_row(fault: str, res: dict[str, Any], got: dict[int, float], ref: dict[int, float],
             steps: int, same_rel: float, other_rel: float, limit_s: float) -> dict[str, Any]:
    """Classify one node fault: continued-replan / clear-error / not-injected / FAILED."""
    row: dict[str, Any] = {k: res.get(k) for k in (
        "victim_node", "resumed_at", "loss_to_step_s", "replan", "return_to_step_s",
        "regrown_at", "regrow", "rc")}
    if res.get("logged_before") is not None and res.get("resumed_at") is not None:
        row["lost_steps"] = res["logged_before"] - res["resumed_at"]
    verdict, detail = "FAILED", ""
    errors = [ln for ln in res["log"].splitlines() if ln.startswith("error: ")]
    if not res["injected"]:
        verdict, detail = "not-injected", "the job ended before the fault could be injected"
    elif res["rc"] is None:
        detail = f"hang: killed after the {limit_s:.0f} s wall-clock limit"
    elif res["rc"] != 0:
        if errors:
            verdict, detail = "clear-error", errors[-1][:300]
        else:
            detail = f"rc {res['rc']} without an `error:` line"
    else:
        r0 = res.get("resumed_at")
        before = [s for s in range(1, (r0 or 0) + 1)]
        after = [s for s in range(1, steps + 1) if s not in before]
        missing = [s for s in range(1, steps + 1) if s not in got]
        bad_same = [s for s in before if not math.isclose(got.get(s, math.nan), ref[s],
                                                          rel_tol=same_rel)]
        dev = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in after if s in got), default=0.0)
        row["max_rel_after"] = dev
        if r0 is None:
            detail = "no attempt of fewer ranks logged a step after the loss"
        elif missing:
            detail = f"steps missing from the loss curve: {missing}"
        elif bad_same:
            detail = f"steps {bad_same} before the loss differ from the uninterrupted run"
        elif dev > other_rel:
            detail = f"after the re-plan losses deviate {dev:.2e} > {other_rel:g}"
        elif fault == "node-return" and (res.get("regrown_at") is None
                                         or res.get("rc_returned") != 0):
            detail = (f"the returned node did not rejoin (regrown at {res.get('regrown_at')}, "
                      f"its agent's rc {res.get('rc_returned')})")
        else:
            verdict = "continued-replan"
            detail = (f"resumed at {r0} on fewer ranks ({res['replan']['changed']})"
                      + (f", regrown at {res['regrown_at']}" if fault == "node-return" else ""))
    row.update(outcome=verdict, detail=detail, wall_s=res["wall_s"])
    return row


def node_table(rows: list[dict[str, Any]]) -> str:
    """The docs' table of node-fault rows (markdown): outcomes, lost steps, seconds from the
    loss to the first new step (and from the return to the first step at full size), the
    largest loss deviation after the re-plan, the longest run."""
    def med_max(vals: list[float], fmt: str) -> str:
        vals = sorted(v for v in vals if v is not None)
        if not vals:
            return "-"
        return f"{vals[len(vals) // 2]:{fmt}} / {vals[-1]:{fmt}}"

    head = ("| node fault (seeds) | continued with a re-plan | stopped with a clear error | "
            "failed / hung | lost steps (median / max) | loss -> first new step, s | "
            "return -> first step at full size, s | max rel. loss deviation after | "
            "max wall s |")
    lines = [head, "|" + "---|" * 9]
    for fault in NODE_FAULTS:
        mine = [r for r in rows if r["fault"] == fault]
        if not mine:
            continue
        n = {k: sum(r["outcome"] == k for r in mine) for k in
             ("continued-replan", "clear-error")}
        bad = len(mine) - sum(n.values())
        dev = [r["max_rel_after"] for r in mine if r.get("max_rel_after") is not None]
        lines.append(
            f"| {fault} ({len(mine)}) | {n['continued-replan']} | {n['clear-error']} | {bad} | "
            f"{med_max([r.get('lost_steps') for r in mine], 'd')} | "
            f"{med_max([r.get('loss_to_step_s') for r in mine], '.1f')} | "
            f"{med_max([r.get('return_to_step_s') for r in mine], '.1f') if fault == 'node-return' else '-'} | "
            f"{max(dev):.1e} | {max(r['wall_s'] for r in mine):.1f} |" if dev else
            f"| {fault} ({len(mine)}) | {n['continued-replan']} | {n['clear-error']} | {bad} | "
            f"- | - | - | - | {max(r['wall_s'] for r in mine):.1f} |")
    return "\n".join(lines)
