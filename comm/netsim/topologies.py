"""Network builders: Frontier (node + Dragonfly), DGX rail-optimised fat tree, the emulator,
and a generic two-level cluster. Facts from docs/reference.md 3; anything unpublished (latencies,
PCIe on DGX, spine count, the share of non-minimal Dragonfly routes) is a parameter.

Frontier Dragonfly (per group = cabinet): 32 switches all-to-all (one 25 GB/s link per
ordered pair), 4 nodes per switch (16 NIC ports), 128 nodes per group; 4 global links of
25 GB/s between every pair of groups. Global link i between groups A and B sits on switch
(j * 4 + i) % 32 of A, j being B's index among A's peer groups: spreads each group's
global ports evenly over its switches (the real port map is not published).
Routes: minimal = local hop, global link, local hop (ECMP over the 4 global links);
a fraction `nonminimal` of every flow takes Valiant paths: inside a group via each of the
other 30 switches, between groups via each intermediate group (when there are >= 3 groups).
The real share is set by Slingshot's adaptive routing and is not published;
nonminimal="balanced" spreads every flow evenly over all minimal and one-intermediate
paths (30/31 non-minimal inside a group, (G-2)/(G-1) between groups), an oblivious
stand-in for adaptive routing on a loaded network.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from comm.netsim.network import FabricPart, FabricPaths, Network, NetworkBuilder
from comm.netsim.network import Path as RoutePath
from comm.netsim.nodes import GB, assemble, frontier_template, star_template
from comm.topology.platform import load_platform_file

__all__ = ["dgx_fat_tree", "emulator", "from_platform", "frontier", "frontier_node", "generic"]

FRONTIER_NODES_PER_SWITCH = 4
FRONTIER_SWITCHES_PER_GROUP = 32
FRONTIER_GLOBAL_LINKS = 4
SLINGSHOT_BW = 25 * GB
# Groups of the whole machine, derived from docs/reference.md 3 (not published directly): a
# group injects 128 nodes x 4 NICs x 25 GB/s = 12.8 TB/s; the 1.75:1 taper leaves 7.31 TB/s
# of global links, i.e. 4 x 25 GB/s to each of 73 other groups.
FRONTIER_GROUPS = 74


def _check_fraction(name: str, v: float | str) -> None:
    if v == "balanced":
        return
    if isinstance(v, str) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] or 'balanced', got {v!r}")


def frontier(
    nodes: int,
    nonminimal: float | str = 0.0,
    if_efficiency: float = 0.75,
    link_latency: float = 0.0,
    groups: int | None = None,
    sites: list[int] | None = None,
    scale: list[float] | None = None,
) -> Network:
    """Frontier nodes on a Dragonfly. `groups` machine groups (default: just enough for
    `nodes`); node v sits in group v // 128 on switch (v % 128) // 4 of that group.
    The whole machine has FRONTIER_GROUPS = 74 groups; Valiant paths need the extra groups
    to exist, so pass groups=FRONTIER_GROUPS to model jobs inside the full machine.
    sites/scale: see `assemble` (lumping)."""
    _check_fraction("nonminimal", nonminimal)
    npg = FRONTIER_NODES_PER_SWITCH * FRONTIER_SWITCHES_PER_GROUP
    need = -(-nodes // npg) if isinstance(nodes, int) and nodes > 0 else 1
    groups = need if groups is None else groups
    if groups < need:
        raise ValueError(f"{nodes} nodes need >= {need} groups of {npg}, got groups={groups}")
    n_sw = groups * FRONTIER_SWITCHES_PER_GROUP
    names = [f"g{s // FRONTIER_SWITCHES_PER_GROUP}.sw{s % FRONTIER_SWITCHES_PER_GROUP}"
             for s in range(n_sw)]

    def nic2switch(v: int, k: int) -> int:
        return v // FRONTIER_NODES_PER_SWITCH

    def wire(b: NetworkBuilder, sw: list[int]) -> FabricPaths:
        return _dragonfly_wire(b, sw, groups, nonminimal, link_latency)

    return assemble(f"frontier-{nodes}n", frontier_template(if_efficiency, latency=link_latency),
                    nodes, names, nic2switch, SLINGSHOT_BW, link_latency, wire,
                    nodes_per_group=npg, sites=sites, scale=scale)


def frontier_node(if_efficiency: float = 0.75, link_latency: float = 0.0) -> Network:
    """One Frontier node (8 GCDs, Infinity Fabric, 4 NICs on one switch)."""
    return frontier(1, if_efficiency=if_efficiency, link_latency=link_latency)


def _dragonfly_wire(b: NetworkBuilder, sw: list[int], groups: int, nonminimal: float | str,
                    latency: float) -> FabricPaths:
    S, H = FRONTIER_SWITCHES_PER_GROUP, FRONTIER_GLOBAL_LINKS
    sw_v = np.asarray(sw, dtype=np.int64).reshape(groups, S)
    local = np.full((groups, S, S), -1, dtype=np.int64)
    g_, a_, c_ = np.nonzero(~np.eye(S, dtype=bool)[None].repeat(groups, 0))
    local[g_, a_, c_] = b.links(sw_v[g_, a_], sw_v[g_, c_], SLINGSHOT_BW, latency)
    gate = np.zeros((groups, max(groups, 1), H), dtype=np.int64)  # gate[A, B, i] switch in A
    glink = np.full((groups, max(groups, 1), H), -1, dtype=np.int64)  # A -> B link id
    for A in range(groups):
        peers = [B for B in range(groups) if B != A]
        for j, B in enumerate(peers):
            for i in range(H):
                gate[A, B, i] = (j * H + i) % S
    A_, B_, i_ = np.nonzero(~np.eye(groups, dtype=bool)[:, :, None].repeat(H, 2))
    glink[A_, B_, i_] = b.links(sw_v[A_, gate[A_, B_, i_]], sw_v[B_, gate[B_, A_, i_]],
                                SLINGSHOT_BW, latency)

    def hop(g: int, p: int, q: int) -> tuple[int, ...]:
        return () if p == q else (int(local[g, p, q]),)

    balanced = nonminimal == "balanced"

    def intra(g: int, la: int, lc: int) -> list[RoutePath]:
        mids = [u for u in range(S) if u not in (la, lc)]
        f = len(mids) / (len(mids) + 1) if balanced else float(nonminimal)
        out: list[RoutePath] = [((int(local[g, la, lc]),), 1.0 - f)]
        out += [(hop(g, la, u) + hop(g, u, lc), f / len(mids)) for u in mids]
        return [p for p in out if p[1] > 0]

    def shares(A: int, B: int) -> tuple[list[int], float, float]:
        """Intermediate groups, share of each minimal and of each Valiant global choice."""
        vias = [C for C in range(groups) if C not in (A, B)]
        if not vias:
            return vias, 1.0 / H, 0.0
        f = len(vias) / (len(vias) + 1) if balanced else float(nonminimal)
        return vias, (1.0 - f) / H, f / (len(vias) * H)

    def src_part(A: int, la: int, B: int) -> list[RoutePath]:
        """Hops inside the source group from switch la to the gates of every route."""
        vias, m, v = shares(A, B)
        out = [(hop(A, la, gate[A, B, i]), m) for i in range(H)]
        out += [(hop(A, la, gate[A, C, i]), v) for C in vias for i in range(H)]
        return [p for p in out if p[1] > 0]

    def core(A: int, B: int) -> list[RoutePath]:
        """Global links (and the hop across the intermediate group) from A to B."""
        vias, m, v = shares(A, B)
        out: list[RoutePath] = [((int(glink[A, B, i]),), m) for i in range(H)]
        out += [((int(glink[A, C, i]),) + hop(C, gate[C, A, i], gate[C, B, i])
                 + (int(glink[C, B, i]),), v) for C in vias for i in range(H)]
        return [p for p in out if p[1] > 0]

    def dst_part(B: int, lc: int, A: int) -> list[RoutePath]:
        vias, m, v = shares(A, B)
        out = [(hop(B, gate[B, A, i], lc), m) for i in range(H)]
        out += [(hop(B, gate[B, C, i], lc), v) for C in vias for i in range(H)]
        return [p for p in out if p[1] > 0]

    def paths(a: int, c: int) -> list[FabricPart]:
        A, la = divmod(a, S)
        B, lc = divmod(c, S)
        if A == B:
            return [(("intra", A, la, lc), lambda: intra(A, la, lc))]
        return [(("src", A, la, B), lambda: src_part(A, la, B)),
                (("core", A, B), lambda: core(A, B)),
                (("dst", B, lc, A), lambda: dst_part(B, lc, A))]

    return paths


def dgx_fat_tree(
    nodes: int,
    gpu: str = "h100",
    nvlink_bw: float = 450 * GB,
    nic_bw: float = 50 * GB,
    pcie_bw: float | None = None,
    spines: int = 8,
    taper: float = 1.0,
    link_latency: float = 0.0,
    nodes_per_su: int = 32,
    sites: list[int] | None = None,
    scale: list[float] | None = None,
) -> Network:
    """DGX H100/H200 nodes (8 GPUs on NVSwitch, 8 NICs, one per GPU) on a rail-optimised fat
    tree: per scalable unit of `nodes_per_su` nodes one leaf per rail; leaves reach each of
    `spines` spines with capacity nodes_per_su * nic_bw / (spines * taper). Cross-rail and
    cross-SU traffic goes leaf -> spine -> leaf (no PXN forwarding is modelled)."""
    if gpu not in ("h100", "h200"):  # same network; the name tells which machine is meant
        raise ValueError(f"gpu must be 'h100' or 'h200', got {gpu!r}")
    if spines < 1 or not taper >= 1.0:
        raise ValueError(f"need spines >= 1 and taper >= 1, got spines={spines}, taper={taper}")
    rails = 8
    n_su = -(-nodes // nodes_per_su) if isinstance(nodes, int) and nodes > 0 else 1
    leaves = [f"su{u}.leaf{r}" for u in range(n_su) for r in range(rails)]
    names = leaves + [f"spine{s}" for s in range(spines)]
    up_bw = nodes_per_su * nic_bw / (spines * taper)

    def nic2switch(v: int, k: int) -> int:
        return (v // nodes_per_su) * rails + k

    def wire(b: NetworkBuilder, sw: list[int]) -> FabricPaths:
        L = len(leaves)
        up = [[b.link(sw[a], sw[L + s], up_bw, link_latency) for s in range(spines)]
              for a in range(L)]
        dn = [[b.link(sw[L + s], sw[a], up_bw, link_latency) for s in range(spines)]
              for a in range(L)]
        return lambda a, c: [(("pair", a, c),
                              lambda: [((up[a][s], dn[c][s]), 1.0 / spines)
                                       for s in range(spines)])]

    template = star_template(8, 8, nvlink_bw, pcie_bw, link_latency)
    return assemble(f"dgx-{gpu}-{nodes}n", template, nodes, names, nic2switch, nic_bw,
                    link_latency, wire, sites=sites, scale=scale)


def emulator(
    nodes: int,
    ranks_per_node: int,
    mbit: float = 100.0,
    loopback_bw: float | None = None,
    link_latency: float = 0.0,
    groups: int = 1,
    global_mbit: float | None = None,
    nic_efficiency: float = 1.0,
    sites: list[int] | None = None,
    scale: list[float] | None = None,
) -> Network:
    """The emulated cluster of `comm.emulate`: each node one NIC shaped to `mbit` Mbit/s per
    direction on its group's bridge; its ranks (processes) share that NIC and talk to each
    other over unshaped local routes (loopback_bw None: not modelled, instant). With
    groups > 1, node i sits in group i * groups // nodes and every group bridge reaches
    one core bridge over a link of global_mbit Mbit/s per direction. nic_efficiency: the
    share of the shaped rate the ranks' payload gets (TCP/IP framing, gloo, tbf bursts);
    1.0 is the ideal, a value below it is a calibration to measure, not a fact."""
    if not mbit > 0:
        raise ValueError(f"mbit must be > 0, got {mbit}")
    _check_fraction("nic_efficiency", nic_efficiency)
    if nic_efficiency == 0:
        raise ValueError("nic_efficiency must be > 0")
    if not 1 <= groups <= nodes or (groups > 1 and not (global_mbit or 0) > 0):
        raise ValueError(f"need 1 <= groups <= nodes={nodes} and global_mbit > 0 when "
                         f"groups > 1, got groups={groups}, global_mbit={global_mbit}")
    names = [f"bridge{k}" for k in range(groups)] + (["core"] if groups > 1 else [])

    def wire(b: NetworkBuilder, sw: list[int]) -> FabricPaths:
        if groups == 1:
            return lambda a, c: []  # one bridge: no switch-to-switch hop
        assert global_mbit is not None, "checked above: groups > 1 needs global_mbit"
        bw = float(global_mbit) * 1e6 / 8
        up = [b.link(sw[k], sw[groups], bw, link_latency) for k in range(groups)]
        dn = [b.link(sw[groups], sw[k], bw, link_latency) for k in range(groups)]
        return lambda a, c: [(("pair", a, c), lambda: [((up[a], dn[c]), 1.0)])]

    template = star_template(ranks_per_node, 1, loopback_bw, None, 0.0, hub="lo")
    return assemble(f"emulator-{nodes}x{ranks_per_node}-{mbit:g}mbit", template, nodes,
                    names, lambda v, k: v * groups // nodes, mbit * 1e6 / 8 * nic_efficiency,
                    link_latency,
                    wire, sites=sites, scale=scale)


def generic(
    nodes: int,
    gpus_per_node: int,
    nics_per_node: int,
    nic_bw: float,
    intra_bw: float | None,
    nodes_per_switch: int,
    taper: float = 1.0,
    gpu_nic_bw: float | None = None,
    link_latency: float = 0.0,
    sites: list[int] | None = None,
    scale: list[float] | None = None,
) -> Network:
    """A cluster from a few numbers: GPUs on a node switch (intra_bw each), NICs of nic_bw
    to a leaf of nodes_per_switch nodes, leaves to one core with per-leaf uplinks of
    nodes_per_switch * nics_per_node * nic_bw / taper per direction."""
    if nodes_per_switch < 1 or not taper > 0:
        raise ValueError(f"need nodes_per_switch >= 1 and taper > 0, got "
                         f"{nodes_per_switch}, {taper}")
    n_leaf = -(-nodes // nodes_per_switch) if isinstance(nodes, int) and nodes > 0 else 1
    names = [f"leaf{i}" for i in range(n_leaf)] + ["core"]
    up_bw = nodes_per_switch * nics_per_node * nic_bw / taper

    def wire(b: NetworkBuilder, sw: list[int]) -> FabricPaths:
        up = [b.link(sw[i], sw[n_leaf], up_bw, link_latency) for i in range(n_leaf)]
        dn = [b.link(sw[n_leaf], sw[i], up_bw, link_latency) for i in range(n_leaf)]
        return lambda a, c: [(("pair", a, c), lambda: [((up[a], dn[c]), 1.0)])]

    template = star_template(gpus_per_node, nics_per_node, intra_bw, gpu_nic_bw, link_latency)
    return assemble(f"generic-{nodes}n", template, nodes, names,
                    lambda v, k: v // nodes_per_switch, nic_bw, link_latency, wire,
                    sites=sites, scale=scale)


def from_platform(platform: str | pathlib.Path | dict[str, Any], nodes: int,
                  **kw: Any) -> Network:
    """A network from a platform description (configs/platforms/*.toml, the tuner's format,
    or its parsed dict): Frontier and DGX names get their detailed builders, anything else
    the generic two-level cluster with [node] nodes_per_domain nodes per leaf switch.

    The description's per-message latency ([network] network_latency_us) is not a link
    property: pass it to `simulate(message_overhead=...)`. kw (sites, scale, ...) go to
    the builder.
    """
    desc = platform if isinstance(platform, dict) else load_platform_file(platform).data
    try:
        node, net = desc["node"], desc["network"]
        gpus, nics = int(node["gpus_per_node"]), int(net["nics_per_node"])
        nic_bw = float(net["nic_bandwidth_gbs"]) * GB
        intra = float(node["intra_node_bandwidth_gbs"]) * GB
        per_switch = int(node.get("nodes_per_domain", 1))
    except KeyError as e:
        raise ValueError(f"platform description lacks {e}; needs [node] gpus_per_node, "
                         "intra_node_bandwidth_gbs and [network] nics_per_node, "
                         "nic_bandwidth_gbs") from None
    name = str(desc.get("name", ""))
    if name == "frontier":
        kw.setdefault("nonminimal", float(net.get("nonminimal_route_share", 0.0)))
        return frontier(nodes, **kw)
    if name.startswith("dgx") and gpus == 8 and nics == 8:
        return dgx_fat_tree(nodes, nic_bw=nic_bw, nvlink_bw=intra, nodes_per_su=per_switch, **kw)
    return generic(nodes, gpus, nics, nic_bw=nic_bw, intra_bw=intra,
                   nodes_per_switch=per_switch, **kw)
