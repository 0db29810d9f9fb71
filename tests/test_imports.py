"""The house's shape, read from the imports of every file under node/ with ``ast``: no import
cycle, each part on its floor importing only the floors below it, the engine (node/storage)
and the client library (node/client) at the bottom.

Every import counts: at the top of a module, under ``TYPE_CHECKING``, inside a function. A
lazy import hides a cycle from Python at start, not from the next reader; a type-only one
still ties the two modules' code together.

The same floors are in README.md's map (``## The code``); a part
added to node/ fails here until it is given a floor.

``python -m tests.test_imports`` prints the graph's cycles and breaks.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "node"

# The floors, the lowest first. A part (a package or a module of node/) imports its own
# modules and the parts of lower floors only: never a part on its own floor or above.
FLOORS: tuple[tuple[str, ...], ...] = (
    # 0, the ground floor: imports nothing of the node
    ("node.logs", "node.kubezone", "node.client", "node.faultpoints"),
    # 1, every knob (fault entries checked against the fault points' grammar)
    ("node.settings",),
    # 2, the engine and what sits on the settings or the client alone
    ("node.storage", "node.runtime", "node.sizing", "node.autorecovery", "node.localcluster"),
    # 3, the metrics observed as things happen (HTTP, the engine's probe, replication)
    ("node.metrics",),
    # 4, a node's side of replication
    ("node.replication",),
    # 5, streams (managed ledgers) over the engine or replicated ledgers
    ("node.streams",),
    # 6, the wire format (below HTTP, the audit and the benches), tiered storage, status
    ("node.wire", "node.offload", "node.status"),
    # 7, the Spark audit
    ("node.audit",),
    # 8, background work: GC, disks, retention, offload's schedule; their metrics' collector
    ("node.lifecycle",),
    # 9, the aiohttp application
    ("node.http",),
    # 10, operators' tools on top of the node and the client
    (
        "node.shell",
        "node.inspect",
        "node.jepsen",
        "node.devcluster",
        "node.settings_doc",
    ),
    # 11, the benchmarks (they start servers, clusters and the fault campaign)
    ("node.bench",),
    # 12, the command line, and 13 ``python -m node``
    ("node.cli",),
    ("node.__main__",),
)

# The foundations import less than their floor allows: the engine its settings, logs and
# fault points only (replication, metrics and HTTP build on it, never the reverse), the
# client library nothing of the node (scripts and the Airflow venv import it alone).
ONLY: dict[str, tuple[str, ...]] = {
    "node.storage": ("node.settings", "node.logs", "node.faultpoints"),
    "node.client": (),
}


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: Path
    is_package: bool


@cache
def modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        found[name] = Module(name, path, is_package)
    return found


def _owner(name: str, known: dict[str, Module]) -> str | None:
    """The module of node/ that importing ``name`` runs (``node.x.y.Name`` -> ``node.x.y``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: Module, known: dict[str, Module]) -> Iterator[str]:
    tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from filter(None, [_owner(alias.name, known)])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                # `from node.x import y`: the module node.x.y when there is one
                target = f"{source}.{alias.name}"
                yield from filter(None, [_owner(target if target in known else source, known)])


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module -> the modules of node/ it imports. ``node`` itself (the package's
    ``__init__``: its version) is left out, as every module's parent."""
    known = modules()
    return {
        name: frozenset(set(_imported(module, known)) - {name, PACKAGE})
        for name, module in known.items()
    }


def cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def part(name: str) -> str | None:
    """The part of FLOORS a module belongs to: the longest name that is it or its package."""
    parts = [p for floor in FLOORS for p in floor if name == p or name.startswith(p + ".")]
    return max(parts, key=len, default=None)


def floor(part_name: str) -> int:
    return next(i for i, parts in enumerate(FLOORS) if part_name in parts)


def _path(name: str) -> str:
    return str(modules()[name].path.relative_to(ROOT))


