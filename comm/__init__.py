"""comm: topology, flat and HALO all-to-all, single-machine launch helpers.

Public API: `all_to_all` (DESIGN.md contract), `flat_all_to_all`, `run_local`.
"""

from __future__ import annotations

from comm.alltoall import ALGORITHMS, all_to_all
from comm.flat import FlatAllToAll, flat_all_to_all
from comm.spawn import run_local

__all__ = ["ALGORITHMS", "FlatAllToAll", "all_to_all", "flat_all_to_all", "run_local"]
