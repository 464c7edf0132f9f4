"""trainer: wires model, kernels, comm, pipeline and balance into one training run.

Only this package (and `train.py`) imports several of the project's packages at once.
"""

from __future__ import annotations

from .config import ConfigError, RunConfig, parse_args
from .distributed.mesh import Mesh, MeshError
from .loop import Trainer, prepare

__all__ = ["ConfigError", "RunConfig", "parse_args", "Trainer", "prepare", "Mesh", "MeshError"]
