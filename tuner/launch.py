"""Run a `ParallelPlan` for real on this machine and read back what it measured.

One implementation serves `benchmarks/bench_tuner_validate.py` and `python -m tuner plan
--measure K`: a plan becomes `train.py` options, `torchrun` starts `plan.n_gpus` CPU processes
(gloo), and the run's `<out_dir>/metrics.jsonl` gives per step `step_time_s` and, with
`--train.memory_report=true`, `mem_state_bytes_max` (weights + grads + AdamW state, max over
ranks) and `mem_act_peak_bytes_max` (peak bytes saved for backward, max over ranks).

Measured = the median over the steps after `warmup` (the first steps pay allocator growth,
lazy initialisation and thread-pool start-up). The memory compared with a prediction is
state + activation peak, the two quantities `tuner.estimate` predicts per rank; its
communication buffers are not seen by `trainer.observe.memory` and are left out on both sides.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.layout import ParallelPlan
from tuner.report import run_sections

if TYPE_CHECKING:  # optuna is imported by tuner.search; only its type is needed here
    import optuna

__all__ = ["MAX_LOCAL_PROCS", "Measured", "LaunchError", "train_args", "run_plan_locally",
           "read_metrics", "step_rows", "check_runnable", "measure_top", "small_corpus"]

ROOT = Path(__file__).resolve().parents[1]
MAX_LOCAL_PROCS = 4  # training processes a run here may start (2 cores; issue 8's CPU runs)


class LaunchError(RuntimeError):
    """A real run failed; the message carries the command and the end of its output."""


@dataclass(frozen=True)
class Measured:
    """What a short real run measured (medians over the steps after warm-up)."""

    step_time_s: float
    state_bytes: float  # max over ranks
    act_peak_bytes: float  # max over ranks, median over steps
    act_peak_bytes_max: float  # max over ranks and steps
    imbalance: float  # median of the trainer's max / mean EP-rank load
    steps: int  # steps the medians are over

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.act_peak_bytes

    def to_dict(self) -> dict[str, float]:
        return {"step_time_s": self.step_time_s, "state_bytes": self.state_bytes,
                "act_peak_bytes": self.act_peak_bytes, "act_peak_bytes_max": self.act_peak_bytes_max,
                "memory_bytes": self.memory_bytes, "imbalance": self.imbalance, "steps": self.steps}


def check_runnable(plan: ParallelPlan, model: str, max_procs: int = MAX_LOCAL_PROCS) -> None:
    """Refuse, before any work, a plan this machine cannot run as CPU processes."""
    from model import ModelConfig, presets

    # `model`: a preset name, or a Hugging Face checkpoint folder (its config.json)
    cfg = ModelConfig.from_hf_config(model) if Path(model).is_dir() else presets.get(model)
    if plan.n_gpus > max_procs:
        raise ValueError(
            f"plan pp={plan.pp} x dp={plan.dp} x ep={plan.ep} needs {plan.n_gpus} processes; this "
            f"machine runs at most {max_procs} training processes ({os.cpu_count()} cores): measure "
            f"only plans of <= {max_procs} GPUs (e.g. --platform local --gpus 4 --model tiny)")
    if plan.seq_len > cfg.max_seq_len:
        raise ValueError(f"seq {plan.seq_len} exceeds {cfg.name}'s max_seq_len {cfg.max_seq_len}")


def train_args(plan: ParallelPlan, model: str, out_dir: Path, steps: int, data: Path | None,
               threads: int = 0, meter_every: int = 1) -> list[str]:
    """train.py options that run `plan` for `steps` steps with the memory report on (every
    `meter_every`-th step: the meter's hooks cost time, see `read_metrics`); `model` is a
    preset name or a Hugging Face checkpoint folder."""
    args = [f"--model.hf_path={model}" if Path(model).is_dir() else f"--model.preset={model}"]
    args += [f"--{name}.{k}={v}" for name, body in run_sections(plan).items()
             for k, v in body.items()]
    args += [f"--train.steps={steps}", "--train.eval_every=0", "--train.eval_batches=1",
             "--train.ckpt_every=0", "--train.plot=false", "--train.memory_report=true",
             f"--train.memory_report_every={meter_every}",
             f"--train.threads={threads}", f"--train.out_dir={out_dir}"]
    if data is not None:
        args.append(f"--data={data}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_corpus(path: Path, n_bytes: int = 1_000_000) -> Path:
    """The first `n_bytes` of the default corpus (standard-library sources): loading the whole
    default corpus would cost more than the short runs themselves."""
    from trainer.data import default_corpus_files

    if not path.is_file():
        buf = bytearray()
        for f in default_corpus_files():
            buf += f.read_bytes()
            if len(buf) >= n_bytes:
                break
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(buf[:n_bytes]))
    return path


def step_rows(out_dir: Path, warmup: int) -> tuple[list[dict], list[dict]]:
    """A finished run's metrics.jsonl rows after `warmup`: (timed, metered). Metered: the
    steps with the memory report. Timed: the others where the run metered only some
    (`--train.memory_report_every` > 1: the saved-tensor hooks cost 2-6 % of a tiny CPU step,
    which a plan does not), else all."""
    path = out_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "step_time_s" in r and r["step"] > warmup]
    if not rows:
        raise LaunchError(f"{path}: no training steps after the {warmup} warm-up steps")
    metered = [r for r in rows if "mem_act_peak_bytes_max" in r]
    if not metered:
        raise LaunchError(f"{path}: no memory report after the {warmup} warm-up steps (run with "
                          f"--train.memory_report=true and enough steps for "
                          f"--train.memory_report_every)")
    return [r for r in rows if "mem_act_peak_bytes_max" not in r] or rows, metered


def read_metrics(out_dir: Path, warmup: int) -> Measured:
    """Medians over a finished run's steps after `warmup` (`step_rows`): the memory over the
    metered steps, the step time and the routing imbalance over the timed ones."""
    timed, metered = step_rows(out_dir, warmup)
    acts = [r["mem_act_peak_bytes_max"] for r in metered]
    return Measured(
        step_time_s=statistics.median(r["step_time_s"] for r in timed),
        state_bytes=statistics.median(r["mem_state_bytes_max"] for r in metered),
        act_peak_bytes=statistics.median(acts), act_peak_bytes_max=max(acts),
        imbalance=statistics.median(r.get("imbalance", 1.0) for r in timed), steps=len(timed))


def run_plan_locally(plan: ParallelPlan, model: str, out_dir: Path, steps: int = 8,
                     warmup: int = 3, data: Path | None = None, threads: int = 0,
                     timeout_s: float = 300.0, meter_every: int = 1) -> Measured:
    """Run `plan` with torchrun on `plan.n_gpus` local CPU processes; return its measurements
    (`meter_every` > 1: memory from every `meter_every`-th step, time from the others)."""
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup} to leave measured steps")
    check_runnable(plan, model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    data = data if data is not None else small_corpus(out_dir.parent / "corpus.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           str(plan.n_gpus), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "train.py"), *train_args(plan, model, out_dir, steps, data, threads,
                                                meter_every)]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"run timed out after {timeout_s:.0f} s: {' '.join(cmd)}") from None
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise LaunchError(f"run failed (exit {p.returncode}): {' '.join(cmd)}\n{tail}")
    return read_metrics(out_dir, warmup)


def measure_top(ranked: list, model: str, k: int, out_dir: Path, steps: int = 8, warmup: int = 3,
                study: optuna.Study | None = None) -> list[tuple[object, Measured]]:
    """Run the best `k` candidates (`tuner.search.Candidate`, best first) for real; return
    (candidate, measurement) pairs re-ranked by measured step time. With an Optuna `study`, each
    measurement is stored beside its prediction as the study user attribute `measured/<i>`."""
    if k < 1:
        raise ValueError(f"--measure {k}: must be >= 1")
    picked = []
    for c in ranked[:k]:
        check_runnable(c.estimate.plan, model)
        picked.append(c)
    data = small_corpus(Path(out_dir) / "corpus.txt")
    out = []
    for i, c in enumerate(picked):
        m = run_plan_locally(c.estimate.plan, model, Path(out_dir) / f"measure-{i}", steps, warmup, data)
        out.append((c, m))
        if study is not None:
            e = c.estimate
            study.set_user_attr(f"measured/{i}", {
                "point": c.point, "predicted_step_time_s": e.step_time,
                "predicted_peak_memory_gb": e.peak_memory / 1e9,
                "predicted_state_bytes": max(s.state for s in e.stages),
                "predicted_act_peak_bytes": max(s.activations for s in e.stages),
                **{f"measured_{k2}": v for k2, v in m.to_dict().items()}})
    return sorted(out, key=lambda cm: cm[1].step_time_s)