def breaks() -> list[str]:
    """Each import that runs down no floor, or past what a foundation may import."""
    found = []
    for importer, imported in sorted(graph().items()):
        mine = part(importer)
        if mine is None:
            continue  # test_every_module_has_a_floor says so
        for target in sorted(imported):
            theirs = part(target)
            if theirs is None or theirs == mine:
                continue
            if mine in ONLY and theirs not in ONLY[mine]:
                allowed = ", ".join(ONLY[mine]) or "itself"
                found.append(f"{_path(importer)} -> {target} ({mine}: {allowed} only)")
            elif floor(theirs) >= floor(mine):
                found.append(
                    f"{_path(importer)} -> {target} (floor {floor(mine)} -> {floor(theirs)})"
                )
    return found


def describe_cycles() -> list[str]:
    edges = graph()
    lines = []
    for component in cycles(edges):
        lines.append(" <-> ".join(_path(m) for m in component))
        for member in component:
            back = sorted(edges[member] & set(component))
            lines.append(f"    {_path(member)} imports {', '.join(back)}")
    return lines


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Top-level, relative, `from package import module`, under TYPE_CHECKING, in a function."""
    pkg = tmp_path / "node"
    (pkg / "a").mkdir(parents=True)
    for name in ("__init__.py", "a/__init__.py", "a/b.py", "c.py", "d.py", "e.py", "f.py"):
        (pkg / name).write_text("")
    (pkg / "a" / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import node.c\n"
        "from . import b\n"
        "from ..d import Thing\n"
        "if TYPE_CHECKING:\n"
        "    from node.e import Other\n"
        "def later() -> None:\n"
        "    from node import f\n"
    )
    known = {
        name: Module(name, pkg / path, path.endswith("__init__.py"))
        for name, path in (
            ("node", "__init__.py"),
            ("node.a", "a/__init__.py"),
            ("node.a.b", "a/b.py"),
            ("node.a.x", "a/x.py"),
            ("node.c", "c.py"),
            ("node.d", "d.py"),
            ("node.e", "e.py"),
            ("node.f", "f.py"),
        )
    }
    found = set(_imported(known["node.a.x"], known))
    assert found == {"node.c", "node.a.b", "node.d", "node.e", "node.f"}


def test_a_cycle_is_found_with_its_members() -> None:
    edges = {
        "a": frozenset({"b"}),
        "b": frozenset({"c"}),
        "c": frozenset({"a", "d"}),
        "d": frozenset({"e"}),
        "e": frozenset({"d"}),
        "f": frozenset({"a"}),
    }
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["d", "e"]]


def test_every_module_has_a_floor() -> None:
    assert [name for name in modules() if name != PACKAGE and part(name) is None] == []
    named = [p for parts in FLOORS for p in parts]
    assert len(named) == len(set(named)), "a part on two floors"


def test_no_import_cycle_among_the_modules_of_node() -> None:
    found = describe_cycles()
    assert found == [], "\n".join(["import cycles:", *found])


def test_each_part_imports_only_the_floors_below_it() -> None:
    """Also: node/storage imports node.settings and node.logs only, node/client nothing
    of node/, and nothing below node/http imports it."""
    found = breaks()
    assert found == [], "\n".join(["layer breaks:", *found])


def test_the_readme_map_shows_the_floors() -> None:
    """README's map lists the floors as this module does, the lowest first."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = []
    for line in text.splitlines():
        if line.startswith("| ") and line[2:].split(" |")[0].strip().isdigit():
            cells = [c.strip() for c in line.strip("|").split("|")]
            shown.append(tuple(p.strip("` ") for p in cells[1].split(",")))
    assert shown == [tuple(p.removeprefix("node.") for p in parts) for parts in FLOORS]


def main() -> int:
    found_cycles = describe_cycles()
    found_breaks = breaks()
    unplaced = [name for name in modules() if name != PACKAGE and part(name) is None]
    print(f"{len(modules())} modules, {sum(len(v) for v in graph().values())} imports")
    print(f"{len(cycles(graph()))} cycles")
    print("\n".join(found_cycles))
    print(f"{len(found_breaks)} layer breaks")
    print("\n".join(found_breaks))
    if unplaced:
        print(f"{len(unplaced)} modules without a floor: {', '.join(unplaced)}")
    return 1 if found_cycles or found_breaks or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
