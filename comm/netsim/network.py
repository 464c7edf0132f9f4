"""The network model: vertices (GPUs, NICs, switches), directed links, and routes as segments.

Shape legend: V vertices, L directed links, G GPU endpoints, N NICs, W switches, S segments,
F flows, K segments per flow (fixed width, padded with the empty segment 0).

A route is stored in two levels so that a 10^6-flow all-to-all stays small in memory:
    flow -> K segment ids            (int [F, K]; segment 0 is empty)
    segment -> links with fractions  (CSR: seg_ptr [S+1], seg_link [nnz], seg_frac [nnz])
A fraction below 1 is multipath routing: a flow of rate r loads link l with r * frac. A
segment is a piece shared by many flows: the links from a GPU to its NIC, a NIC's injection
link, the switch-to-switch path between two switches (all its ECMP / non-minimal paths), ...
The load a flow puts on a link is the same as with one flat link list (A = B @ C, B the
flow -> segment incidence, C the segment -> link fractions), but C is stored once per
segment instead of once per flow.

The network is hierarchical, which is what every builder in `topologies` produces:
    same node:       intra_seg[node, local_src, local_dst]
    different nodes: up_seg[src] + inj_seg[nic(src)] + fabric parts(switch(src), switch(dst))
                     + ej_seg[nic(dst)] + down_seg[dst]
where nic(g) is the NIC GPU g uses (its affinity NIC). The builder's `fabric_paths(a, c)`
callback returns up to 3 parts of the switch-to-switch route as (key, thunk) pairs; a part is
built once per key (Dragonfly: the source-group hops depend on (switch, destination group),
the global core on the group pair only), so Valiant routing over 70+ groups stays small.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["K_SEGMENTS", "Network", "NetworkBuilder", "Routes", "ecmp_paths", "flatten_paths"]

K_SEGMENTS = 7  # up, injection, 3 fabric parts, ejection, down (intra-node: the first only)
FABRIC_PARTS = 3

Path = tuple[tuple[int, ...], float]  # (link ids, fraction of the flow on this path)
FabricPart = tuple[Hashable, Callable[[], Sequence[Path]]]
FabricPaths = Callable[[int, int], Sequence[FabricPart]]


@dataclass(frozen=True)
class Routes:
    """Routes of F flows: flow -> segments and segment -> (link, fraction)."""

    segs: np.ndarray  # int64 [F, K]
    seg_ptr: np.ndarray  # int64 [S + 1]
    seg_link: np.ndarray  # int64 [nnz]
    seg_frac: np.ndarray  # float64 [nnz]
    seg_latency: np.ndarray  # float64 [S]: fraction-weighted sum of link latencies

    def flow_latency(self) -> np.ndarray:
        """float [F]: expected propagation latency of every flow (sum over its segments)."""
        return self.seg_latency[self.segs].sum(axis=1)

    def link_fractions(self, flow: int) -> dict[int, float]:
        """{link: fraction} of one flow, for tests and debugging."""
        out: dict[int, float] = {}
        for s in self.segs[flow]:
            for i in range(self.seg_ptr[s], self.seg_ptr[s + 1]):
                link = int(self.seg_link[i])
                out[link] = out.get(link, 0.0) + float(self.seg_frac[i])
        return out


@dataclass(frozen=True)
class Network:
    """A built network; see the module docstring for the routing structure."""

    name: str
    vertex_names: tuple[str, ...]
    link_src: np.ndarray  # int64 [L]
    link_dst: np.ndarray  # int64 [L]
    capacity: np.ndarray  # float64 [L] bytes/s
    latency: np.ndarray  # float64 [L] seconds
    gpu2node: np.ndarray  # int64 [G]
    gpu2local: np.ndarray  # int64 [G]
    gpu2nic: np.ndarray  # int64 [G] global NIC index the GPU sends and receives through
    nic2switch: np.ndarray  # int64 [N]
    up_seg: np.ndarray  # int64 [G]
    down_seg: np.ndarray  # int64 [G]
    inj_seg: np.ndarray  # int64 [N]
    ej_seg: np.ndarray  # int64 [N]
    intra_seg: np.ndarray  # int64 [nodes, gpus_per_node, gpus_per_node]
    seg_ptr: np.ndarray  # static segments (fabric segments are added per `route` call)
    seg_link: np.ndarray
    seg_frac: np.ndarray
    fabric_paths: FabricPaths
    nodes_per_group: int = 0  # Dragonfly group size in nodes (0: no groups), for placements

    @property
    def num_gpus(self) -> int:
        return len(self.gpu2node)

    @property
    def num_nodes(self) -> int:
        return int(self.intra_seg.shape[0])

    @property
    def gpus_per_node(self) -> int:
        return int(self.intra_seg.shape[1])

    @property
    def num_links(self) -> int:
        return len(self.capacity)

    def link_name(self, link: int) -> str:
        return f"{self.vertex_names[self.link_src[link]]}->{self.vertex_names[self.link_dst[link]]}"

    def route(self, src: np.ndarray, dst: np.ndarray, remote: np.ndarray | None = None) -> Routes:
        """Routes from GPU src[f] to GPU dst[f] (int arrays [F]); src == dst is an error.

        remote [F] bool (lumped networks): route as between two different nodes even when
        src and dst share a node (they stand for GPUs of two nodes lumped into one).
        """
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        remote = np.zeros(len(src), bool) if remote is None else np.asarray(remote, bool)
        G = self.num_gpus
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"src and dst must be 1-d of equal length, got {src.shape}, {dst.shape}")
        for name, a in (("src", src), ("dst", dst)):
            if a.size and (a.min() < 0 or a.max() >= G):
                raise ValueError(f"{name} GPU ids must be in 0..{G - 1}, got {a.min()}..{a.max()}")
        if np.any((src == dst) & ~remote):
            loop = src[(src == dst) & ~remote][0]
            raise ValueError(f"a flow from a GPU to itself has no route (GPU {loop})")
        segs = np.zeros((len(src), K_SEGMENTS), dtype=np.int64)
        n_s, n_d = self.gpu2node[src], self.gpu2node[dst]
        same = (n_s == n_d) & ~remote
        segs[same, 0] = self.intra_seg[n_s[same], self.gpu2local[src[same]],
                                       self.gpu2local[dst[same]]]
        far = ~same
        s_f, d_f = src[far], dst[far]
        nic_s, nic_d = self.gpu2nic[s_f], self.gpu2nic[d_f]
        if far.any() and (nic_s.min() < 0 or nic_d.min() < 0):
            raise ValueError(f"network {self.name!r} has GPUs without a NIC; inter-node flow")
        segs[far, 0] = self.up_seg[s_f]
        segs[far, 1] = self.inj_seg[nic_s]
        segs[far, 2 + FABRIC_PARTS] = self.ej_seg[nic_d]
        segs[far, 3 + FABRIC_PARTS] = self.down_seg[d_f]
        # Fabric segments: one per distinct switch pair carrying traffic.
        sw_s, sw_d = self.nic2switch[nic_s], self.nic2switch[nic_d]
        W = int(self.nic2switch.max()) + 1 if len(self.nic2switch) else 1
        pair = sw_s * W + sw_d
        uniq, inv = np.unique(pair, return_inverse=True)
        ptr = [self.seg_ptr]
        links: list[np.ndarray] = [self.seg_link]
        fracs: list[np.ndarray] = [self.seg_frac]
        n_static = len(self.seg_ptr) - 1
        end = int(self.seg_ptr[-1])
        pair2seg = np.zeros((len(uniq), FABRIC_PARTS), dtype=np.int64)
        key2seg: dict[Hashable, int] = {}
        for i, p in enumerate(uniq.tolist()):
            a, b = divmod(p, W)
            if a == b:
                continue  # same switch: the segments stay empty
            parts = self.fabric_paths(a, b)
            assert len(parts) <= FABRIC_PARTS, f"fabric route has {len(parts)} parts"
            for j, (key, make) in enumerate(parts):
                if key not in key2seg:
                    ls, fs = flatten_paths(make())
                    if not len(ls):
                        key2seg[key] = 0
                        continue
                    links.append(ls)
                    fracs.append(fs)
                    end += len(ls)
                    ptr.append(np.array([end], dtype=np.int64))
                    key2seg[key] = n_static + len(ptr) - 2
                pair2seg[i, j] = key2seg[key]
        segs[far, 2:2 + FABRIC_PARTS] = pair2seg[inv]
        seg_ptr = np.concatenate(ptr)
        seg_link = np.concatenate(links)
        seg_frac = np.concatenate(fracs)
        seg_of = np.repeat(np.arange(len(seg_ptr) - 1), np.diff(seg_ptr))
        seg_latency = np.bincount(seg_of, weights=seg_frac * self.latency[seg_link],
                                  minlength=len(seg_ptr) - 1)
        return Routes(segs, seg_ptr, seg_link, seg_frac, seg_latency)


def flatten_paths(paths: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Merge paths into one (link, fraction) list; a link on several paths sums fractions."""
    acc: dict[int, float] = {}
    total = 0.0
    for links, frac in paths:
        total += frac
        for link in links:
            acc[link] = acc.get(link, 0.0) + frac
    assert abs(total - 1.0) < 1e-9, f"path fractions sum to {total}, not 1"
    keys = sorted(acc)
    return np.array(keys, dtype=np.int64), np.array([acc[k] for k in keys], dtype=np.float64)


