"""trainer: wires model, kernels, comm, pipeline and balance into one training run.

Only this package (and `train.py`) imports several of the project's packages at once.

Sub-packages, bottom first (tests/test_import_graph.py, SUBLAYERS):
    trainer.data         corpora, blends, chat masks (`python -m trainer.data prepare`)
    trainer.distributed  process groups, EP / TP / PP, gradient sync, ZeRO-1/2/3, precision,
                         redundant expert slots
    trainer.observe      metrics and sinks, per-step stats, console rows, report, profiling,
                         memory
config, layout and common sit beneath them, checkpoint between distributed and observe; the
modules that compose a run (setup, build, step, loop, elastic, ...) above. `python -m
trainer.report` is a thin entry into trainer.observe.report.
"""

from __future__ import annotations

from .config import ConfigError, RunConfig, parse_args
from .distributed.mesh import Mesh, MeshError
from .loop import Trainer, prepare

__all__ = ["ConfigError", "RunConfig", "parse_args", "Trainer", "prepare", "Mesh", "MeshError"]
