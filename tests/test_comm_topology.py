"""Topology: uniform layouts, validation, TOML files, restriction and discovery from records."""

from __future__ import annotations

from pathlib import Path

import pytest

from comm import Topology, decode_slingshot_mac, dump_topology, topology_from_records
from comm.topology.discover import local_record


def test_uniform_places_rank_r_on_node_r_div_g() -> None:
    topo = Topology.uniform(3, 4, nodes_per_domain=2, domains_per_group=1, nics_per_node=2)
    assert topo.rank2node == tuple(r // 4 for r in range(12))
    assert topo.rank2local == tuple(r % 4 for r in range(12))
    assert topo.rank2domain == (0,) * 8 + (1,) * 4
    assert topo.rank2group == (0,) * 8 + (1,) * 4
    assert topo.rank2nic == (0, 0, 1, 1) * 3  # locals 2k, 2k+1 share NIC k
    assert topo.node_ranks(2) == (8, 9, 10, 11)
    assert topo.ranks_per_node() == (4, 4, 4) and topo.nics_per_node() == (2, 2, 2)
    text = topo.summary()
    assert "12 ranks on 3 nodes" in text and "9:nic0" in text and "node2" in text


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"nodes": 0, "gpus_per_node": 2}, "nodes"),
        ({"nodes": 2, "gpus_per_node": 8, "nics_per_node": 3}, "valid: 1, 2, 4, 8"),
        ({"nodes": 2, "gpus_per_node": 2, "nodes_per_domain": 0}, "nodes_per_domain"),
    ],
)
def test_uniform_rejects_bad_sizes(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology.uniform(**kwargs)


def test_constructor_validates_invariants() -> None:
    ok = dict(rank2node=(0, 0, 1), rank2local=(0, 1, 0), rank2domain=(0, 0, 1),
              rank2group=(0, 0, 0), rank2nic=(0, 1, 0))
    Topology(**ok)
    for field, value, match in [
        ("rank2node", (0, 0, 2), "without gaps"),
        ("rank2local", (0, 0, 0), "local indices"),
        ("rank2domain", (0, 1, 1), "one domain"),
        ("rank2group", (0, 0, 1, 1), "entries"),
        ("rank2nic", (0, -1, 0), ">= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            Topology(**{**ok, field: value})
    with pytest.raises(ValueError, match="one group"):
        Topology(rank2node=(0, 1), rank2local=(0, 0), rank2domain=(0, 0), rank2group=(0, 1),
                 rank2nic=(0, 0))


def test_restrict_renumbers_nodes_and_locals() -> None:
    topo = Topology.uniform(4, 2, nodes_per_domain=2)
    sub = topo.restrict([7, 2, 3, 6])
    assert sub.rank2node == (0, 1, 1, 0)  # node of global 7 appears first
    assert sub.rank2local == (1, 0, 1, 0)  # old local order kept inside each node
    assert sub.rank2domain == (1, 0, 0, 1)
    with pytest.raises(ValueError, match="distinct ranks"):
        topo.restrict([1, 1])
    with pytest.raises(ValueError, match="0..7"):
        topo.restrict([8])


GOOD = """
[[nodes]]
name = "nid1"
ranks = [0, 2]
domain = 3
group = 1
nics = [0, 0]

[[nodes]]
name = "nid2"
ranks = [3, 1]
"""


def test_from_file_reads_nodes(tmp_path: Path) -> None:
    path = tmp_path / "topo.toml"
    path.write_text(GOOD)
    topo = Topology.from_file(path)
    assert topo.rank2node == (0, 1, 0, 1)
    assert topo.rank2local == (0, 1, 1, 0)
    assert topo.rank2domain == (3, 0, 3, 0) and topo.rank2group == (1, 0, 1, 0)
    assert topo.rank2nic == (0, 1, 0, 0)
    assert topo.node_names == ("nid1", "nid2")
    again = tmp_path / "again.toml"
    again.write_text(dump_topology(topo))
    assert Topology.from_file(again) == topo


@pytest.mark.parametrize(
    "text,match",
    [
        ("[[nodes]]\nranks = [0, 1\n", "not valid TOML"),
        ("[[nodes]]\nranks = [0, 2]\n", r"missing \[1\]"),
        ("[[nodes]]\nranks = [0]\n[[nodes]]\nranks = [0]\n", "already placed"),
        ("[[nodes]]\nranks = [0]\nrank = 1\n", "unknown keys"),
        ("[[nodes]]\nranks = [0, 1]\nnics = [0]\n", "1 nics for 2 ranks"),
        ("[[nodes]]\nranks = ['a']\n", "ints >= 0"),
        ("nodes = 3\n", "at least one"),
        ("gpus = 4\n[[nodes]]\nranks = [0]\n", "unknown top-level"),
        ("[[nodes]]\nranks = [0]\ndomain = 1\ngroup = 0\n[[nodes]]\nranks = [1]\ndomain = 1\n"
         "group = 1\n", "one group"),
    ],
)
def test_from_file_rejects_bad_files(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        Topology.from_file(path)
    assert str(path) in str(err.value)


def test_from_file_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        Topology.from_file(tmp_path / "nope.toml")


def _rec(host: str, netns: str = "net:[1]", macs: list | None = None, **env: object) -> dict:
    return {"hostname": host, "netns": netns, "env": {k: str(v) for k, v in env.items()},
            "macs": macs or []}


def test_discover_torchrun_env_and_hostnames() -> None:
    # 2 hosts x 2 ranks; LOCAL_RANK deliberately reversed on host b.
    records = [
        _rec("a", GROUP_RANK=0, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2),
        _rec("a", GROUP_RANK=0, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2),
        _rec("b", GROUP_RANK=1, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2),
        _rec("b", GROUP_RANK=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2),
    ]
    topo = topology_from_records(records)
    assert topo.rank2node == (0, 0, 1, 1)
    assert topo.rank2local == (0, 1, 1, 0)
    assert topo.node_names == ("a", "b")


def test_discover_emulated_nodes_share_hostname() -> None:
    # Network namespaces on one host: same hostname, different netns -> different nodes,
    # even without any launcher variables.
    records = [_rec("h", "net:[1]"), _rec("h", "net:[1]"), _rec("h", "net:[2]")]
    assert topology_from_records(records).rank2node == (0, 0, 1)


def test_discover_slurm_with_topology_addr() -> None:
    records = [
        _rec("n1", SLURM_NODEID=0, SLURM_LOCALID=0, SLURM_TOPOLOGY_ADDR="spine0.leaf0.n1"),
        _rec("n2", SLURM_NODEID=1, SLURM_LOCALID=0, SLURM_TOPOLOGY_ADDR="spine0.leaf1.n2"),
        _rec("n3", SLURM_NODEID=2, SLURM_LOCALID=0, SLURM_TOPOLOGY_ADDR="spine1.leaf2.n3"),
    ]
    topo = topology_from_records(records)
    assert topo.rank2node == (0, 1, 2)
    assert topo.rank2domain == (0, 1, 2) and topo.rank2group == (0, 0, 1)


@pytest.mark.parametrize(
    "records,match",
    [
        ([_rec("a", GROUP_RANK=0), _rec("b", GROUP_RANK=0)], "one node id on two hosts"),
        ([_rec("a", LOCAL_WORLD_SIZE=4), _rec("a", LOCAL_WORLD_SIZE=4)], "disagree"),
        ([_rec("a", LOCAL_RANK=0), _rec("a", LOCAL_RANK=0)], "are not 0..1"),
        ([_rec("a", GROUP_RANK="x")], "not an integer"),
        ([], "one record per rank"),
    ],
)
def test_discover_rejects_inconsistent_launch(records: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        topology_from_records(records)


def _mac(group: int, switch: int, port: int) -> str:
    low = (group << 11) | (switch << 6) | port
    value = (0x02 << 40) | low
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def test_slingshot_mac_decoding_drives_domains_groups_and_nics() -> None:
    assert decode_slingshot_mac(_mac(300, 17, 42)) == (300, 17, 42)
    with pytest.raises(ValueError, match="12 hex digits"):
        decode_slingshot_mac("02:00")
    # Two nodes on switch 5 of group 7, one node on switch 6; 4 ranks and 2 NICs per node.
    node_macs = {"x1": (7, 5), "x2": (7, 5), "x3": (8, 6)}
    records = []
    for host, (g, sw) in node_macs.items():
        macs = [("hsn0", _mac(g, sw, 1)), ("hsn1", _mac(g, sw, 2))]
        records += [_rec(host, macs=macs, LOCAL_RANK=i) for i in range(4)]
    topo = topology_from_records(records)
    assert topo.rank2domain == (0,) * 8 + (1,) * 4
    assert topo.rank2group == (0,) * 8 + (1,) * 4
    assert topo.rank2nic == (0, 0, 1, 1) * 3


def test_local_record_reads_sysfs_macs(tmp_path: Path) -> None:
    for name, mac in (("hsn1", _mac(1, 2, 3)), ("hsn0", _mac(1, 2, 4)), ("eth0", "x")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "address").write_text(mac + "\n")
    rec = local_record(env={"LOCAL_RANK": "3", "HOME": "/root"}, hostname="h", sysfs_net=tmp_path)
    assert rec["env"] == {"LOCAL_RANK": "3"}
    assert [name for name, _ in rec["macs"]] == ["hsn0", "hsn1"]
