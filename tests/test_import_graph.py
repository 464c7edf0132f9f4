"""The project's import graph has no circle and no arrow that runs up the layers.

The graph is read from the source with `ast`, not by importing: a node is a module of the
project (``comm.topology``, ``model``, ``train``), an edge is any ``import``/``from ... import``
statement in it, wherever it stands. Imports inside functions (the usual way to hide a circle)
and under ``if TYPE_CHECKING:`` count too: a circle that only closes at call time still means
neither module can be read, tested or moved without the other. Relative imports are resolved
against the importing module's package; ``from pkg import name`` is an edge to ``pkg.name`` when
that is a module and to ``pkg`` (its ``__init__``) otherwise. Importing ``a.b`` also runs
``a/__init__``; that implicit edge is not drawn, or every module would sit in a circle with its
own package. The body of a top-level ``if __name__ == "__main__":`` counts as well: a command
line that needs a higher layer lives in that layer (``python -m model.autotune``).

LAYERS is the declared order, bottom first. A package may import its own modules and packages
in lower layers only; packages in one layer are siblings and do not import each other.
KEEP_APART names pairs the order alone would allow but the design forbids. SUBLAYERS does the
same inside a package whose folder holds sub-packages (comm, trainer): a sub-package imports
only those below it; the package's own top-level modules (its ``__init__``, thin ``python -m``
entries) sit above all of them, except those SUBLAYERS places among them by name (trainer's
config, layout, common at the base, its checkpoint between distributed and observe). No
module of a package, and no test or benchmark, imports a private name (``_x``, or a module
``_x``) of another package or reads one off an imported module (``mod._x``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom first. Why this order (from the imports as they are):
#   piper_kernels, comm  the foundations: grouped GEMM / permute, and topology + all-to-all; they
#                   know nothing of models or of each other.
#   model           the MoE transformer; calls kernels, is rank-agnostic (no comm: parallelism
#                   is applied from outside, STYLE 14).
#   pipeline, balance  schedules and the expert balancer: pure planning code that a trainer
#                   drives; may use model/comm, are not used by them.
#   trainer         composes all of the above into a run.
#   tuner           the planner (which launches train.py as a process and borrows the
#                   trainer's corpus helper).
#   train           the training script, on top: it runs the trainer and, when an elastic
#                   attempt must re-plan its layout, asks the planner (tuner.replan, issue 30).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"piper_kernels", "comm"}),
    frozenset({"model"}),
    frozenset({"pipeline", "balance"}),
    frozenset({"trainer"}),
    frozenset({"tuner"}),
    frozenset({"train"}),
)

# (importer, imported) -> why not, although `imported` sits in a lower layer.
KEEP_APART: dict[tuple[str, str], str] = {
    ("model", "comm"): "model code is rank-agnostic; parallelism is applied from outside (STYLE 14)",
}

# Inside comm, bottom first:
#   topology     where ranks sit (Topology, files, discovery, platform files, HALO's relays)
#   cost         the all-to-all cost model; reads topologies only
#   collectives  flat / HALO / auto exchanges (auto asks cost), async exchanges, dedup
#   ep, tools, netsim  a MoE layer's exchanges under EP (dispatch / combine, the chunk
#                pipeline); launching, calibrating, emulating, self-checking; the network
#                simulator (which draws HALO's traffic from the collectives' plan)
#
# Inside trainer, bottom first (a name is a sub-package or one of the package's own modules;
# its modules not named here, the ones that compose a run, sit above all):
#   common, config, layout, data  the base: logging and errors, the run's config, the rank
#                arithmetic of a layout, the corpora; they import nothing else of trainer
#   distributed  process groups, EP / TP / PP, gradient sync, ZeRO-1/2/3, precision, replicas
#   checkpoint   save / load (it reads precision's fp32 masters)
#   observe      metrics, per-step stats, console rows, report, profiling, memory (stats reads
#                the mesh and names the MoE layers through checkpoint)
#   and above: setup, build, step, loop, elastic, ckpt_manager, export, faults, ...
SUBLAYERS: dict[str, tuple[frozenset[str], ...]] = {
    "comm": (
        frozenset({"topology"}),
        frozenset({"cost"}),
        frozenset({"collectives"}),
        frozenset({"ep", "tools", "netsim"}),
    ),
    "trainer": (
        frozenset({"common", "config", "layout", "data"}),
        frozenset({"distributed"}),
        frozenset({"checkpoint"}),
        frozenset({"observe"}),
    ),
}


def project_modules(root: Path, layers: Iterable[frozenset[str]]) -> dict[str, Path]:
    """Dotted module name -> source file, for every package in `layers` (``x.py`` at the
    root for a single-file module such as ``train``)."""
    mods: dict[str, Path] = {}
    for top in sorted(set().union(*layers)):
        pkg = root / top
        if (pkg / "__init__.py").is_file():
            for f in sorted(pkg.rglob("*.py")):
                parts = f.relative_to(root).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                mods[".".join(parts)] = f
        elif (root / f"{top}.py").is_file():
            mods[top] = root / f"{top}.py"
        else:
            raise ValueError(f"LAYERS names {top!r}, but neither {top}/__init__.py nor {top}.py exists")
    return mods


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules that module `name` imports anywhere in `source`."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                if node.level - 1 > len(base):
                    raise ValueError(f"{name}: relative import beyond the top package")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [
                f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names
            ]
        else:
            continue
        for t in targets:
            # `import comm.netsim.engine` -> the deepest project module named by the path.
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph(root: Path, layers: Iterable[frozenset[str]]) -> dict[str, set[str]]:
    mods = project_modules(root, layers)
    known = set(mods)
    return {
        m: imports_of(m, f.read_text(), f.name == "__init__.py", known) for m, f in mods.items()
    }


def cyclic_components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components that hold a cycle (Tarjan's algorithm): sets of
    modules each reachable from every other; sorted so the message is stable."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def strongconnect(v: str) -> None:
        # Recursion depth is bounded by the module count (a few hundred).
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(comps)


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One shortest cycle ``[a, b, ..., a]`` per cyclic component."""
    return [_cycle_in(graph, set(c)) for c in cyclic_components(graph)]


