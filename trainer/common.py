"""What every trainer module shares: the run-stopping error and rank-0 printing."""

from __future__ import annotations

__all__ = ["TrainingError", "log"]


class TrainingError(RuntimeError):
    """The run cannot continue (a peer died or hung, repeated non-finite losses); the message
    names the rank, the phase and the step."""


def log(msg: str, rank: int = 0) -> None:
    """Print from global rank 0 only (one helper, so output is never interleaved)."""
    if rank == 0:
        print(msg, flush=True)
