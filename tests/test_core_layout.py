"""The core's layout: a few modules in its top folder, the families in rooms, no import cycle, and a lazy
package ``__init__`` (what ``report`` loads is counted in ``test_report_path.py``). Runtime: about a second.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "lossscale_callbacks"
MAX_TOP_MODULES = 20


def _core_modules() -> dict[str, Path]:
    """Every module of the core (not the integrations, installed beside it from ``integrations/``)."""
    modules = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(path: Path, known: set[str]) -> set[str]:
    """The library modules ``path`` imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lossscale_callbacks"):
            for alias in node.names:  # `from package import _module` imports that module
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lossscale_callbacks"))
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_core_modules():
    modules = _core_modules()
    graph = {name: _imports(path, set(modules)) & set(modules) - {name} for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_at_most_20_modules_directly_in_the_core_folder():
    top = sorted(path.name for path in CORE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


@pytest.mark.parametrize("room", ["report", "forensics", "loop"])
def test_the_families_live_in_their_rooms(room):
    # What the issue named: the report family and the forensics family in their folders, the loop in its own.
    family = {"report": {"_run_readers", "_run_report", "_report_cli", "_engine_formats", "_engine_logs",
                         "_engine_parsers", "_series_thinning", "_records"},
              "forensics": {"_gradients", "_words", "_advice", "_activations"},
              "loop": {"_logging_loop", "_rank_agreement"}}[room]
    assert family <= {path.stem for path in (CORE / room).glob("*.py")}
    assert not family & {path.stem for path in CORE.glob("*.py")}


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=True).stdout


def test_importing_the_package_loads_nothing_behind_the_face():
    code = ("import sys, lossscale_callbacks\n"
            "print(sorted(m for m in sys.modules if m.startswith('lossscale_callbacks')))\n")
    assert _fresh(code).strip() == "['lossscale_callbacks', 'lossscale_callbacks._extras']"
