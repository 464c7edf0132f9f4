"""The TOML topology file format: parse and validate it into `Topology` fields.

`comm.topology.Topology.from_file` builds the Topology from what this returns, and
`comm.topology.dump_topology` writes the format back; this module knows only the format, so
the Topology class can call it without a circle.

Format: one `[[nodes]]` table per node, ranks listed in local-index order.

    [[nodes]]
    name = "nid000001"      # optional, default "node<i>"
    ranks = [0, 1, 2, 3]    # global ranks on this node, local index = position
    domain = 0              # optional locality domain (switch), default 0
    group = 0               # optional network group (cabinet), default 0
    nics = [0, 0, 1, 1]     # optional NIC index per listed rank, default 0, 1, 2, ...

Every rank 0..R-1 must appear exactly once. Unknown keys, wrong types and gaps are rejected
with the file name and the offending node, so a typo cannot silently change the placement.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

__all__ = ["read_topology_file", "topology_fields"]

_NODE_KEYS = {"name", "ranks", "domain", "group", "nics"}


def _int_list(value: Any, where: str, key: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: '{key}' must be a non-empty list of ints, got {value!r}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: '{key}' must hold ints >= 0, got {value!r}")
    return list(value)


def topology_fields(doc: dict[str, Any], source: str = "<dict>") -> dict[str, tuple]:
    """The `Topology(...)` keyword arguments described by the parsed TOML document `doc` (see
    the module docstring). Checks the format; the Topology checks the placement itself."""
    extra = set(doc) - {"nodes"}
    if extra:
        raise ValueError(f"{source}: unknown top-level keys {sorted(extra)}; expected [[nodes]]")
    nodes = doc.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"{source}: needs at least one [[nodes]] table, got {nodes!r}")
    placed: dict[int, tuple[int, int, int, int, int]] = {}
    names = []
    for i, node in enumerate(nodes):
        where = f"{source}: nodes[{i}]"
        if not isinstance(node, dict):
            raise ValueError(f"{where} must be a table, got {node!r}")
        unknown = set(node) - _NODE_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid {sorted(_NODE_KEYS)}")
        if "ranks" not in node:
            raise ValueError(f"{where}: missing 'ranks'")
        ranks = _int_list(node["ranks"], where, "ranks")
        nics = _int_list(node.get("nics", list(range(len(ranks)))), where, "nics")
        if len(nics) != len(ranks):
            raise ValueError(f"{where}: {len(nics)} nics for {len(ranks)} ranks")
        level = {}
        for key in ("domain", "group"):
            v = node.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: '{key}' must be an int >= 0, got {v!r}")
            level[key] = v
        name = node.get("name", f"node{i}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a non-empty string, got {name!r}")
        names.append(name)
        for local, (r, nic) in enumerate(zip(ranks, nics, strict=True)):
            if r in placed:
                raise ValueError(f"{where}: rank {r} already placed on nodes[{placed[r][0]}]")
            placed[r] = (i, local, level["domain"], level["group"], nic)
    world = len(placed)
    missing = sorted(set(range(world)) - set(placed))
    if missing:
        raise ValueError(
            f"{source}: ranks must be 0..{world - 1} without gaps; missing {missing}, "
            f"largest listed {max(placed)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: node names repeat: {names}")
    rows = [placed[r] for r in range(world)]
    return dict(
        rank2node=tuple(row[0] for row in rows),
        rank2local=tuple(row[1] for row in rows),
        rank2domain=tuple(row[2] for row in rows),
        rank2group=tuple(row[3] for row in rows),
        rank2nic=tuple(row[4] for row in rows),
        node_names=tuple(names),
    )


def read_topology_file(path: str | Path) -> dict[str, tuple]:
    """`topology_fields` of the TOML file at `path`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read topology file {path}: {e}") from e
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from e
    return topology_fields(doc, str(path))
