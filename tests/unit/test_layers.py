"""The package layering of ``leasekit`` (``leasekit/layers.py``) holds for every import, no two leasekit
modules import each other (directly or round a loop), and no file under ``leasekit/`` is over 400 lines.

Imports are read with ``ast`` from the source, never by importing it: module-level, function-level and
``if TYPE_CHECKING:`` imports all count. ``from pkg import name`` counts as an import of ``pkg.name``
when that is a module, else of ``pkg``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from leasekit.layers import LAYERS, allowed, layer_of, unit_of

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "leasekit"
MAX_LINES = 400

PENDING_UPWARD: dict[tuple[str, str], str] = {
    # (file relative to the repository, imported module) -> why it is still allowed. Only for files
    # another change is editing at the same time; each entry is removed by the fix.
}
PENDING_CYCLES: dict[frozenset[str], str] = {
    # frozenset of the modules of one import cycle -> why it is still allowed (same rule as above).
}
PENDING_LONG: dict[str, str] = {
    # file relative to the repository -> why it may still be over MAX_LINES (same rule as above).
}


@dataclass(frozen=True)
class Import:
    """One import of a leasekit module: where it is written and what it names."""

    path: str  # file, relative to the root the scan started from
    line: int
    importer: str  # dotted module name of the file
    imported: str  # dotted name of the leasekit module it imports


def module_name(path: Path, root: Path) -> str:
    """``leasekit/chaos/faults/kill.py`` -> ``leasekit.chaos.faults.kill``; a package's ``__init__.py``
    is the package itself."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def scan(root: Path, package: str = "leasekit") -> tuple[dict[str, Path], list[Import]]:
    """Every module under ``root/package`` and every import of a ``package`` module in them."""
    modules = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    imports: list[Import] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                while target not in modules and "." in target:  # a name inside a module: the module
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    imports.append(Import(str(path.relative_to(root)), node.lineno, name, target))
    return modules, imports


def describe(module: str) -> str:
    return f"layer {layer_of(module)} ({unit_of(module)})"


def upward_imports(imports: list[Import]) -> list[tuple[Import, str]]:
    """``(import, message)`` per import of a higher layer, or of a package that shares the importer's layer."""
    problems = []
    for imp in imports:
        if allowed(imp.importer, imp.imported):
            continue
        if layer_of(imp.importer) == layer_of(imp.imported):
            why = "packages that share a layer are independent"
        else:
            why = "a layer imports only from lower layers"
        problems.append((imp, f"{imp.path}:{imp.line}: {imp.importer} ({describe(imp.importer)}) imports "
                              f"{imp.imported} ({describe(imp.imported)}): {why} (leasekit/layers.py)"))
    return problems


