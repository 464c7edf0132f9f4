"""--train.profile_steps=A,B: record steps A..B (1-based, inclusive) with torch.profiler and
write one Chrome/Perfetto trace per rank to <out_dir>/profile/rank_<r>.json.

Named ranges in the traces (`record_function`):
    forward_backward, grad_sync, optimizer.step        trainer.loop (every step)
    pipeline.stage<s>.forward                           each pipeline stage forward (pp > 1)
    pipeline.<F|B|W> s<stage> mb<m>, pipeline.wait_recv,
    pipeline.wait_sends                                 pipeline.runtime: every action, the
                                                        waits for inputs and for sends (pp > 1)
    ep.plan_all_to_all, ep.dispatch_all_to_all,
    ep.combine_all_to_all                               comm.ep.EPDispatcher (ep > 1)
    moe.grouped_gemm                                    model.moe.GroupedExperts (3 grouped GEMMs)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.autograd.profiler import record_function

from ..config import ConfigError

__all__ = ["parse_profile_steps", "StepProfiler", "stage_ranges"]


def parse_profile_steps(spec: str, steps: int) -> tuple[int, int] | None:
    """(A, B) of "A,B" with 1 <= A <= B <= steps; None for ""."""
    if not spec:
        return None
    parts = spec.replace(" ", "").split(",")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"train.profile_steps={spec!r}: expected two step numbers A,B "
                          f"(e.g. 5,7: steps 5 to 7)") from None
    if not 1 <= a <= b <= steps:
        raise ConfigError(f"train.profile_steps={spec!r}: need 1 <= A <= B <= train.steps={steps}")
    return a, b


class StepProfiler:
    """Starts torch.profiler before step A, stops after step B and exports this rank's trace."""

    def __init__(self, window: tuple[int, int] | None, out: Path, rank: int, device: torch.device):
        self.window, self.rank = window, rank
        self.path = out / "profile" / f"rank_{rank}.json"
        self.prof: torch.profiler.profile | None = None
        self.acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.acts.append(torch.profiler.ProfilerActivity.CUDA)

    def before(self, step: int) -> None:
        """Call before running step `step` (1-based); a run resumed inside the window records
        the rest of it."""
        if self.window and self.window[0] <= step <= self.window[1] and self.prof is None:
            self.prof = torch.profiler.profile(activities=self.acts)
            self.prof.__enter__()

    def after(self, step: int) -> Path | None:
        """Call after step `step`; returns the trace path when this step closed the window."""
        # (a profile runs only inside a window: prof set means window set)
        if self.prof is None or self.window is None or step < self.window[1]:
            return None
        self.prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.path))
        self.prof = None
        return self.path

    def close(self) -> None:
        """A run that stops inside the window (--train.stop_after) still writes its trace."""
        if self.prof is not None and self.window is not None:
            self.after(self.window[1])


def stage_ranges(stages: dict[int, torch.nn.Module]) -> None:
    """A `pipeline.stage<s>.forward` range around every forward of each pipeline stage,
    through module hooks (the stage modules and the pipeline runtime stay as they are)."""
    for s, mod in stages.items():
        open_: list = []

        def pre(module, args, s=s, open_=open_):
            rf = record_function(f"pipeline.stage{s}.forward")
            rf.__enter__()
            open_.append(rf)

        def post(module, args, output, open_=open_):
            open_.pop().__exit__(None, None, None)

        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