def ecmp_paths(
    adj: dict[int, list[tuple[int, int]]], src: int, dst: int, transit: Callable[[int], bool]
) -> list[Path]:
    """Shortest paths (hop count) from src to dst, flow split equally at every branch (ECMP).

    adj[v] = [(neighbour, link id), ...]; `transit(v)` says whether v may forward traffic (a
    NIC or a GPU that does not route is an endpoint only). Returns [(links, fraction)].
    """
    # BFS from dst on reversed edges gives the distance to dst of every vertex.
    rev: dict[int, list[int]] = {}
    for u, nbrs in adj.items():
        for v, _ in nbrs:
            rev.setdefault(v, []).append(u)
    dist = {dst: 0}
    queue = deque([dst])
    while queue:
        v = queue.popleft()
        for u in rev.get(v, []):
            if u not in dist and (u == src or transit(u)):
                dist[u] = dist[v] + 1
                queue.append(u)
    if src not in dist:
        raise ValueError(f"no path from vertex {src} to vertex {dst}")
    out: list[Path] = []

    def walk(v: int, links: tuple[int, ...], frac: float) -> None:
        if v == dst:
            out.append((links, frac))
            return
        nxt = [(w, lk) for w, lk in adj[v] if dist.get(w, -1) == dist[v] - 1]
        for w, lk in nxt:
            walk(w, links + (lk,), frac / len(nxt))

    walk(src, (), 1.0)
    return out


