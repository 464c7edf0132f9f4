"""Node templates and the cluster assembler the topology builders share.

A `NodeTemplate` describes one host: GPUs (local ids 0..g-1), NICs (g..g+n-1), internal
switches (after the NICs, e.g. an NVSwitch or a loopback device) and duplex edges between
them. `assemble` stamps the template on every node, wires NIC k of node v to
`node_nic2switch(v, k)`, routes inside a node once on the template (ECMP over shortest
paths, `ecmp_paths`) and reuses those routes on every node with shifted link ids.

Facts used by the Frontier template (docs/reference.md 3): Infinity Fabric links are 50 GB/s per
direction each: 4 links inside a package (GCD pairs 0-1, 2-3, 4-5, 6-7), 2 links for 0-6 and
2-4, 1 link for 0-2, 1-3, 4-6, 5-7, 1-5, 3-7; NIC k hangs off GCD 2k+1 over 50 GB/s PCIe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from comm.netsim.network import (
    FabricPaths,
    Network,
    NetworkBuilder,
    ecmp_paths,
    flatten_paths,
)

__all__ = ["FRONTIER_IF_LINKS", "NodeTemplate", "assemble", "frontier_template", "star_template"]

GB = 1e9

# (GCD a, GCD b): number of 50 GB/s Infinity Fabric links between them (docs/reference.md 3).
FRONTIER_IF_LINKS: dict[tuple[int, int], int] = {
    (0, 1): 4, (2, 3): 4, (4, 5): 4, (6, 7): 4,
    (0, 6): 2, (2, 4): 2,
    (0, 2): 1, (1, 3): 1, (4, 6): 1, (5, 7): 1, (1, 5): 1, (3, 7): 1,
}


@dataclass(frozen=True)
class NodeTemplate:
    """One host. Vertex ids: GPUs 0..gpus-1, NICs gpus..gpus+nics-1, then `extra` switches.

    gpu2nic[g]: the local NIC GPU g sends and receives through (-1: the node has no NIC).
    edges: duplex (a, b, bytes/s per direction, seconds). A GPU <-> NIC pair with no path
    is "attached directly" (the rank is a process on the host; nothing is modelled between
    it and the NIC). gpu_transit: whether GPUs forward traffic for others (Infinity Fabric
    does; NVSwitch nodes route through the switch instead).
    """

    gpus: int
    nics: int
    gpu2nic: tuple[int, ...]
    edges: tuple[tuple[int, int, float, float], ...]
    extra: tuple[str, ...] = ()
    gpu_transit: bool = False

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nics < 0:
            raise ValueError(f"a node needs gpus >= 1 and nics >= 0, got {self.gpus}, {self.nics}")
        if len(self.gpu2nic) != self.gpus or any(not -1 <= k < self.nics for k in self.gpu2nic):
            raise ValueError(f"gpu2nic={self.gpu2nic} must give each of {self.gpus} GPUs a NIC "
                             f"in 0..{self.nics - 1} (or -1)")

    @property
    def num_vertices(self) -> int:
        return self.gpus + self.nics + len(self.extra)

    def vertex_name(self, v: int) -> str:
        if v < self.gpus:
            return f"gpu{v}"
        if v < self.gpus + self.nics:
            return f"nic{v - self.gpus}"
        return self.extra[v - self.gpus - self.nics]


def frontier_template(if_efficiency: float = 0.75, pcie_bw: float = 50 * GB,
                      latency: float = 0.0) -> NodeTemplate:
    """Frontier node: 8 GCDs, 4 NICs, NIC k on GCD 2k+1; `if_efficiency` derates IF links
    (docs/reference.md 3: ~75 % of peak measured per link)."""
    if not 0 < if_efficiency <= 1:
        raise ValueError(f"if_efficiency must be in (0, 1], got {if_efficiency}")
    edges = [(a, b, n * 50 * GB * if_efficiency, latency)
             for (a, b), n in FRONTIER_IF_LINKS.items()]
    edges += [(2 * k + 1, 8 + k, pcie_bw, latency) for k in range(4)]
    return NodeTemplate(8, 4, tuple(g // 2 for g in range(8)), tuple(edges), gpu_transit=True)


def star_template(gpus: int, nics: int, gpu_bw: float | None, gpu_nic_bw: float | None,
                  latency: float = 0.0, hub: str = "nvswitch") -> NodeTemplate:
    """GPUs on one internal switch (`hub`) at gpu_bw each; GPU g uses NIC g * nics // gpus.

    gpu_bw None: intra-node transfers are not modelled (infinitely fast). gpu_nic_bw None:
    GPUs attach directly to their NIC (PCIe not modelled).
    """
    if nics and gpus % nics:
        raise ValueError(f"nics={nics} must divide gpus={gpus}")
    gpu2nic = tuple(g * nics // gpus if nics else -1 for g in range(gpus))
    edges: list[tuple[int, int, float, float]] = []
    extra: tuple[str, ...] = ()
    if gpu_bw is not None:
        extra = (hub,)
        edges += [(g, gpus + nics, gpu_bw, latency) for g in range(gpus)]
    if gpu_nic_bw is not None:
        edges += [(g, gpus + k, gpu_nic_bw, latency) for g, k in enumerate(gpu2nic) if k >= 0]
    return NodeTemplate(gpus, nics, gpu2nic, tuple(edges), extra)


def _template_routes(t: NodeTemplate) -> tuple[dict, dict, dict]:
    """Local routes: (gpu, gpu), (gpu, its nic) and (its nic, gpu) -> paths of local links."""
    adj: dict[int, list[tuple[int, int]]] = {v: [] for v in range(t.num_vertices)}
    for i, (a, b, _, _) in enumerate(t.edges):
        adj[a].append((b, 2 * i))  # local link 2i is a->b, 2i+1 is b->a (NetworkBuilder.duplex)
        adj[b].append((a, 2 * i + 1))

    def transit(v: int) -> bool:
        if v < t.gpus:
            return t.gpu_transit
        return v >= t.gpus + t.nics  # internal switches forward, NICs never do

    def paths(a: int, b: int) -> list:
        if not adj[a] and not adj[b]:
            return []
        try:
            return ecmp_paths(adj, a, b, transit)
        except ValueError:
            return []

    intra = {(a, b): paths(a, b) for a in range(t.gpus) for b in range(t.gpus) if a != b}
    up = {g: paths(g, t.gpus + k) for g, k in enumerate(t.gpu2nic) if k >= 0}
    down = {g: paths(t.gpus + k, g) for g, k in enumerate(t.gpu2nic) if k >= 0}
    if t.gpu_transit or t.extra:
        missing = [p for p, v in intra.items() if not v] if t.edges else []
        if missing:
            raise ValueError(f"node template has no path between GPUs {missing[:4]}")
    return intra, up, down


def _arrays(paths: list) -> tuple[np.ndarray, np.ndarray]:
    """Template paths as (local link ids, fractions), shifted per node by adding a base."""
    if not paths or all(not links for links, _ in paths):
        return np.zeros(0, np.int64), np.zeros(0)
    return flatten_paths(paths)


def assemble(
    name: str,
    template: NodeTemplate,
    nodes: int,
    switches: list[str],
    node_nic2switch: Callable[[int, int], int],
    nic_bw: float,
    nic_latency: float,
    wire_fabric: Callable[[NetworkBuilder, list[int]], FabricPaths],
    nodes_per_group: int = 0,
    sites: Sequence[int] | None = None,
    scale: Sequence[float] | None = None,
) -> Network:
    """Stamp `template` on `nodes` hosts, attach NICs to switches, let `wire_fabric` add the
    switch-to-switch links (it gets the builder and the switch vertex ids and returns the
    fabric_paths callback).

    sites / scale build a lumped network (see `comm.netsim.lumped`): node i sits where node
    sites[i] of the full machine sits and its links have scale[i] times their capacity.
    """
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
    sites = list(range(nodes)) if sites is None else [int(v) for v in sites]
    scale = [1.0] * len(sites) if scale is None else [float(x) for x in scale]
    if len(scale) != len(sites) or min(scale) <= 0 or min(sites) < 0:
        raise ValueError(f"sites {sites} and scale {scale} need equal lengths, scale > 0")
    if not nic_bw > 0:
        raise ValueError(f"nic_bw must be > 0 bytes/s, got {nic_bw}")
    b = NetworkBuilder(name)
    sw_vertex = [b.vertex(s) for s in switches]
    intra_t, up_t, down_t = (
        {key: _arrays(p) for key, p in table.items()} for table in _template_routes(template))
    G, N = template.gpus, template.nics
    nodes = len(sites)
    intra = np.zeros((nodes, G, G), dtype=np.int64)
    up, down = np.zeros(nodes * G, np.int64), np.zeros(nodes * G, np.int64)
    inj, ej = np.zeros(nodes * N, np.int64), np.zeros(nodes * N, np.int64)
    nic2switch = np.zeros(nodes * N, np.int64)
    for v in range(nodes):
        first = len(b.vertex_names)
        for i in range(template.num_vertices):
            b.vertex(f"n{v}.{template.vertex_name(i)}")
        base = b.num_links
        for a, c, cap, lat in template.edges:
            b.duplex(first + a, first + c, cap * scale[v], lat)
        for (ga, gb), (ls, fs) in intra_t.items():
            intra[v, ga, gb] = b.segment_arrays(ls + base, fs)
        for g in range(G):
            if g in up_t:
                up[v * G + g] = b.segment_arrays(up_t[g][0] + base, up_t[g][1])
                down[v * G + g] = b.segment_arrays(down_t[g][0] + base, down_t[g][1])
        for k in range(N):
            w = node_nic2switch(sites[v], k)
            nic2switch[v * N + k] = w
            i_link, e_link = b.duplex(first + G + k, sw_vertex[w], nic_bw * scale[v], nic_latency)
            inj[v * N + k] = b.segment([((i_link,), 1.0)])
            ej[v * N + k] = b.segment([((e_link,), 1.0)])
    fabric = wire_fabric(b, sw_vertex)
    gpu2nic = np.array([v * N + k if k >= 0 else -1 for v in range(nodes)
                        for k in template.gpu2nic], dtype=np.int64)
    return b.build(
        gpu2node=np.repeat(np.arange(nodes), G),
        gpu2local=np.tile(np.arange(G), nodes),
        gpu2nic=gpu2nic, nic2switch=nic2switch, up_seg=up, down_seg=down,
        inj_seg=inj, ej_seg=ej, intra_seg=intra, fabric_paths=fabric,
        nodes_per_group=nodes_per_group,
    )
