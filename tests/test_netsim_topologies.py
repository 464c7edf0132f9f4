"""Topology builders: docs/reference.md facts, flow conservation of every route, routing rules."""

from __future__ import annotations

import numpy as np
import pytest

from comm.netsim import dgx_fat_tree, emulator, from_platform, frontier, frontier_node, generic
from comm.netsim.nodes import FRONTIER_IF_LINKS

GB = 1e9


def _links(net, u: str, v: str) -> list[int]:
    names = net.vertex_names
    return [i for i in range(net.num_links)
            if names[net.link_src[i]] == u and names[net.link_dst[i]] == v]


def _endpoint(net, gpu: int, remote: bool) -> int:
    """The GPU's vertex, or its NIC's when the GPU is attached directly (no up segment)."""
    if remote and net.up_seg[gpu] == 0:
        k = net.gpu2nic[gpu] % (len(net.nic2switch) // net.num_nodes)
        return net.vertex_names.index(f"n{net.gpu2node[gpu]}.nic{k}")
    return net.vertex_names.index(f"n{net.gpu2node[gpu]}.gpu{net.gpu2local[gpu]}")


def _check_conservation(net, src: int, dst: int, fracs: dict[int, float]) -> None:
    """Net outflow 1 at the source GPU, -1 at the destination, 0 everywhere else."""
    balance = np.zeros(len(net.vertex_names))
    for link, f in fracs.items():
        balance[net.link_src[link]] += f
        balance[net.link_dst[link]] -= f
    s_v, d_v = (_endpoint(net, g, net.gpu2node[src] != net.gpu2node[dst]) for g in (src, dst))
    expect = np.zeros_like(balance)
    expect[s_v], expect[d_v] = 1.0, -1.0
    np.testing.assert_allclose(balance, expect, atol=1e-12)


def test_frontier_node_matches_reference():
    net = frontier_node(if_efficiency=1.0)
    for (a, b), n in FRONTIER_IF_LINKS.items():
        for u, v in ((a, b), (b, a)):
            (link,) = _links(net, f"n0.gpu{u}", f"n0.gpu{v}")
            assert net.capacity[link] == n * 50 * GB
    assert len(_links(net, "n0.gpu0", "n0.gpu3")) == 0  # no direct link
    for k in range(4):  # NIC k hangs off GCD 2k+1 over 50 GB/s PCIe, 25 GB/s to the switch
        (pcie,) = _links(net, f"n0.gpu{2 * k + 1}", f"n0.nic{k}")
        assert net.capacity[pcie] == 50 * GB
        assert not _links(net, f"n0.gpu{2 * k}", f"n0.nic{k}")
        (inj,) = _links(net, f"n0.nic{k}", "g0.sw0")
        assert net.capacity[inj] == 25 * GB
    np.testing.assert_array_equal(net.gpu2nic, np.arange(8) // 2)


def test_frontier_node_routes():
    """GCD 0 -> 3 has two 2-hop paths (via 1 and via 2), split evenly; GCD 2k reaches NIC k
    through GCD 2k+1."""
    net = frontier_node()
    r = net.route(np.array([0]), np.array([3]))
    fr = {net.link_name(k): v for k, v in r.link_fractions(0).items()}
    assert fr == {"n0.gpu0->n0.gpu1": 0.5, "n0.gpu1->n0.gpu3": 0.5,
                  "n0.gpu0->n0.gpu2": 0.5, "n0.gpu2->n0.gpu3": 0.5}
    for s in range(8):
        for d in range(8):
            if s != d:
                _check_conservation(net, s, d, net.route(np.array([s]), np.array([d]))
                                    .link_fractions(0))


def test_dragonfly_structure():
    net = frontier(256)  # two groups
    names = net.vertex_names
    sw = [v for v in names if ".sw" in v]
    assert len(sw) == 64
    glob = [i for i in range(net.num_links) if names[net.link_src[i]].startswith("g0.sw")
            and names[net.link_dst[i]].startswith("g1.sw")]
    assert len(glob) == 4 and all(net.capacity[i] == 25 * GB for i in glob)
    assert len(_links(net, "g0.sw3", "g0.sw17")) == 1
    assert net.nic2switch[4 * 5] == 1  # node 5 sits on switch 1 of group 0


@pytest.mark.parametrize("nonminimal", [0.0, 0.3, 1.0, "balanced"])
def test_dragonfly_routes_conserve_flow(nonminimal):
    net = frontier(384, nonminimal=nonminimal)  # three groups: Valiant paths exist
    rng = np.random.default_rng(0)
    src = rng.integers(0, net.num_gpus, 40)
    dst = (src + rng.integers(1, net.num_gpus, 40)) % net.num_gpus
    r = net.route(src, dst)
    for f in range(40):
        _check_conservation(net, int(src[f]), int(dst[f]), r.link_fractions(f))
    # Minimal routes cross at most one global link (fraction 1 in total).
    r = net.route(np.array([0]), np.array([8 * 200]))
    group = [n.split(".")[0] if ".sw" in n else None for n in net.vertex_names]
    ends = {k: (group[net.link_src[k]], group[net.link_dst[k]]) for k in r.link_fractions(0)}
    glob = sum(v for k, v in r.link_fractions(0).items()
               if None not in ends[k] and ends[k][0] != ends[k][1])
    f = 0.5 if nonminimal == "balanced" else nonminimal  # balanced, 3 groups: (3-2)/(3-1)
    assert glob == pytest.approx(1.0 + f)  # Valiant paths cross two


def test_dgx_rail_routing():
    """Same rail: NIC -> leaf -> NIC; other rail: through the spines, split evenly."""
    net = dgx_fat_tree(4, spines=4)
    same = net.route(np.array([0]), np.array([8 + 0])).link_fractions(0)
    other = net.route(np.array([0]), np.array([8 + 3])).link_fractions(0)
    assert not any("spine" in net.link_name(k) for k in same)
    spine = {net.link_name(k): v for k, v in other.items() if "spine" in net.link_name(k)}
    assert len(spine) == 8 and all(v == 0.25 for v in spine.values())
    for s, d in ((0, 11), (3, 5), (9, 30)):
        _check_conservation(net, s, d, net.route(np.array([s]), np.array([d]))
                            .link_fractions(0))


def test_emulator_and_generic_shapes():
    net = emulator(3, 4, mbit=100.0)
    assert net.num_gpus == 12 and len(net.nic2switch) == 3
    assert set(net.capacity.tolist()) == {12.5e6}
    g = generic(6, 4, 2, nic_bw=10 * GB, intra_bw=100 * GB, nodes_per_switch=2, taper=2.0)
    (up,) = _links(g, "leaf0", "core")
    assert g.capacity[up] == 2 * 2 * 10 * GB / 2.0
    for s, d in ((0, 1), (0, 5), (1, 22)):
        _check_conservation(g, s, d, g.route(np.array([s]), np.array([d])).link_fractions(0))


def test_builders_reject_bad_values():
    with pytest.raises(ValueError, match="nonminimal"):
        frontier(4, nonminimal=1.5)
    with pytest.raises(ValueError, match="groups"):
        frontier(300, groups=2)
    with pytest.raises(ValueError, match="nics=3 must divide"):
        generic(2, 8, 3, nic_bw=1.0, intra_bw=None, nodes_per_switch=2)
    with pytest.raises(ValueError, match="mbit"):
        emulator(2, 2, mbit=0)
    with pytest.raises(ValueError, match="itself"):
        emulator(2, 2).route(np.array([1]), np.array([1]))


def test_from_platform_files():
    """configs/platforms: Frontier and DGX get their builders, the rest the generic one."""
    fr = from_platform("frontier", 8)
    assert fr.name == "frontier-8n" and fr.gpus_per_node == 8
    dgx = from_platform("dgx-h100", 4)
    assert dgx.name.startswith("dgx") and len(dgx.nic2switch) == 32
    desc = {"name": "toy", "node": {"gpus_per_node": 4, "intra_node_bandwidth_gbs": 100.0,
                                    "nodes_per_domain": 2},
            "network": {"nics_per_node": 2, "nic_bandwidth_gbs": 10.0}}
    toy = from_platform(desc, 4)
    (up,) = _links(toy, "leaf0", "core")
    assert toy.capacity[up] == 2 * 2 * 10 * GB
    with pytest.raises(ValueError, match="lacks"):
        from_platform({"name": "x", "node": {}}, 2)
    with pytest.raises(ValueError, match="unknown platform 'no-such-platform'; valid: .*frontier"):
        from_platform("no-such-platform", 2)
