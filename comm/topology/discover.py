"""Topology discovery: every rank reports host facts, all ranks derive the same placement.

A rank's record holds its hostname, its network-namespace id (distinct per emulated node, see
`comm.emulate`), the launcher variables (torchrun: GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE;
Slurm: SLURM_NODEID, SLURM_LOCALID, SLURM_TOPOLOGY_ADDR) and the MAC addresses of Slingshot
NICs (/sys/class/net/hsn*/address). No single source is trusted alone:
  * two ranks share a node only if hostname, namespace and every launcher node id agree;
  * a launcher node id shared by ranks on different hosts is an error (a broken launch);
  * LOCAL_RANK orders a node's ranks only if it is a permutation of 0..n-1 on that node, and
    LOCAL_WORLD_SIZE / a duplicated LOCAL_RANK that contradict the hostnames are errors.
Slingshot MACs encode group (9 bits), switch (5 bits) and port (6 bits) in their low 20
bits: group -> network group, (group, switch) -> locality domain. Without them, Slurm's
topology address (`spine.leaf.node`) gives leaf -> domain and spine -> group; without
either, everything is one domain and one group.

This module returns the placement as `Topology(...)` keyword arguments; the Topology class
(`Topology.discover`, `Topology.from_records`) builds itself from them, so it can call this
module without a circle.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["decode_slingshot_mac", "gather_records", "local_record", "topology_fields_from_records"]

_ENV_KEYS = (
    "GROUP_RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_NODEID",
    "SLURM_LOCALID",
    "SLURM_TOPOLOGY_ADDR",
)


def decode_slingshot_mac(mac: str) -> tuple[int, int, int]:
    """(group, switch, port) from the low 20 bits of a Slingshot NIC MAC address."""
    digits = mac.replace(":", "").replace("-", "")
    if len(digits) != 12:
        raise ValueError(f"MAC address {mac!r} must have 12 hex digits")
    try:
        low = int(digits, 16) & 0xFFFFF
    except ValueError as e:
        raise ValueError(f"MAC address {mac!r} is not hexadecimal") from e
    return low >> 11, (low >> 6) & 0x1F, low & 0x3F


def local_record(
    env: Mapping[str, str] | None = None,
    hostname: str | None = None,
    sysfs_net: str | Path = "/sys/class/net",
) -> dict[str, Any]:
    """The facts this process reports: hostname, netns id, launcher vars, hsn MACs."""
    env = os.environ if env is None else env
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    macs = []
    net = Path(sysfs_net)
    if net.is_dir():
        for dev in sorted(net.glob("hsn*")):
            try:
                macs.append((dev.name, (dev / "address").read_text().strip()))
            except OSError:
                continue
    return {
        "hostname": hostname if hostname is not None else os.uname().nodename,
        "netns": netns,
        "env": {k: env[k] for k in _ENV_KEYS if k in env},
        "macs": macs,
    }


def _int_env(rec: dict[str, Any], key: str, rank: int) -> int | None:
    value = rec["env"].get(key)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"rank {rank}: {key}={value!r} is not an integer") from e


def _group_nodes(records: list[dict[str, Any]]) -> list[list[int]]:
    """Ranks per node (each list ascending), nodes ordered by their lowest rank."""
    host_key = [(rec["hostname"], rec.get("netns", "")) for rec in records]
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        owner: dict[int, tuple[int, tuple[str, str]]] = {}
        for r, rec in enumerate(records):
            v = _int_env(rec, key, r)
            if v is None:
                continue
            first = owner.setdefault(v, (r, host_key[r]))
            if first[1] != host_key[r]:
                raise ValueError(
                    f"{key}={v} on rank {first[0]} (host {first[1][0]!r}) and rank {r} "
                    f"(host {host_key[r][0]!r}): one node id on two hosts; the launch is "
                    "inconsistent"
                )
    keys = [
        (*host_key[r], _int_env(rec, "GROUP_RANK", r), _int_env(rec, "SLURM_NODEID", r))
        for r, rec in enumerate(records)
    ]
    nodes: dict[tuple[Any, ...], list[int]] = {}
    for r, node_key in enumerate(keys):
        nodes.setdefault(node_key, []).append(r)
    return list(nodes.values())


def _local_order(records: list[dict[str, Any]], ranks: list[int]) -> list[int]:
    """The node's ranks in local-index order, cross-checked against the launcher."""
    for key in ("LOCAL_WORLD_SIZE",):
        sizes = {v for r in ranks if (v := _int_env(records[r], key, r)) is not None}
        if sizes and sizes != {len(ranks)}:
            raise ValueError(
                f"{key}={sorted(sizes)} but ranks {ranks} share host "
                f"{records[ranks[0]]['hostname']!r}; the launcher and the hosts disagree"
            )
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        found = [_int_env(records[r], key, r) for r in ranks]
        values = [v for v in found if v is not None]
        if len(values) < len(found):
            continue
        if sorted(values) != list(range(len(ranks))):
            raise ValueError(
                f"{key} values {values} on ranks {ranks} of host "
                f"{records[ranks[0]]['hostname']!r} are not 0..{len(ranks) - 1}"
            )
        return [r for _, r in sorted(zip(values, ranks, strict=True))]
    return list(ranks)


