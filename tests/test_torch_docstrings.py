"""The examples in the PyTorch/Lightning integration's docstrings run as written (the core's own
test walks only the core package)."""

from __future__ import annotations

import doctest
import importlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

MODULES = ["lossscale_callbacks.torch", "lossscale_callbacks.torch.ops", "lossscale_callbacks.torch.scaler",
           "lossscale_callbacks.torch.stock", "lossscale_callbacks.lightning",
           "lossscale_callbacks.torch.deepspeed_reader", "lossscale_callbacks.lightning.plugin",
           "lossscale_callbacks.lightning.monitor", "lossscale_callbacks.lightning.fsdp",
           "lossscale_callbacks.lightning.fabric", "lossscale_callbacks.torch.alignment"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and attempted > 0
