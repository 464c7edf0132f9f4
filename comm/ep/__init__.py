"""comm.ep: expert-parallel dispatch, the communication of a MoE layer under EP.

    Dispatcher, ExchangeStats, ExpertLayer   the declared seam (comm/ep/protocol.py)
    EPDispatcher   all-to-all over an EP group (flat / halo / dedup / auto; comm/ep/dispatcher.py)
    moe_forward    the chunked, overlapped and deduplicated expert path (comm/ep/pipeline.py)

`trainer.distributed.parallel.parallelize` installs an `EPDispatcher` in every MoE layer; one process
keeps `model.LocalDispatcher`.
"""

from __future__ import annotations

from comm.ep.dispatcher import EPDispatcher
from comm.ep.pipeline import moe_forward, run_chunks, slot_major_order
from comm.ep.protocol import Dispatcher, ExchangeStats, ExpertLayer

__all__ = ["Dispatcher", "EPDispatcher", "ExchangeStats", "ExpertLayer", "moe_forward",
           "run_chunks", "slot_major_order"]