def topology_fields_from_records(records: list[dict[str, Any]]) -> dict[str, tuple]:
    """The `Topology(...)` keyword arguments derived from every rank's `local_record`
    (index = group rank)."""
    if not records:
        raise ValueError("topology_from_records needs one record per rank, got none")
    world = len(records)
    node, local, domain, group, nic = ([0] * world for _ in range(5))
    names = []
    switch_ids: dict[tuple[str, ...], int] = {}
    for n, ranks in enumerate(_group_nodes(records)):
        ordered = _local_order(records, ranks)
        macs = records[ordered[0]].get("macs", [])
        topo_addr = records[ordered[0]]["env"].get("SLURM_TOPOLOGY_ADDR", "")
        names.append(records[ordered[0]]["hostname"] or f"node{n}")
        for i, r in enumerate(ordered):
            node[r], local[r] = n, i
            if macs:
                # NIC k serves locals [k*n/nics, (k+1)*n/nics): Frontier's GCD pairs. The
                # node's domain is the switch of its first NIC (all 4 share one on Frontier).
                nic[r] = i * len(macs) // len(ordered)
                g, sw, _port = decode_slingshot_mac(macs[0][1])
                group[r] = switch_ids.setdefault(("mac-group", str(g)), len(switch_ids))
                domain[r] = switch_ids.setdefault(("mac", str(g), str(sw)), len(switch_ids))
            else:
                nic[r] = i
                parts = topo_addr.split(".") if topo_addr else []
                leaf = tuple(parts[:-1]) if len(parts) >= 2 else ("",)
                domain[r] = switch_ids.setdefault(("slurm", *leaf), len(switch_ids))
                group[r] = switch_ids.setdefault(("slurm-top", leaf[0]), len(switch_ids))
    # Domains and groups get dense ids in order of first appearance.
    dense_d = {d: i for i, d in enumerate(dict.fromkeys(domain))}
    dense_g = {g: i for i, g in enumerate(dict.fromkeys(group))}
    if len(set(names)) != len(names):
        names = [f"{name}#{n}" for n, name in enumerate(names)]
    return dict(
        rank2node=tuple(node),
        rank2local=tuple(local),
        rank2domain=tuple(dense_d[d] for d in domain),
        rank2group=tuple(dense_g[g] for g in group),
        rank2nic=tuple(nic),
        node_names=tuple(names),
    )


def gather_records(
    group: dist.ProcessGroup | None,
    env: Mapping[str, str] | None = None,
    hostname: str | None = None,
    sysfs_net: str | Path = "/sys/class/net",
) -> list[dict[str, Any]]:
    """Every rank's `local_record`, all-gathered over `group` (index = group rank).

    Collective: every rank of `group` must call it.
    """
    mine = local_record(env, hostname, sysfs_net)
    records: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, mine, group=group)
    return records
