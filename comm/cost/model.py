"""`CostModel`: the all-to-all model's parameters as `algorithm="auto"` uses them.

comm.cost.a2a_model.Rates (the link rates) plus what only `auto` needs: gloo's pairwise flat
collective, measured corrections, where the numbers came from. Its constructors read them off
a platform file (`from_platform`), the emulator (`emulator`) or a backend's flags
(`for_backend`); `comm.calibrate` measures them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comm.cost.a2a_model import Rates
from comm.topology.platform import load_platform_file

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel(Rates):
    """The all-to-all model's parameters as `auto` uses them. Where they come from is the
    caller's choice and `source` says it: `comm.calibrate` (measured on the job's own links,
    what the trainer uses), `from_platform` (a configs/platforms file's link rates),
    `emulator` (the namespace emulator's shaped NIC).
    The field defaults are the emulator's 100 Mbit/s NIC: placeholders for tests and the
    emulator, never a machine's numbers, and `all_to_all(..., algorithm="auto")` refuses to
    run across nodes without a model rather than fall back to them.

    The link rates and per-message costs are `comm.cost.a2a_model.Rates`'s fields (rank2nic
    tells which NIC a rank uses); besides them:
    flat_pairwise: the flat collective runs R-1 dependent pairwise steps whose two
        directions serialise (a pessimistic default for gloo); False: all peers at once.
    (flat_nic_bandwidth, a Rates field: `calibrate` measures it; gloo's all_to_all_single
        posts each send before the receive from the same peer, and its TCP pairs then move
        some pairs' two directions one after the other.)
    corrections: measured / predicted time of each algorithm at the exchanges `calibrate`
        timed, as (busiest-NIC bytes, flat factor, HALO factor) sorted by bytes. `auto`
        scales its two predictions by the factors interpolated at the call's busiest-NIC
        bytes (log scale, held constant beyond the ends), so the decision reproduces the
        measurement where one was taken and the alpha-beta model shapes it in between
        (what a few parameters miss on a loaded host: CPU-bound copies, transport quirks).
        Empty: the raw model.
    flat_empty_messages: the flat collective exchanges a message with every peer, empty
        ones included (gloo's all_to_all_single: a 1 KB skewed exchange with 7 of 16 pairs
        empty takes as long as the balanced one at 8x2), so its message counts are the peer
        counts; False counts only the peers with rows (HALO always does).
    """

    flat_pairwise: bool = False
    corrections: tuple[tuple[float, float, float], ...] = ()
    flat_empty_messages: bool = False
    source: str = field(default="placeholder defaults (the emulator's 100 Mbit/s NIC)",
                        compare=False)

    @classmethod
    def for_backend(cls, backend: str, **overrides: Any) -> CostModel:
        """The backend's flags (gloo's flat collective is pairwise) on the placeholder link
        rates unless `overrides` (any CostModel fields: rates, flags, `source`) sets them.

        gloo's all_to_all_single walks the peers one step at a time (send to rank+i, receive
        from rank-i, wait) and its TCP pairs serialise the two directions of an exchange, so
        a 2-rank exchange of 4 MB each way at 100 Mbit/s takes 0.70 s instead of 0.34 s
        (measured on the emulator). NCCL / RCCL run all peers concurrently, on-node and
        off-node links at once (`flat_overlap`).
        """
        gloo = backend == "gloo"
        return cls(**{"flat_pairwise": gloo, "flat_empty_messages": gloo,
                      "flat_overlap": not gloo, **overrides})

    @classmethod
    def emulator(cls, nic_mbit: float = 100.0, backend: str = "gloo") -> CostModel:
        """The namespace emulator (`python -m comm.emulate`): NICs shaped at `nic_mbit`,
        the other parameters the placeholders."""
        if not nic_mbit > 0:
            raise ValueError(f"nic_mbit must be > 0, got {nic_mbit}")
        return cls.for_backend(backend, nic_bandwidth=nic_mbit * 1e6 / 8,
                               source=f"emulator: {nic_mbit:g} Mbit/s NICs ({backend})")

    @classmethod
    def from_platform(cls, name_or_path: str | Path,
                      directory: str | Path | None = None) -> CostModel:
        """Link rates of a platform file (configs/platforms/<name>.toml, or a path to one):
        [network] nic_bandwidth_gbs, network_latency_us; [node] intra_node_bandwidth_gbs,
        intra_node_latency_us; `backend` sets the flat collective's flags (`for_backend`).
        The files carry no HALO overhead: one network latency stands for it (HALO's second
        dependent round). Values a file marks "assumed" stay assumptions; `comm.calibrate`
        measures all of them on the job's own links."""
        pf = load_platform_file(name_or_path, directory)
        values = {key: pf.number(section, key, scale)
                  for section, key, scale in (("network", "nic_bandwidth_gbs", 1e9),
                                              ("network", "network_latency_us", 1e-6),
                                              ("node", "intra_node_bandwidth_gbs", 1e9),
                                              ("node", "intra_node_latency_us", 1e-6))}
        backend = str(pf.data.get("backend", "nccl"))
        return cls.for_backend(
            backend, nic_bandwidth=values["nic_bandwidth_gbs"],
            local_bandwidth=values["intra_node_bandwidth_gbs"],
            alpha_net=values["network_latency_us"], alpha_local=values["intra_node_latency_us"],
            halo_overhead_s=values["network_latency_us"],
            source=f"platform {pf.name!r} ({pf.path}), {backend}")

    def describe(self) -> str:
        """One line for a log: where the numbers come from and the main ones."""
        flat = self.flat_nic_bandwidth or self.nic_bandwidth
        return (f"all-to-all cost model from {self.source}: NIC {self.nic_bandwidth / 1e6:.1f} "
                f"MB/s (HALO), {flat / 1e6:.1f} MB/s (flat), intra-node "
                f"{self.local_bandwidth / 1e6:.0f} MB/s, per message {1e6 * self.alpha_net:.0f} "
                f"us, HALO overhead {1e6 * self.halo_overhead_s:.0f} us")

    def __post_init__(self) -> None:
        super().__post_init__()
        points = [tuple(c) for c in self.corrections]
        if any(len(c) != 3 or not all(v > 0 for v in c) for c in points) or any(
                a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)):
            raise ValueError("corrections must be (busiest-NIC bytes, flat factor, HALO "
                             f"factor) triples of positive numbers, bytes increasing, got "
                             f"{self.corrections!r}")
        object.__setattr__(self, "corrections", tuple(points))

    def correction(self, nic_bytes: float) -> tuple[float, float]:
        """(flat, HALO) factors at `nic_bytes` busiest-NIC bytes; (1, 1) without corrections."""
        if not self.corrections:
            return 1.0, 1.0
        points = self.corrections
        if nic_bytes <= points[0][0]:
            return points[0][1], points[0][2]
        for (x0, f0, h0), (x1, f1, h1) in zip(points, points[1:], strict=False):
            if nic_bytes <= x1:  # plain python: this runs on every `auto` call
                w = math.log(nic_bytes / x0) / math.log(x1 / x0)
                return f0 + w * (f1 - f0), h0 + w * (h1 - h0)
        return points[-1][1], points[-1][2]
