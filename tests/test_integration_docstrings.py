"""The examples in the integrations' docstrings run as written (the core's own test walks only the core
package). Each module is skipped where its framework is not installed."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "integrations"
# The package a folder's examples need, where it is not the folder's own name.
NEEDS = {"keras": "tensorflow"}


def _runs(text: str) -> bool:
    """Whether ``text`` holds a docstring example that doctest runs (one not marked ``+SKIP``)."""
    examples: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>> "):
            examples.append(stripped)
        elif stripped.startswith("... ") and examples:
            examples[-1] += stripped  # a directive on any line of an example applies to all of it
    return any("+SKIP" not in example for example in examples)


def _modules_with_examples() -> list[tuple[str, str]]:
    """Every integration module with an example that runs, found on disk: none is left out."""
    found = []
    for path in sorted(ROOT.glob("*/*.py")):
        if _runs(path.read_text()):
            name = path.stem if path.stem != "__init__" else ""
            module = ".".join(filter(None, ["lossscale_callbacks", path.parent.name, name]))
            found.append((NEEDS.get(path.parent.name, path.parent.name), module))
    return found


@pytest.mark.parametrize(("framework", "name"), _modules_with_examples())
def test_docstring_examples(framework, name):
    pytest.importorskip(framework)
    module = importlib.import_module(name)
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and attempted > 0
