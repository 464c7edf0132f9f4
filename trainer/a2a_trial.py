"""`auto`'s trial: the first training steps cycle through the all-to-all choices `auto` still
has, and the rest of the run uses the fastest (issue 26: `auto` picks dedup and overlap where
they win).

Why measure: whether dedup or the layer pipeline pays depends on more than bytes and link
speed. On the namespace emulator, EP over 4 nodes at top-4 sends 0.71x flat's rows with
dedup; at 200 Mbit/s the step ran 0.82-0.87x flat's, at 1 Gbit/s 1.07x (8 processes on 2
cores: the relay hop and the chunks' host work cost more than the link saves); the layer
pipeline that hid 13-25 % of the step on 2 nodes x 2 ranks lost 5 % on 4 x 2 and won 15 % in
another run (docs/alltoall.md). A byte bound or a rule sees none of this. Timing one MoE layer
on random activations before training did not either (tried first: its router spreads random
tokens evenly; the trained router's 1.7x imbalance is where dedup saves most). The training
steps themselves do: every candidate computes the same rows (exact against flat up to the
summation order, tests/test_trainer_a2a.py), so trying one for a step costs time, never
correctness.

How: step 1 (after a resume: the first step run) runs the rules' choice and is not counted
(first-call allocations); then `rounds` rounds, each running every candidate for one step
in the same order; a candidate's time is its median step time over the rounds, the slowest
rank's (one all_reduce MAX at the end, on every rank at the same step). The fastest runs from
then on, and the log says what each took. Candidates (`trainer.build.trial_candidates`)
differ in the dispatcher's algorithm, overlap and chunks only: switching is setting three
attributes on each MoE layer's `EPDispatcher`. An overlap of fb is tried against none on the
fb schedule the run was built with: under none the dispatcher hands nothing over, so the
paired micro-batches run one after the other (the plain loop's work and order).

A run shorter than the trial (1 + rounds x candidates steps) runs the rules' choice and says
so. `--comm.auto_trial=0` turns the trial off.

Checkpoints carry the outcome (`StepTrial.record`, meta.json's "a2a_trial"): a resumed run
with the same candidates on the same mesh keeps the recorded pick instead of trying again
(`resume_pick`); on another mesh (an elastic resize) or with other candidates it tries again.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Candidate", "StepTrial", "label", "resume_pick"]

# (algorithm, overlap, chunks) of the EP dispatcher
Candidate = tuple[str, str, int]


def label(c: Candidate) -> str:
    """algorithm/overlap[/chunks], as the benchmarks name their arms."""
    algo, overlap, chunks = c
    return f"{algo}/{overlap}" + (f"/{chunks}" if overlap != "none" else "")


class StepTrial:
    """The trial over training steps (module docstring). `before_step` sets the step's
    candidate on every dispatcher; `after_step(seconds)` records it and, after the last
    trial step, decides (collective) and returns the log line; None otherwise."""

    def __init__(self, dispatchers: list[Any], candidates: list[Candidate], rounds: int,
                 device: torch.device) -> None:
        if rounds < 1 or len(candidates) < 2:
            raise ValueError(f"a trial needs rounds >= 1 and >= 2 candidates; got rounds="
                             f"{rounds}, candidates {candidates}")
        self.dispatchers, self.candidates, self.device = dispatchers, candidates, device
        self.rounds = rounds
        self.plan: list[Candidate | None] = [None] + [c for _ in range(rounds)
                                                      for c in candidates]
        self.times: dict[Candidate, list[float]] = {c: [] for c in candidates}
        self.i = 0
        self.picked: Candidate | None = None
        self.secs: dict[Candidate, float] = {}

    @property
    def steps(self) -> int:
        """Steps the trial takes (the uncounted first one included)."""
        return len(self.plan)

    @property
    def done(self) -> bool:
        return self.i >= len(self.plan)

    def _set(self, c: Candidate) -> None:
        for d in self.dispatchers:
            d.algorithm, d.overlap, d.chunks = c

    def before_step(self) -> None:
        if not self.done and self.plan[self.i] is not None:
            self._set(self.plan[self.i])  # type: ignore[arg-type]

    def after_step(self, seconds: float) -> str | None:
        if self.done:
            return None
        c = self.plan[self.i]
        if c is not None:
            self.times[c].append(seconds)
        self.i += 1
        if not self.done:
            return None
        med = torch.tensor([statistics.median(self.times[c]) for c in self.candidates],
                           dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            red = med.to(self.device) if dist.get_backend() == "nccl" else med
            dist.all_reduce(red, op=dist.ReduceOp.MAX)
            med = red.cpu()
        secs = self.secs = dict(zip(self.candidates, med.tolist(), strict=True))
        # the fastest; ties go to the first listed, the rules' own choice
        self.picked = min(self.candidates, key=lambda k: secs[k])
        self._set(self.picked)
        best = secs[self.picked]
        timed = ", ".join(f"{label(k)} {s:.3f} s ({s / best:.2f}x)"
                          for k, s in sorted(secs.items(), key=lambda kv: kv[1]))
        return (f"comm.alltoall / a2a_overlap=auto: trial over {self.steps - 1} steps "
                f"({self.rounds} rounds, median step of the slowest rank): {timed}; runs "
                f"{label(self.picked)} from here")

    def record(self, mesh: dict[str, int], step: int) -> dict[str, Any]:
        """The decided trial as checkpoint meta (`resume_pick` reads it back): the candidates,
        the pick, each candidate's median seconds, the mesh it ran on and the step it ended."""
        if self.picked is None:
            raise RuntimeError("StepTrial.record before the trial decided")
        return {"candidates": [list(c) for c in self.candidates], "picked": list(self.picked),
                "seconds": [self.secs[c] for c in self.candidates], "mesh": dict(mesh),
                "step": step}


def resume_pick(record: Any, candidates: list[Candidate], mesh: dict[str, int]
                ) -> tuple[Candidate | None, str]:
    """The pick a resumed run keeps from a checkpoint's trial `record` (`StepTrial.record`),
    and the log line that says so; (None, why) where it tries again: no record, other
    candidates (another config or cluster shape), another mesh (an elastic resize: other
    links, other loads) or a record this code cannot read."""
    if not record:
        return None, "the checkpoint records no trial"

    def cand(c: Any) -> Candidate:
        algo, overlap, chunks = c
        return str(algo), str(overlap), int(chunks)

    try:
        cands = [cand(c) for c in record["candidates"]]
        picked = cand(record["picked"])
        seconds = [float(x) for x in record["seconds"]]
        saved_mesh = dict(record["mesh"])
    except (KeyError, TypeError, ValueError) as e:
        return None, f"the checkpoint's trial record is unreadable ({type(e).__name__}: {e})"
    if cands != list(candidates) or picked not in cands \
            or len(seconds) != len(cands):
        return None, (f"the checkpoint's trial timed {', '.join(label(c) for c in cands)}; "
                      f"this run's choices are {', '.join(label(c) for c in candidates)}")
    if saved_mesh != dict(mesh):
        return None, f"the checkpoint's trial ran on mesh {saved_mesh}, this run is {dict(mesh)}"
    best = seconds[cands.index(picked)]
    timed = ", ".join(f"{label(c)} {s:.3f} s ({s / best:.2f}x)"
                      for c, s in sorted(zip(cands, seconds, strict=True), key=lambda kv: kv[1]))
    return picked, (f"comm.alltoall / a2a_overlap=auto: keeps {label(picked)}, the pick of the "
                    f"trial recorded in the checkpoint (ended at step {record.get('step', '?')}: "
                    f"{timed}); no new trial")
