"""Load the repository's example and benchmark scripts as modules, for tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """Import ``ROOT/relative_path`` (e.g. ``"examples/plain_loop_sinks.py"``) under its file stem.

    As when Python runs the script, its own folder comes first on ``sys.path`` while it loads, so its
    imports of sibling modules (``benchmarks/_quick.py``) resolve; and as an import does, the module is
    registered in ``sys.modules`` (dataclasses with postponed annotations look their module up there).
    """
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