def import_cycles(modules: dict[str, Path], imports: list[Import]) -> list[tuple[frozenset[str], str]]:
    """One ``(modules, message)`` per strongly connected set of two or more modules; the message walks
    one loop through it, naming the file and line of each import."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        edges[imp.importer].setdefault(imp.imported, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the module graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in modules:
        if v not in index:
            connect(v)
    found = []
    for component in components:
        if len(component) < 2:
            continue
        members, start = set(component), min(component)
        parent: dict[str, str] = {}
        frontier, end = [start], None
        while frontier and end is None:  # breadth first inside the component, back to start
            nxt = []
            for v in frontier:
                for w in sorted(edges[v]):
                    if w == start:
                        end = v
                        break
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        loop = [end]
        while loop[-1] != start:
            loop.append(parent[loop[-1]])
        loop.reverse()
        steps = [edges[a][b] for a, b in zip(loop, loop[1:] + [start])]
        text = " -> ".join(f"{s.path}:{s.line} imports {s.imported}" for s in steps)
        found.append((frozenset(component), f"import cycle among {sorted(component)}: {text}"))
    return found


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """``file -> lines`` of every ``.py`` under ``root/leasekit`` longer than ``limit`` lines."""
    lengths = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines())
               for p in sorted((root / "leasekit").rglob("*.py"))}
    return {path: n for path, n in lengths.items() if n > limit}


# -- the repository -----------------------------------------------------------------------------

MODULES, IMPORTS = scan(REPO)


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if unit_of(m) is None)
    assert not missing, f"modules in no layer (add their package to leasekit/layers.py LAYERS): {missing}"


def test_no_import_from_a_higher_layer():
    found = upward_imports(IMPORTS)
    problems = [message for imp, message in found if (imp.path, imp.imported) not in PENDING_UPWARD]
    assert not problems, "imports against the layering:\n" + "\n".join(problems)
    stale = sorted(set(PENDING_UPWARD) - {(imp.path, imp.imported) for imp, _ in found})
    assert not stale, f"PENDING_UPWARD entries that no longer occur (remove them): {stale}"


def test_no_import_cycle_between_leasekit_modules():
    cycles = import_cycles(MODULES, IMPORTS)
    problems = [message for members, message in cycles if members not in PENDING_CYCLES]
    assert not problems, "\n".join(problems)
    stale = [sorted(m) for m in PENDING_CYCLES if m not in {members for members, _ in cycles}]
    assert not stale, f"PENDING_CYCLES entries that no longer occur (remove them): {stale}"


def test_no_file_over_400_lines_in_leasekit():
    over = long_files(REPO)
    problems = [f"{path}: {n} lines (at most {MAX_LINES}; split it into cohesive modules)"
                for path, n in over.items() if path not in PENDING_LONG]
    assert not problems, "\n".join(problems)
    stale = sorted(set(PENDING_LONG) - set(over))
    assert not stale, f"PENDING_LONG entries no longer over {MAX_LINES} lines (remove them): {stale}"


# -- the checks themselves, on a package made up for the purpose ----------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_scan_sees_function_level_relative_and_type_checking_imports(tmp_path):
    _write(tmp_path, {
        "leasekit/__init__.py": "",
        "leasekit/telemetry/__init__.py": "",
        "leasekit/telemetry/spans.py": "def f():\n    from leasekit.chaos import checks\n",
        "leasekit/chaos/__init__.py": "from .checks import verdict\n",
        "leasekit/chaos/checks.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from leasekit.telemetry.spans import f\nverdict = 1\n"),
    })
    _, imports = scan(tmp_path)
    got = {(i.path, i.line, i.imported) for i in imports}
    assert got == {("leasekit/telemetry/spans.py", 2, "leasekit.chaos.checks"),
                   ("leasekit/chaos/__init__.py", 1, "leasekit.chaos.checks"),
                   ("leasekit/chaos/checks.py", 3, "leasekit.telemetry.spans")}


def test_an_upward_import_is_named_with_file_line_and_both_layers(tmp_path):
    _write(tmp_path, {
        "leasekit/__init__.py": "",
        "leasekit/telemetry/__init__.py": "",
        "leasekit/telemetry/log.py": "import json\n\nfrom leasekit.chaos.leases import Timeline\n",
        "leasekit/chaos/__init__.py": "",
        "leasekit/chaos/leases.py": "from leasekit.telemetry import log\nTimeline = 1\n",
        "leasekit/sim/__init__.py": "from leasekit.vllm import connector\n",
        "leasekit/vllm/__init__.py": "",
        "leasekit/vllm/connector.py": "",
    })
    problems = [message for _, message in upward_imports(scan(tmp_path)[1])]
    assert len(problems) == 2
    assert problems[0].startswith("leasekit/sim/__init__.py:1: leasekit.sim (layer 3 (leasekit.sim)) imports "
                                  "leasekit.vllm.connector (layer 3 (leasekit.vllm)): packages that share a layer")
    assert problems[1].startswith("leasekit/telemetry/log.py:3: leasekit.telemetry.log (layer 2 (leasekit.telemetry)) "
                                  "imports leasekit.chaos.leases (layer 5 (leasekit.chaos))")


def test_a_cycle_is_named_with_each_import_on_the_loop(tmp_path):
    _write(tmp_path, {
        "leasekit/__init__.py": "",
        "leasekit/chaos/__init__.py": "",
        "leasekit/chaos/faults/__init__.py": "",
        "leasekit/chaos/faults/netns.py": "from leasekit.chaos.faults.nft import NftFault\n",
        "leasekit/chaos/faults/nft.py": "\n\ndef f():\n    from . import netns\n",
        "leasekit/chaos/faults/kill.py": "from leasekit.chaos.faults import nft\n",  # into the loop, not on it
    })
    modules, imports = scan(tmp_path)
    (members, message), = import_cycles(modules, imports)
    assert members == {"leasekit.chaos.faults.netns", "leasekit.chaos.faults.nft"}
    assert ("leasekit/chaos/faults/netns.py:1 imports leasekit.chaos.faults.nft -> "
            "leasekit/chaos/faults/nft.py:4 imports leasekit.chaos.faults.netns") in message


def test_a_long_file_is_named_with_its_length(tmp_path):
    _write(tmp_path, {"leasekit/__init__.py": "", "leasekit/ok.py": "x = 1\n" * MAX_LINES,
                      "leasekit/cluster/big.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_files(tmp_path) == {"leasekit/cluster/big.py": MAX_LINES + 1}


@pytest.mark.parametrize("importer, imported, ok", [
    ("leasekit.chaos.faults.kill", "leasekit.cluster.server", True),
    ("leasekit.cluster.pair", "leasekit.chaos.schema", False),
    ("leasekit.telemetry.vllm_log", "leasekit.telemetry.semconv", True),
    ("leasekit.cli", "leasekit.runbook.status", True),
    ("leasekit.lease.table", "leasekit", True),
    ("leasekit.layers", "leasekit.lease", False),
    ("leasekit.runbook.lint", "leasekit.dashboards.rules", False),
])
def test_layer_rule(importer, imported, ok):
    assert allowed(importer, imported) is ok


def test_a_module_outside_every_layer_is_refused():
    assert unit_of("leasekit.newthing") is None and unit_of("leasekit") == "leasekit"
    with pytest.raises(ValueError, match="'leasekit.newthing' is in no layer"):
        allowed("leasekit.newthing", "leasekit.lease")
    assert [unit for names in LAYERS for unit in names].count("leasekit.chaos") == 1
