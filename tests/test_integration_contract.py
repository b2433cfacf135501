"""The written contract between the core and the integrations, kept by the import graph.

Every ``lossscale_callbacks`` import of every file under ``integrations/`` is read from its syntax tree
(those inside functions and under ``TYPE_CHECKING`` too): an integration imports its own modules, the
package faces, the extension points (:mod:`lossscale_callbacks.integration`, the contract, among them) and
nothing else of the core or of another integration. The contract's names each have one line, and
``docs/adding_an_integration.md`` lists exactly them. Runtime: about a second.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_public_api import EXTENSION, FACES

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ROOT / "integrations"
CONTRACTS = ("lossscale_callbacks.integration", "lossscale_callbacks.torch.integration")
PAGE = ROOT / "docs" / "adding_an_integration.md"


def _integration_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (INTEGRATIONS / parts[1]).is_dir() else None


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _modules_of(node: ast.ImportFrom) -> list[str]:
    """The modules an import statement loads: ``from package import _module`` loads that module."""
    base = node.module or ""
    found = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        parts = full.split(".")[1:]
        folder = INTEGRATIONS if _integration_of(full) is not None else ROOT / "lossscale_callbacks"
        found.append(full if folder.joinpath(*parts).with_suffix(".py").is_file() else base)
    return found


def library_imports() -> list[tuple[str, str, str]]:
    """``(integration, file, imported module)`` for every import of the library under ``integrations/``."""
    rows = []
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        integration = path.relative_to(INTEGRATIONS).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                    "lossscale_callbacks"):
                modules = _modules_of(node)
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("lossscale_callbacks")]
            else:
                continue
            rows += [(integration, str(path.relative_to(ROOT)), module) for module in modules]
    return rows


def test_the_graph_is_read():
    rows = library_imports()
    assert len(rows) > 100
    # a lazy import inside a function is seen too
    assert ("lightning", "integrations/lightning/_loggers.py", "lossscale_callbacks.wandb") in rows


def test_integrations_import_no_private_core_module():
    private = sorted({(file, module) for integration, file, module in library_imports()
                      if _integration_of(module) is None and _is_private(module)})
    assert private == [], "use the faces or lossscale_callbacks.integration (the contract) instead"


def test_no_integration_imports_another_integrations_private_module():
    crossing = sorted({(file, module) for integration, file, module in library_imports()
                       if _integration_of(module) not in (None, integration) and _is_private(module)})
    assert crossing == [], "use that integration's face or its integration module instead"


def test_integrations_import_only_faces_extension_points_and_themselves():
    allowed = set(FACES) | set(EXTENSION)
    other = sorted({(file, module) for integration, file, module in library_imports()
                    if _integration_of(module) != integration and module not in allowed})
    assert other == []


def test_the_rule_catches_a_private_import():
    tree = ast.parse("from lossscale_callbacks._metrics import SCALE\n"
                     "from lossscale_callbacks import _metrics as m\n"
                     "from lossscale_callbacks.torch._scaler import LossScaler\n")
    modules = [m for node in tree.body for m in _modules_of(node)]
    assert modules == ["lossscale_callbacks._metrics", "lossscale_callbacks._metrics",
                       "lossscale_callbacks.torch._scaler"]
    assert all(_is_private(m) for m in modules)


def _contract(module_name: str):
    if module_name.startswith("lossscale_callbacks.torch"):
        pytest.importorskip("torch")
    return importlib.import_module(module_name)


@pytest.mark.parametrize("module_name", CONTRACTS)
def test_each_name_of_the_contract_has_one_line_and_exists(module_name):
    module = _contract(module_name)
    table = {name: entry for section in module._CONTRACT.values() for name, entry in section.items()}
    assert sorted(table) == sorted(module.__all__)
    for name, (behind, line) in table.items():
        assert "\n" not in line and line.endswith(".") and 10 < len(line) <= 110, name
        defining = importlib.import_module(f"lossscale_callbacks.{behind}")
        assert getattr(defining, name) is getattr(module, name)


@pytest.mark.parametrize("module_name", CONTRACTS)
def test_every_name_of_the_contract_is_used_by_an_integration(module_name):
    module = _contract(module_name)
    used = set()
    for path in INTEGRATIONS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == module_name:
                used.update(alias.name for alias in node.names)
    assert sorted(set(module.__all__) - used) == [], "a name nothing uses leaves the contract"


def test_importing_the_contract_loads_nothing_behind_it():
    code = ("import sys, lossscale_callbacks.integration\n"
            "print(sorted(m for m in sys.modules if m.startswith('lossscale_callbacks')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == ("['lossscale_callbacks', 'lossscale_callbacks._extras', "
                                  "'lossscale_callbacks.integration']")


def test_the_page_lists_exactly_the_contract():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    pytest.importorskip("sphinx")
    import lsc_docs

    listed = re.findall(r"```\{lsc-contract\} (\S+)\n```", PAGE.read_text())
    assert listed == list(CONTRACTS)
    for module_name in CONTRACTS:
        names = [name for section in lsc_docs.contract_entries(module_name).values() for name in section]
        assert sorted(names) == sorted(_contract(module_name).__all__)
