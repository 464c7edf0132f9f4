"""Fault-injection harness: does a PP=2 x EP=2 run (4 CPU processes, gloo) recover or stop cleanly?

Every run is a real `torchrun` job of train.py on a small model. Faults (the seed picks the rank
and the step):
  kill9         kill -9 one worker after step K; torchrun --max-restarts 1 relaunches it and
                --train.resume=auto continues from the newest complete checkpoint
  kill-in-save  kill -9 one worker while checkpoint step_K is being written (its .tmp folder
                exists); the half-written folder must never be picked up
  stall         one rank sleeps at step K (--debug.fault_stall_step); with a short
                --train.timeout_s its peers must fail with an error naming rank and step
  nan-skip      rank R's loss and one gradient become NaN at step K, policy skip: the step is
                skipped and logged, training continues with finite losses
  nan-stop      the same with policy stop: the run stops with an error naming the step
  one-expert    --debug.skew=50 --model.top_k=1: every token goes to expert 0, so EP rank 1
                gets zero tokens every step; losses must equal a 1-process run of that config
  zero-tokens   --debug.skew=50 (top-2): every token goes to experts 0-1 (EP rank 0); EP rank 1
                gets zero tokens for every step; same check
Outcomes:
  recovered     exit 0, per-step losses identical (rel 1e-6) to the unfaulted run of the same
                layout (kill9, kill-in-save), or within rel 2e-4 of a 1-process run (skew faults:
                another layout changes the summation order only)
  skipped-step  nan-skip: exit 0, the NaN step logged and skipped, earlier losses identical to
                the unfaulted run, later ones finite
  clear-error   exit != 0 and stderr has train.py's `error: ... at step K ...` line for the
                fault's step (a hang names the reporting rank and phase too)
  FAILED        anything else: a hang past the wall-clock limit, wrong losses, no clear error,
                or a checkpoint that does not load
After every run the newest complete checkpoint is loaded into a fresh 1-process model
(`trainer.checkpoint.load_checkpoint`: layout-independent) and its weights must be finite.

    python benchmarks/chaos.py [--seeds 5] [--quick] [--faults kill9,stall] [--steps 12]
                               [--launcher c10d|static]

Launcher: restarts work with torchrun's c10d rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(the default here); with a static rendezvous (--master-addr/--master-port) the relaunched workers
meet the dead ones' keys in the shared store and fail or hang in init (see LAUNCHERS).

Rows are appended to chaos.jsonl; a table and a bar plot (chaos_<launcher>.png), in
runs/bench/chaos/ (ignored by git) or `--out DIR`; `--record` writes them to
benchmarks/results/, the tracked record. The training runs go to --work-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the trainer package lives at the root
    sys.path.insert(0, str(ROOT))
from _chaos_nodes import NODE_FAULTS, node_row, node_table, run_node_fault  # noqa: E402
from _common import (  # noqa: E402  (this script's own folder is on sys.path)
    add_output_args,
    cpu_name,
    output_dir,
    print_written,
)

FAULTS = ("kill9", "kill-in-save", "stall", "nan-skip", "nan-stop", "one-expert", "zero-tokens",
          *NODE_FAULTS)
# node faults (_chaos_nodes.py): 2 agents x 2 workers of the same PP=2 x EP=2 job, elastic
# rendezvous 1:2 nodes, re-plan on resume; more steps, so a returning node finds the job running
NODE_STEPS = 40
NODES, PER_NODE = 2, 2
ELASTIC = ["--train.resume=auto", "--train.replan=auto", "--train.platform=local"]
# The smallest model the pipeline tests use: startup dominates, a step takes ~0.1 s on CPU.
SMALL = ["--config", str(ROOT / "configs" / "tiny.toml"), "--train.seq_len=32",
         "--train.global_batch=8", "--model.d_model=32", "--model.moe_ffn_dim=32",
         "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16",
         "--train.eval_every=0", "--train.eval_batches=1", "--optim.warmup_steps=3",
         "--train.plot=false", "--comm.alltoall=flat", "--train.peak_tflops=1",
         # every collective (init included) fails after 60 s: a hang ends as an error, well
         # inside the harness's wall-clock limit (a healthy step takes < 1 s here)
         "--train.timeout_s=60"]
LAYOUT = ["--parallel.pp=2", "--parallel.ep=2", "--parallel.microbatches=2"]
NPROC = 4
SKEW = ["--debug.skew=50"]  # -50*ln(1+e): experts >= 2 never chosen (docs/reference.md 1.4)
SAME_LAYOUT_REL = 1e-6  # same layout, same summation order: only resume exactness is tested
OTHER_LAYOUT_REL = 2e-4  # as tests/test_trainer_pipeline.py: fp32 reordering over 12 AdamW steps


@dataclass
class Run:
    """One finished launch: what came back and what the harness did to it."""
    out: Path
    rc: int | None  # None: killed by the harness's wall-clock limit (a hang)
    wall_s: float
    stdout: str
    stderr: str
    args: list[str] = field(default_factory=list)
    injected: bool = True
    note: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How torchrun meets its workers. "static" (--master-addr/--master-port, what tests/conftest.py
# uses) keeps ONE agent TCPStore for every restart: a relaunched worker can read the dead
# incarnation's gloo address keys and fail ("connectFullMesh ... Connection refused") or hang in
# init. "c10d" (--rdzv-backend c10d) with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gets a fresh store
# per rendezvous round (pytorch/pytorch#135712 describes the shared-store restart bug).
LAUNCHERS = ("c10d", "static")
LAUNCHER = ["c10d"]  # main() sets it from --launcher; tests may too


def launch(args: list[str], out: Path, nproc: int, max_restarts: int) -> subprocess.Popen:
    """Start train.py (torchrun when nproc > 1) in its own session, so a hang can be killed whole."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "train.py"]
    if nproc > 1:
        port = str(free_port())
        rdzv = (["--master-addr", "127.0.0.1", "--master-port", port] if LAUNCHER[0] == "static"
                else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"])
        if LAUNCHER[0] == "c10d":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *rdzv,
               "train.py"]
    # files, not pipes: nobody reads a pipe while the job runs, and a full one would stall it
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        return subprocess.Popen([*cmd, *args, f"--train.out_dir={out}"], cwd=ROOT, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)