def _cycle_in(graph: Mapping[str, Iterable[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the smallest-named module of a strongly connected component."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in comp and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def upward_edges(
    graph: Mapping[str, Iterable[str]],
    layers: Iterable[frozenset[str]],
    apart: Iterable[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """Edges from a package to one in the same or a higher layer (its own modules aside), or
    between a pair of packages in `apart`."""
    layer_of = {pkg: i for i, group in enumerate(layers) for pkg in group}
    apart = set(apart)
    bad = []
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            a, b = src.partition(".")[0], dst.partition(".")[0]
            if a != b and (layer_of[b] >= layer_of[a] or (a, b) in apart):
                bad.append((src, dst))
    return bad


def sublayer_edges(graph: Mapping[str, Iterable[str]], package: str,
                   layers: Iterable[frozenset[str]]) -> list[tuple[str, str]]:
    """Edges inside `package` from one sub-package to one in the same or a higher sublayer
    (its own modules aside), and from a sub-package up to the package's own top-level modules."""
    layer_of = {sub: i for i, group in enumerate(layers) for sub in group}
    top = len(layer_of) + 1  # the package's own modules: above every sub-package

    def level(mod: str) -> tuple[str, int]:
        parts = mod.split(".")
        if len(parts) > 2 or (len(parts) == 2 and parts[1] in layer_of):
            return parts[1], layer_of[parts[1]]
        return mod, top  # the package itself or one of its top-level modules

    bad = []
    for src in sorted(graph):
        if src.partition(".")[0] != package or src == package:
            continue
        for dst in sorted(graph[src]):
            if dst.partition(".")[0] != package:
                continue
            (a, la), (b, lb) = level(src), level(dst)
            if a != b and la != top and (lb >= la):
                bad.append((src, dst))
    return bad


def private_imports(root: Path, layers: Iterable[frozenset[str]],
                    files: Mapping[str, Path] | None = None) -> list[str]:
    """``file:line: module imports name`` for every use of a private module or name (a dotted
    part starting with ``_``) of another top-level package, in the project's modules or in
    `files` (name -> path; a name outside the packages owns none): imported (``from a import
    _x``, ``import a._x``) or read off an imported module (``import a.b`` then ``a.b._x``,
    ``from a import b`` then ``b._x``; attributes of other objects are not followed)."""
    layers = list(layers)
    tops = set().union(*layers)
    known = set(project_modules(root, layers))
    bad = []

    def private(name: str, own: str) -> bool:
        parts = name.split(".")
        return parts[0] in tops and parts[0] != own and any(
            p.startswith("_") and not p.startswith("__") for p in parts[1:])

    for mod, f in (files if files is not None else project_modules(root, layers)).items():
        own = mod.partition(".")[0]
        tree = ast.parse(f.read_text())
        bound: dict[str, str] = {}  # a local name -> the project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                bound |= {a.asname or a.name: n for a, n in zip(node.names, names, strict=True)
                          if n in known}
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                bound |= {a.asname: a.name for a in node.names if a.asname and a.name in known}
                bound |= {t: t for a, n in zip(node.names, names, strict=True)
                          if not a.asname and (t := n.partition(".")[0]) in known}
            else:
                continue
            bad += [f"{f.relative_to(root)}:{node.lineno}: {mod} imports {n}" for n in names
                    if private(n, own)]
        for node in ast.walk(tree):  # `<module>._x`, the module named through a bound name
            if isinstance(node, ast.Attribute) and (m := _dotted(node.value, bound)) in known:
                name = f"{m}.{node.attr}"
                if private(name, own):
                    bad.append(f"{f.relative_to(root)}:{node.lineno}: {mod} uses {name}")
    return list(dict.fromkeys(bad))  # a name used twice on a line: once


def _dotted(node: ast.expr, bound: Mapping[str, str]) -> str:
    """``a.b.c`` for an expression of names and attributes whose first name is bound to a
    module (``bound``: local name -> dotted module), else ''."""
    if isinstance(node, ast.Name):
        return bound.get(node.id, "")
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value, bound)):
        return f"{base}.{node.attr}"
    return ""


def _layer_text(layers: Iterable[frozenset[str]]) -> str:
    return " < ".join("{" + ", ".join(sorted(g)) + "}" for g in layers)


# ---- the project ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, LAYERS)


def test_graph_sees_the_project(graph: dict[str, set[str]]) -> None:
    # A guard against a reader that silently finds nothing: known modules and edges exist.
    for m in ("comm", "comm.topology", "model.transformer", "piper_kernels.permute", "trainer",
              "trainer.distributed.mesh", "trainer.observe.stats", "train"):
        assert m in graph, f"{m} missing from the import graph"
    assert "model.config" in graph["model.transformer"]  # relative `from .config import`
    assert "trainer" in graph["train"]  # function-level `from trainer import ...`


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    comps = cyclic_components(graph)
    lines = []
    for comp in comps:
        line = "  " + " -> ".join(_cycle_in(graph, set(comp)))
        if len(comp) > 2:
            line += f"   (circle among {', '.join(comp)})"
        lines.append(line)
    assert not comps, "import cycles (function-level imports count):\n" + "\n".join(lines)


def test_no_upward_import(graph: dict[str, set[str]]) -> None:
    bad = upward_edges(graph, LAYERS, KEEP_APART)
    why = {(a, b): KEEP_APART.get((a.partition(".")[0], b.partition(".")[0])) for a, b in bad}
    assert not bad, (
        f"imports that run up or sideways in the layer order {_layer_text(LAYERS)}:\n"
        + "\n".join(f"  {a} imports {b}" + (f" ({why[a, b]})" if why[a, b] else "")
                     for a, b in bad)
    )


def test_no_upward_import_inside_packages(graph: dict[str, set[str]]) -> None:
    for pkg, layers in SUBLAYERS.items():
        subs = {p.name for p in (ROOT / pkg).iterdir() if (p / "__init__.py").is_file()}
        mods = {p.stem for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"}
        named = set().union(*layers)
        # Every sub-package has its place; every name placed is a sub-package or a module.
        assert subs <= named, f"{pkg}: sub-packages {sorted(subs - named)} not in SUBLAYERS"
        assert named <= subs | mods, f"{pkg}: SUBLAYERS names {sorted(named - subs - mods)}"
        bad = sublayer_edges(graph, pkg, layers)
        assert not bad, (
            f"imports that run up or sideways in {pkg}'s order {_layer_text(layers)}:\n"
            + "\n".join(f"  {a} imports {b}" for a, b in bad))


def test_no_private_import_across_packages() -> None:
    bad = private_imports(ROOT, LAYERS)
    assert not bad, "private names imported from another package:\n  " + "\n  ".join(bad)


def test_tests_and_benchmarks_use_public_names() -> None:
    # Tests and benchmarks drive the packages through their public names, as a user would;
    # a test that needs a private name moves next to the code, or the name becomes public.
    files = {f"tests.{f.stem}": f for f in sorted((ROOT / "tests").glob("*.py"))}
    files |= {f"benchmarks.{f.stem}": f for f in sorted((ROOT / "benchmarks").glob("*.py"))}
    bad = private_imports(ROOT, LAYERS, files)
    assert not bad, "private names used by tests or benchmarks:\n  " + "\n  ".join(bad)


# ---- the checker itself, on synthetic graphs and sources ------------------------------------


def test_find_cycles_names_each_cycle() -> None:
    g = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": set(),
        "x": {"y"},
        "y": {"x"},  # x <-> y
        "s": {"s"},  # a module importing itself
    }
    assert find_cycles(g) == [["a", "b", "c", "a"], ["s", "s"], ["x", "y", "x"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_upward_edges_flags_up_and_sideways() -> None:
    layers = (frozenset({"low", "side"}), frozenset({"high"}))
    g = {
        "low.a": {"low.b", "high.x"},  # up
        "low.b": {"side"},  # sideways, same layer
        "high.x": {"low.a", "high"},  # down, and its own package
        "side": set(),
        "high": set(),
    }
    assert upward_edges(g, layers) == [("low.a", "high.x"), ("low.b", "side")]
    assert upward_edges(g, layers, {("high", "low")}) == [
        ("high.x", "low.a"),
        ("low.a", "high.x"),
        ("low.b", "side"),
    ]


def test_imports_of_resolves_relative_and_lazy_imports() -> None:
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "other"}
    src = (
        "from . import a\n"
        "from .sub.c import thing\n"
        "import os\n"
        "def f():\n"
        "    from pkg import helper\n"
        "    import other.deep\n"
    )
    assert imports_of("pkg.b", src, False, known) == {"pkg.a", "pkg.sub.c", "pkg", "other"}
    assert imports_of("pkg.sub", "from .. import b\nfrom .c import x\n", True, known) == {
        "pkg.b",
        "pkg.sub.c",
    }
    # A command line's imports count: `python -m pkg.b` needs `other` as much as an import does.
    main = 'if __name__ == "__main__":\n    import other\n'
    assert imports_of("pkg.b", main, False, known) == {"other"}


def test_sublayer_edges_flags_up_sideways_and_into_the_top() -> None:
    layers = (frozenset({"low"}), frozenset({"mid", "side"}))
    g = {
        "p": {"p.low.a", "p.entry"},  # the package's own modules may import anything below
        "p.entry": {"p.mid.x"},
        "p.low.a": {"p.low", "p.mid.x", "p.entry"},  # own package fine; up; into the top
        "p.mid.x": {"p.low.a", "p.side"},  # down fine; sideways
        "p.low": set(),
        "p.side": set(),
        "q.other": {"p.mid.x"},  # another package: not this check's business
    }
    assert sublayer_edges(g, "p", layers) == [
        ("p.low.a", "p.entry"), ("p.low.a", "p.mid.x"), ("p.mid.x", "p.side")]


def test_private_imports_names_each_one(tmp_path: Path) -> None:
    for rel, text in {"a/__init__.py": "from b._x import y\nfrom b import _z\nfrom a._own import k\n"
                                       "import b.c\n",
                      "a/m.py": "import b.c\nfrom b import c as cc\nimport b.c as bc\n"
                                "b.c._p, cc._q, bc._r, b.c.pub, cc.__doc__\n",
                      "a/_own.py": "", "b/__init__.py": "", "b/_x.py": "", "b/c.py": ""}.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    init, m = Path("a/__init__.py"), Path("a/m.py")
    assert private_imports(tmp_path, (frozenset({"a", "b"}),)) == [
        f"{init}:1: a imports b._x.y", f"{init}:2: a imports b._z",
        f"{m}:4: a.m uses b.c._p", f"{m}:4: a.m uses b.c._q", f"{m}:4: a.m uses b.c._r"]
