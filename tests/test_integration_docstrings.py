"""The examples in the Keras, TensorBoard and W&B integrations' docstrings run as written (the core's and
the torch integration's have their own tests)."""

from __future__ import annotations

import doctest
import importlib

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

MODULES = ["lossscale_callbacks.keras.alignment", "lossscale_callbacks.keras.optimizer",
           "lossscale_callbacks.keras.loss_scale", "lossscale_callbacks.keras.keras_ops",
           "lossscale_callbacks.keras.tf_ops", "lossscale_callbacks.tensorboard",
           "lossscale_callbacks.tensorboard.sink", "lossscale_callbacks.wandb.sink"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and attempted > 0