class NetworkBuilder:
    """Mutable helper the topology builders use; `build()` freezes it into a Network."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.vertex_names: list[str] = []
        # Links in chunks of arrays (src, dst, capacity, latency): builders add thousands
        # of links at once (a 74-group Dragonfly has ~95k), one Python call per link is slow.
        self._chunks: list[tuple[np.ndarray, ...]] = []
        self.num_links = 0
        self.seg_links: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64),
                                                                np.zeros(0))]

    def vertex(self, name: str) -> int:
        self.vertex_names.append(name)
        return len(self.vertex_names) - 1

    def links(self, u: np.ndarray, v: np.ndarray, capacity: float | np.ndarray,
              latency: float) -> np.ndarray:
        """Directed links u[i] -> v[i]; returns their ids."""
        u = np.atleast_1d(np.asarray(u, dtype=np.int64))
        v = np.atleast_1d(np.asarray(v, dtype=np.int64))
        cap = np.broadcast_to(np.asarray(capacity, dtype=np.float64), u.shape)
        if u.size and not cap.min() > 0:
            bad = int(np.argmin(cap))
            raise ValueError(f"link {self.vertex_names[u[bad]]}->{self.vertex_names[v[bad]]} "
                             f"needs capacity > 0 bytes/s, got {cap[bad]}")
        if latency < 0:
            raise ValueError(f"link latency must be >= 0 s, got {latency}")
        self._chunks.append((u, v, cap.copy(), np.full(u.shape, float(latency))))
        ids = np.arange(self.num_links, self.num_links + u.size)
        self.num_links += u.size
        return ids

    def link(self, u: int, v: int, capacity: float, latency: float) -> int:
        return int(self.links(np.array([u]), np.array([v]), capacity, latency)[0])

    def duplex(self, u: int, v: int, capacity: float, latency: float) -> tuple[int, int]:
        """Two directed links u->v and v->u of the same capacity (per direction)."""
        ids = self.links(np.array([u, v]), np.array([v, u]), capacity, latency)
        return int(ids[0]), int(ids[1])

    def segment(self, paths: Sequence[Path]) -> int:
        """A new segment over `paths`; an empty path list is segment 0."""
        if not paths or all(not links for links, _ in paths):
            return 0
        return self.segment_arrays(*flatten_paths(paths))

    def segment_arrays(self, links: np.ndarray, fracs: np.ndarray) -> int:
        """A new segment from (link ids, fractions) arrays; empty arrays give segment 0."""
        if not len(links):
            return 0
        self.seg_links.append((links, fracs))
        return len(self.seg_links) - 1

    def build(self, **fields: Any) -> Network:
        """The Network of the links and segments so far; `fields` are its other fields."""
        cols = [np.concatenate([c[i] for c in self._chunks]) if self._chunks else np.zeros(0)
                for i in range(4)]
        lengths = [len(ls) for ls, _ in self.seg_links]
        # id lists become int64 arrays; the rest (fabric_paths, nodes_per_group) as given
        extra: dict[str, Any] = {
            k: (np.asarray(v, dtype=np.int64) if isinstance(v, (list, np.ndarray)) else v)
            for k, v in fields.items()}
        seg_ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return Network(
            name=self.name,
            vertex_names=tuple(self.vertex_names),
            link_src=cols[0].astype(np.int64),
            link_dst=cols[1].astype(np.int64),
            capacity=cols[2].astype(np.float64),
            latency=cols[3].astype(np.float64),
            seg_ptr=seg_ptr,
            seg_link=np.concatenate([ls for ls, _ in self.seg_links]).astype(np.int64),
            seg_frac=np.concatenate([fs for _, fs in self.seg_links]).astype(np.float64),
            **extra,
        )