def worker_pids(root_pid: int) -> dict[int, int]:
    """{global rank: pid} of the train.py workers under a torchrun process (read from /proc)."""
    found: dict[int, int] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            todo.append(k)
            try:
                env = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = k
    return found


def last_step(out: Path) -> int:
    """Newest step rank 0 has logged (a partly written last line is ignored)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    best = 0
    for line in path.read_text().splitlines():
        try:
            best = max(best, int(json.loads(line).get("step", 0)))
        except (json.JSONDecodeError, ValueError):
            continue
    return best


def _poll(proc: subprocess.Popen, deadline: float, ready, interval: float) -> bool:
    """Wait until ready() or the job ends or the deadline; True when ready() came first."""
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(interval)
    return False


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL a hung job: torchrun starts each worker in its own session, so killing the
    launcher's process group alone would leave the workers running."""
    for pid in worker_pids(proc.pid).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)  # the session this harness started


def _kill_rank(proc: subprocess.Popen, rank: int) -> bool:
    pid = worker_pids(proc.pid).get(rank)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _finish(proc: subprocess.Popen, out: Path, args: list[str], t0: float, deadline: float,
            **kw: Any) -> Run:
    try:
        rc: int | None = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc = None
        _kill_all(proc)
        proc.wait()
    return Run(out, rc, time.monotonic() - t0, (out / "stdout.txt").read_text(),
               (out / "stderr.txt").read_text(), args, **kw)


def run_plain(args: list[str], out: Path, nproc: int = NPROC, max_restarts: int = 0,
              limit_s: float = 600) -> Run:
    t0 = time.monotonic()
    proc = launch(args, out, nproc, max_restarts)
    return _finish(proc, out, args, t0, t0 + limit_s)


