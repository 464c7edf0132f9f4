"""comm.topology: where every rank sits and what joins the ranks.

    Topology, dump_topology   the placement (comm/topology/core.py)
    file.py                   the TOML topology file format
    discover.py               facts gathered on the running job (launcher variables, hostnames,
                              network namespaces, Slingshot NIC MACs)
    platform.py               platform files (configs/platforms): the one loader
    relay.py                  HALO's rail-aligned relay choice
"""

from __future__ import annotations

from comm.topology.core import Topology, dump_topology
from comm.topology.platform import PLATFORM_DIR, PlatformFile, load_platform_file, platform_names
from comm.topology.relay import relay_rank, relay_table

__all__ = ["PLATFORM_DIR", "PlatformFile", "Topology", "dump_topology", "load_platform_file",
           "platform_names", "relay_rank", "relay_table"]
