"""Where every rank sits: node, local index, locality domain, network group and NIC.

A `Topology` is plain immutable data indexed by rank of one process group (the maps are named
`rank2node`, `rank2local`, ...). It is built four ways:
    Topology.uniform(nodes, gpus_per_node, ...)  rank r on node r // gpus_per_node
    Topology.from_file(path)                      a TOML description (see `comm.topology.file`)
    Topology.discover(group)                      environment + all-gathered host facts
    Topology.from_records(records)                the same from facts already gathered
and restricted to a sub-group with `restrict(ranks)` (an EP group is a subset of the world).
`dump_topology` writes the TOML that `from_file` reads back.

`comm.topology.file` and `comm.topology.discover` return field values and never import this module,
so the constructors here call them at module level: the three form a chain, not a circle.

Levels, coarsest first: network group (e.g. a Dragonfly cabinet) > locality domain (ranks
behind one switch) > node > NIC > rank. A node lives in one domain, a domain in one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comm.topology.discover import gather_records, topology_fields_from_records
from comm.topology.file import read_topology_file

__all__ = ["Topology", "dump_topology"]


@dataclass(frozen=True)
class Topology:
    """Per-rank placement; every tuple has one entry per rank of the group it describes."""

    rank2node: tuple[int, ...]
    rank2local: tuple[int, ...]
    rank2domain: tuple[int, ...]
    rank2group: tuple[int, ...]
    rank2nic: tuple[int, ...]  # NIC index inside the rank's node
    node_names: tuple[str, ...] = ()
    # node -> its ranks in local order; derived once here because plans look it up O(R^2)
    # times per call.
    _node2ranks: tuple[tuple[int, ...], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        fields = {
            "rank2node": self.rank2node,
            "rank2local": self.rank2local,
            "rank2domain": self.rank2domain,
            "rank2group": self.rank2group,
            "rank2nic": self.rank2nic,
        }
        world = len(self.rank2node)
        if world == 0:
            raise ValueError("a Topology needs at least one rank, got rank2node=()")
        for name, values in fields.items():
            object.__setattr__(self, name, tuple(values))
            if len(values) != world:
                raise ValueError(f"{name} has {len(values)} entries, rank2node has {world}")
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
            if bad:
                raise ValueError(f"{name} must hold ints >= 0, got {list(values)}")
        nodes = sorted(set(self.rank2node))
        if nodes != list(range(len(nodes))):
            raise ValueError(f"node ids must be 0..{len(nodes) - 1} without gaps, got {nodes}")
        by_node: dict[int, list[int]] = {n: [] for n in nodes}
        for r in range(world):
            by_node[self.rank2node[r]].append(r)
        for n in nodes:
            ranks = by_node[n]
            locals_ = sorted(self.rank2local[r] for r in ranks)
            if locals_ != list(range(len(ranks))):
                raise ValueError(
                    f"node {n} holds ranks {ranks} whose local indices {locals_} are not "
                    f"0..{len(ranks) - 1}"
                )
            for level, m in (("domain", self.rank2domain), ("group", self.rank2group)):
                if len({m[r] for r in ranks}) != 1:
                    raise ValueError(
                        f"node {n} spans several {level}s {sorted({m[r] for r in ranks})}; "
                        f"a node must sit in one {level}"
                    )
        domain2group: dict[int, int] = {}
        for r in range(world):
            g = domain2group.setdefault(self.rank2domain[r], self.rank2group[r])
            if g != self.rank2group[r]:
                raise ValueError(
                    f"domain {self.rank2domain[r]} appears in network groups {g} and "
                    f"{self.rank2group[r]}; a domain must sit in one group"
                )
        node2ranks = tuple(
            tuple(sorted(by_node[n], key=lambda r: self.rank2local[r])) for n in nodes
        )
        object.__setattr__(self, "_node2ranks", node2ranks)
        names = tuple(self.node_names)
        object.__setattr__(self, "node_names", names)
        if names and len(names) != len(nodes):
            raise ValueError(f"node_names has {len(names)} entries for {len(nodes)} nodes")

    # ---- sizes and lookups -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.rank2node)

    @property
    def num_nodes(self) -> int:
        return len(self._node2ranks)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Ranks of `node` in local-index order."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} out of range; valid nodes 0..{self.num_nodes - 1}")
        return self._node2ranks[node]

    def ranks_per_node(self) -> tuple[int, ...]:
        return tuple(len(self.node_ranks(n)) for n in range(self.num_nodes))

    def nics_per_node(self) -> tuple[int, ...]:
        return tuple(
            len({self.rank2nic[r] for r in self.node_ranks(n)}) for n in range(self.num_nodes)
        )

    def node_name(self, node: int) -> str:
        return self.node_names[node] if self.node_names else f"node{node}"

    # ---- constructors ------------------------------------------------------------------
    @classmethod
    def uniform(
        cls,
        nodes: int,
        gpus_per_node: int,
        nodes_per_domain: int | None = None,
        domains_per_group: int | None = None,
        nics_per_node: int | None = None,
    ) -> Topology:
        """Rank r on node r // gpus_per_node; NIC k serves locals [k*G/nics, (k+1)*G/nics).

        Defaults: one domain and one group for everything, one NIC per rank. With 8 ranks
        and 4 NICs, locals 2k and 2k+1 share NIC k (Frontier: NIC k hangs off GCD 2k+1).
        """
        for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        nodes_per_domain = nodes if nodes_per_domain is None else nodes_per_domain
        nics = gpus_per_node if nics_per_node is None else nics_per_node
        if nodes_per_domain < 1:
            raise ValueError(f"nodes_per_domain must be >= 1, got {nodes_per_domain}")
        n_domains = -(-nodes // nodes_per_domain)
        domains_per_group = n_domains if domains_per_group is None else domains_per_group
        if domains_per_group < 1:
            raise ValueError(f"domains_per_group must be >= 1, got {domains_per_group}")
        if not 1 <= nics <= gpus_per_node or gpus_per_node % nics:
            divisors = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]
            raise ValueError(
                f"nics_per_node={nics} must divide gpus_per_node={gpus_per_node}; "
                f"valid: {', '.join(map(str, divisors))}"
            )
        world = nodes * gpus_per_node
        node = [r // gpus_per_node for r in range(world)]
        local = [r % gpus_per_node for r in range(world)]
        domain = [n // nodes_per_domain for n in node]
        return cls(
            rank2node=tuple(node),
            rank2local=tuple(local),
            rank2domain=tuple(domain),
            rank2group=tuple(d // domains_per_group for d in domain),
            rank2nic=tuple(lr * nics // gpus_per_node for lr in local),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Topology:
        """Read a TOML topology file; see `comm.topology.file` for the format. Every error
        names the file."""
        fields = read_topology_file(path)
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"{Path(path)}: {e}") from e

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Topology:
        """Derive the placement from every rank's `comm.topology.discover.local_record` (index = group
        rank); see `comm.discover` for the rules."""
        return cls(**topology_fields_from_records(records))

    @classmethod
    def discover(cls, group: Any, **kwargs: Any) -> Topology:
        """All-gather host facts over `group` and derive the same Topology on every rank.

        Collective: every rank of `group` must call it. The result is indexed by group rank.
        `kwargs` (env, hostname, sysfs_net) go to `comm.topology.discover.gather_records`.
        """
        return cls.from_records(gather_records(group, **kwargs))

    # ---- derived views -----------------------------------------------------------------
    def restrict(self, ranks: Sequence[int]) -> Topology:
        """The topology of a sub-group whose rank i is `ranks[i]` of this topology.

        Nodes are renumbered by first appearance and local indices re-packed in the old
        local order; domains, groups and NICs keep their ids (only equality matters).
        """
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(
                f"restrict needs distinct ranks in 0..{self.world_size - 1}, got {ranks}"
            )
        old2new: dict[int, int] = {}
        for r in ranks:
            old2new.setdefault(self.rank2node[r], len(old2new))
        local = [0] * len(ranks)
        for old_node in old2new:
            members = sorted(
                (i for i, r in enumerate(ranks) if self.rank2node[r] == old_node),
                key=lambda i: self.rank2local[ranks[i]],
            )
            for j, i in enumerate(members):
                local[i] = j
        return Topology(
            rank2node=tuple(old2new[self.rank2node[r]] for r in ranks),
            rank2local=tuple(local),
            rank2domain=tuple(self.rank2domain[r] for r in ranks),
            rank2group=tuple(self.rank2group[r] for r in ranks),
            rank2nic=tuple(self.rank2nic[r] for r in ranks),
            node_names=tuple(self.node_name(n) for n in old2new) if self.node_names else (),
        )

    def for_group(self, group: Any) -> Topology:
        """`restrict` to a torch.distributed sub-group (this topology indexes WORLD ranks)."""
        import torch.distributed as dist

        return self.restrict(dist.get_process_group_ranks(group))

    def summary(self) -> str:
        """A readable table: one line per node with its domain, group and rank -> NIC map."""
        per_node = self.ranks_per_node()
        head = (
            f"Topology: {self.world_size} ranks on {self.num_nodes} nodes "
            f"({'x'.join(map(str, sorted(set(per_node))))} ranks/node), "
            f"{len(set(self.rank2domain))} domains, {len(set(self.rank2group))} groups"
        )
        lines = [head]
        for n in range(self.num_nodes):
            ranks = self.node_ranks(n)
            r0 = ranks[0]
            nic_map = " ".join(f"{r}:nic{self.rank2nic[r]}" for r in ranks)
            lines.append(
                f"  {self.node_name(n):<12} group {self.rank2group[r0]:>3} "
                f"domain {self.rank2domain[r0]:>4}  ranks {nic_map}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def dump_topology(topo: Topology) -> str:
    """TOML text that `Topology.from_file` reads back to an equal Topology (names included)."""
    lines = []
    for n in range(topo.num_nodes):
        ranks = topo.node_ranks(n)
        r0 = ranks[0]
        lines += [
            "[[nodes]]",
            f'name = "{topo.node_name(n)}"',
            f"ranks = [{', '.join(map(str, ranks))}]",
            f"domain = {topo.rank2domain[r0]}",
            f"group = {topo.rank2group[r0]}",
            f"nics = [{', '.join(str(topo.rank2nic[r]) for r in ranks)}]",
            "",
        ]
    return "\n".join(lines)