def run_kill_at_step(args: list[str], out: Path, rank: int, step: int, limit_s: float = 600,
                     nproc: int = NPROC) -> Run:
    """kill -9 worker `rank` as soon as rank 0 has logged step `step`; torchrun may restart once."""
    t0 = time.monotonic()
    proc = launch(args, out, nproc, max_restarts=1)
    hit = _poll(proc, t0 + limit_s, lambda: last_step(out) >= step, 0.01) and _kill_rank(proc, rank)
    return _finish(proc, out, args, t0, t0 + limit_s, injected=hit,
                   note=f"killed rank {rank} after step {last_step(out)}" if hit else "")


def run_kill_in_save(args: list[str], out: Path, rank: int, step: int,
                     limit_s: float = 600) -> Run:
    """kill -9 worker `rank` while checkpoint `step` is half written (its .tmp folder exists)."""
    t0 = time.monotonic()
    proc = launch(args, out, NPROC, max_restarts=1)
    tmp = out / "checkpoints" / f"step_{step:08d}.tmp"
    # the save takes tens of ms: poll every ms (a stat call) so the window is not missed
    hit = _poll(proc, t0 + limit_s, tmp.is_dir, 0.001) and _kill_rank(proc, rank)
    return _finish(proc, out, args, t0, t0 + limit_s, injected=hit,
                   note=f"killed rank {rank} during save of step {step}" if hit else "")


def losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def events(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" in r]


def check_checkpoint(out: Path, args: list[str]) -> str:
    """Load the newest complete checkpoint into a fresh 1-process model; '' when fine."""
    import torch

    from trainer import parse_args
    from trainer.checkpoint import find_latest, load_checkpoint
    from trainer.loop import build_model_config

    path = find_latest(out / "checkpoints")
    if path is None:
        return ""
    try:
        mcfg = build_model_config(parse_args([*args, "--parallel.pp=1", "--parallel.ep=1"]))
        from model import MoETransformer

        model = MoETransformer(mcfg)
        optim = torch.optim.AdamW(model.parameters())
        load_checkpoint(path, model, optim, mcfg.to_dict())
    except ValueError as e:
        return f"checkpoint {path.name} does not load: {e}"
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        return f"checkpoint {path.name} holds non-finite weights"
    return ""


def compare(got: dict[int, float], ref: dict[int, float], steps: list[int], rel: float) -> str:
    """'' when every listed step is present in both and equal within rel; else the first miss."""
    for s in steps:
        if s not in got or s not in ref:
            return f"step {s} missing (got steps {sorted(got)[:3]}..{sorted(got)[-3:]})"
        if not math.isclose(got[s], ref[s], rel_tol=rel):
            return f"step {s}: loss {got[s]!r} vs reference {ref[s]!r} (rel tol {rel:g})"
    return ""


def clear_error(stderr: str, step: int) -> str:
    """The first train.py `error: ...` line naming the fault's step, else ''. (A hang names the
    reporting rank and phase; a non-finite stop is global, every rank agrees, so no rank.)"""
    for line in stderr.splitlines():
        if line.startswith("error: ") and f"at step {step}" in line:
            return line
    return ""


def first_error(stderr: str) -> str:
    """The line that says why the job finally failed: the last train.py `error:` or exception
    line (after a restart, the relaunch's failure, not the kill's collateral in the first run)."""
    lines = [x for x in stderr.splitlines() if x.startswith("error: ")
             or ("Error: " in x and not x.startswith(" ") and "ChildFailedError" not in x)]
    return lines[-1][:240] if lines else stderr.strip()[-240:]


# -- one fault, one seed ------------------------------------------------------------------------
def pick(fault: str, seed: int, choices: list[int]) -> int:
    """Seed s takes element s of a per-fault shuffle: consecutive seeds never repeat a choice
    until all are used (independent draws gave step 2 to 4 of 5 seeds of one fault)."""
    order = list(choices)
    random.Random(f"{fault}/{len(order)}").shuffle(order)  # str seeds: stable across runs
    return order[seed % len(order)]


def node_common(base: Path) -> list[str]:
    return [*SMALL, *LAYOUT, f"--train.steps={NODE_STEPS}", "--train.ckpt_every=3",
            "--data", str(base / "corpus.txt")]


def run_node(fault: str, seed: int, base: Path, refs: dict[str, dict[int, float]],
             limit_s: float) -> dict[str, Any]:
    """A node fault (_chaos_nodes.py): the seed picks the step (node 1 is the one lost)."""
    steps = NODE_STEPS
    if fault == "node-loss-in-save":
        k = pick(fault, seed, [s for s in range(3, steps // 2, 3)])
    else:  # early enough that a returning node finds the shrunk run still training
        k = pick(fault, seed, list(range(2, 9)))
    out = base / f"{fault}-s{seed}"
    res = run_node_fault(fault, k, out, [*node_common(base), *ELASTIC], NODES, PER_NODE,
                         free_port(), steps, limit_s)
    row = {"fault": fault, "seed": seed, "rank": f"node {res['victim_node']}", "step": k,
           **node_row(fault, res, losses(out), refs["nodes"], steps, SAME_LAYOUT_REL,
                      OTHER_LAYOUT_REL, limit_s)}
    ck = check_checkpoint(out, node_common(base))
    if ck:
        row.update(outcome="FAILED", detail=ck)
    row["resumed_at"] = [x for x in (row.get("resumed_at"), row.get("regrown_at")) if x is not None]
    row.update(steps=steps, layout=f"{NODES} nodes x {PER_NODE}: pp2-ep2", launcher="c10d-elastic")
    return row


def run_fault(fault: str, seed: int, base: Path, steps: int, refs: dict[str, dict[int, float]],
              limit_s: float) -> dict[str, Any]:
    if fault in NODE_FAULTS:
        return run_node(fault, seed, base, refs, limit_s)
    rank = pick(fault, seed, list(range(NPROC)))
    out = base / f"{fault}-s{seed}"
    common = [*SMALL, *LAYOUT, f"--train.steps={steps}", "--train.ckpt_every=3",
              "--data", str(base / "corpus.txt")]
    recover = [*common, "--train.resume=auto"]
    all_steps = list(range(1, steps + 1))
    row: dict[str, Any] = {"fault": fault, "seed": seed, "rank": rank}
    verdict, detail = "FAILED", ""
    if fault == "kill9":
        k = pick(fault, seed, list(range(1, steps)))
        r = run_kill_at_step(recover, out, rank, k, limit_s)
        row["step"] = k
        if r.rc == 0:
            bad = compare(losses(out), refs["base"], all_steps, SAME_LAYOUT_REL)
            verdict, detail = ("recovered", r.note) if not bad else ("FAILED", bad)
    elif fault == "kill-in-save":
        k = pick(fault, seed, [s for s in all_steps if s % 3 == 0])
        r = run_kill_in_save(recover, out, rank, k, limit_s)
        row["step"] = k
        if r.rc == 0:
            bad = compare(losses(out), refs["base"], all_steps, SAME_LAYOUT_REL)
            verdict, detail = ("recovered", r.note) if not bad else ("FAILED", bad)
    elif fault in ("stall", "nan-stop"):
        k = pick(fault, seed, list(range(2, steps + 1)))
        knob = (["--debug.fault_stall_step", "--train.timeout_s=20"] if fault == "stall"
                else ["--debug.fault_nan_step", "--train.nan_policy=stop"])
        r = run_plain([*common, f"{knob[0]}={k}", knob[1], f"--debug.fault_rank={rank}"], out,
                      limit_s=limit_s)
        row["step"] = k
        line = clear_error(r.stderr, k)
        bad = compare(losses(out), refs["base"], list(range(1, k)), SAME_LAYOUT_REL)
        if r.rc not in (None, 0) and line and not bad:
            verdict, detail = "clear-error", line[:300]
        else:
            detail = bad or f"rc {r.rc}, no `error: rank R: ... at step {k}` line"
    elif fault == "nan-skip":
        k = pick(fault, seed, list(range(2, steps)))
        r = run_plain([*recover, f"--debug.fault_nan_step={k}", f"--debug.fault_rank={rank}"],
                      out, max_restarts=1, limit_s=limit_s)
        row["step"] = k
        got = losses(out)
        evs = [e for e in events(out) if e.get("event") == "nonfinite"]
        bad = compare(got, refs["base"], list(range(1, k)), SAME_LAYOUT_REL)
        later = [s for s in range(k + 1, steps + 1) if not math.isfinite(got.get(s, math.nan))]
        if r.rc == 0 and not bad and not later and [e["step"] for e in evs] == [k] \
                and not math.isfinite(got.get(k, 0.0)):
            verdict, detail = "skipped-step", f"event at step {k}: {evs[0]['action']}"
        else:
            detail = bad or f"rc {r.rc}, nonfinite events {evs}, non-finite later steps {later}"
    else:  # one-expert / zero-tokens: routing skew, reference = 1 process, same config and data seed
        skew = [*SKEW, f"--data.seed={1000 + seed}"] + (["--model.top_k=1"]
                                                          if fault == "one-expert" else [])
        row["step"], row["rank"] = 0, None  # the seed picks the data seed: no rank, no step
        ref_run = run_plain([*common, *skew, "--parallel.pp=1", "--parallel.ep=1"],
                            base / f"{fault}-s{seed}-ref", nproc=1, limit_s=limit_s)
        r = run_plain([*recover, *skew], out, max_restarts=1, limit_s=limit_s)
        got = losses(out)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
            if (out / "metrics.jsonl").exists() else []
        # imbalance = max EP-rank load / mean = 2.0 exactly when EP rank 1 got zero tokens
        zero = all(x["imbalance"] == 2.0 for x in rows if "imbalance" in x)
        bad = "" if ref_run.rc == 0 else f"1-process reference failed: {ref_run.stderr[-300:]}"
        bad = bad or compare(got, losses(ref_run.out), all_steps, OTHER_LAYOUT_REL)
        if r.rc == 0 and not bad and zero:
            verdict, detail = "recovered", f"EP rank 1 got 0 tokens in all {steps} steps"
        else:
            detail = bad or f"rc {r.rc}, zero-token steps as intended: {zero}"
    if r.rc is None:
        verdict, detail = "FAILED", f"hang: killed after the {limit_s:.0f} s wall-clock limit"
    elif not r.injected:
        verdict, detail = "not-injected", "the job ended before the fault could be injected"
    ck = check_checkpoint(out, r.args)
    if ck:
        verdict, detail = "FAILED", ck
    if verdict == "FAILED" and not detail.startswith("hang") and r.rc not in (0, None):
        detail += f" | {first_error(r.stderr)}"
    resumed = re.findall(r"resumed from \S+ at step (\d+)", r.stdout)
    row.update(outcome=verdict, detail=detail, rc=r.rc, wall_s=round(r.wall_s, 1),
               resumed_at=[int(x) for x in resumed])  # steps the restarts resumed from
    return row


def _meta() -> dict[str, Any]:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True).stdout.strip()
    except OSError:
        sha = ""
    return {"git": sha, "device": f"cpu: {cpu_name()} ({os.cpu_count()} cores)",
            "time": time.time()}


def _plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = list(dict.fromkeys(r["fault"] for r in rows))
    kinds = sorted({r["outcome"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bottom = [0] * len(faults)
    for kind in kinds:
        n = [sum(r["fault"] == f and r["outcome"] == kind for r in rows) for f in faults]
        ax.bar(faults, n, bottom=bottom, label=kind,
               color="tab:red" if kind == "FAILED" else None)
        bottom = [b + x for b, x in zip(bottom, n, strict=True)]
    ax.set_ylabel("runs")
    ax.set_title("chaos harness: PP=2 x EP=2 on CPU, outcome per fault")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one seed per fault")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"subset of {','.join(FAULTS)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--limit-s", type=float, default=300, help="wall-clock limit per launch")
    ap.add_argument("--work-dir", default="/tmp/piper-chaos",
                    help="where the training runs write (a dated folder per invocation)")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="c10d",
                    help="torchrun rendezvous (see LAUNCHERS): static shows the restart bug")
    add_output_args(ap, "chaos")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; valid: {', '.join(FAULTS)}")
    if args.steps < 6:
        ap.error(f"--steps={args.steps}: need >= 6 (checkpoints every 3 steps, faults after step 1)")
    seeds = 1 if args.quick else args.seeds
    base = Path(args.work_dir) / time.strftime("%Y%m%d-%H%M%S")
    base.mkdir(parents=True)
    LAUNCHER[0] = args.launcher
    from trainer.data import default_corpus_files

    (base / "corpus.txt").write_bytes(
        b"".join(f.read_bytes() for f in default_corpus_files()[:20])[:200_000])
    common = [*SMALL, *LAYOUT, f"--train.steps={args.steps}", "--train.ckpt_every=3",
              "--data", str(base / "corpus.txt")]
    t0 = time.monotonic()
    refs: dict[str, dict[int, float]] = {}
    if set(faults) - set(NODE_FAULTS):  # the uninterrupted run of the process faults' steps
        ref = run_plain(common, base / "reference", limit_s=args.limit_s)
        if ref.rc != 0:
            sys.exit(f"the unfaulted reference run failed (rc {ref.rc}):\n{ref.stderr[-3000:]}")
        refs["base"] = losses(ref.out)
        print(f"reference (unfaulted) run: {ref.wall_s:.0f} s, final loss "
              f"{refs['base'][args.steps]:.4f}", flush=True)
    if set(faults) & set(NODE_FAULTS):  # the uninterrupted run of the node faults' steps
        nref = run_plain(node_common(base), base / "reference-nodes", limit_s=args.limit_s)
        if nref.rc != 0:
            sys.exit(f"the unfaulted node reference failed (rc {nref.rc}):\n{nref.stderr[-3000:]}")
        refs["nodes"] = losses(nref.out)
    meta = _meta()
    rows: list[dict[str, Any]] = []
    out = output_dir(args)
    for fault in faults:
        for seed in range(seeds):
            row = run_fault(fault, seed, base, args.steps, refs, args.limit_s)
            if row["outcome"] == "not-injected":  # missed the window: one retry, next seed slot
                row = run_fault(fault, seed + 1000, base, args.steps, refs, args.limit_s)
            row.update(meta, limit_s=args.limit_s)
            row.setdefault("launcher", args.launcher)
            row.setdefault("steps", args.steps)
            row.setdefault("layout", "pp2-ep2")
            rows.append(row)
            with open(out / "chaos.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{fault:13s} seed {seed}: {row['outcome']:12s} rank {row['rank']!s:4s} step "
                  f"{row['step']:>2} {row['wall_s']:6.1f} s resumed at {row['resumed_at']}  "
                  f"{row['detail'][:100]}", flush=True)
    kinds = ["recovered", "continued-replan", "skipped-step", "clear-error", "not-injected",
             "FAILED"]
    print(f"\n{'fault':14s}" + "".join(f"{k:>14s}" for k in kinds) + f"{'max wall s':>12s}")
    for fault in faults:
        mine = [r for r in rows if r["fault"] == fault]
        print(f"{fault:14s}" + "".join(f"{sum(r['outcome'] == k for r in mine):>14d}"
                                       for k in kinds) + f"{max(r['wall_s'] for r in mine):>12.1f}")
    if any(r["fault"] in NODE_FAULTS for r in rows):
        print("\n" + node_table(rows))
    n_bad = sum(r["outcome"] in ("FAILED", "not-injected") for r in rows)
    print(f"\n{len(rows)} runs, {n_bad} failed, {time.monotonic() - t0:.0f} s total; rows appended to "
          f"{out / 'chaos.jsonl'}")
    if set(faults) == set(FAULTS) and seeds >= 5:  # only a full matrix replaces the picture
        _plot(rows, out / f"chaos_{args.launcher}.png")
        print_written(out / "chaos.jsonl", out / f"chaos_{args.launcher}.png")
    sys.exit(1 if n_bad else 0)


if __name__ == "__main__":
    main()
