"""The examples in the PyTorch/Lightning integration's docstrings run as written (the core's own
test walks only the core package)."""

from __future__ import annotations

import doctest
import importlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

MODULES = ["", ".ops", ".scaler", ".plugin", ".monitor", ".stock"]


@pytest.mark.parametrize("suffix", MODULES)
def test_docstring_examples(suffix):
    module = importlib.import_module("lossscale_callbacks.lightning" + suffix)
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and attempted > 0
