"""The examples in the integrations' docstrings run as written (the core's own test walks only the core
package). Each module is skipped where its framework is not installed."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = {
    "torch": ["lossscale_callbacks.torch", "lossscale_callbacks.torch.ops",
              "lossscale_callbacks.torch.scaler", "lossscale_callbacks.torch.stock",
              "lossscale_callbacks.torch.deepspeed_reader", "lossscale_callbacks.torch.alignment"],
    "lightning": ["lossscale_callbacks.lightning", "lossscale_callbacks.lightning.plugin",
                  "lossscale_callbacks.lightning.monitor", "lossscale_callbacks.lightning.fsdp",
                  "lossscale_callbacks.lightning.fabric", "lossscale_callbacks.lightning.held_schedulers",
                  "lossscale_callbacks.lightning._settings"],
    "accelerate": ["lossscale_callbacks.accelerate", "lossscale_callbacks.accelerate.install",
                   "lossscale_callbacks.accelerate.monitor", "lossscale_callbacks.accelerate.trackers"],
    "transformers": ["lossscale_callbacks.transformers", "lossscale_callbacks.transformers.callback"],
    "tensorflow": ["lossscale_callbacks.keras.alignment", "lossscale_callbacks.keras.optimizer",
                   "lossscale_callbacks.keras.arguments", "lossscale_callbacks.keras.seed_api",
                   "lossscale_callbacks.keras.state_variables", "lossscale_callbacks.keras.backend_steps",
                   "lossscale_callbacks.keras.forensics_wiring", "lossscale_callbacks.keras.fit_sampling",
                   "lossscale_callbacks.keras.config",
                   "lossscale_callbacks.keras.wrapping",
                   "lossscale_callbacks.keras.loss_scale", "lossscale_callbacks.keras.keras_ops",
                   "lossscale_callbacks.keras.tf_ops", "lossscale_callbacks.tensorboard",
                   "lossscale_callbacks.tensorboard.sink", "lossscale_callbacks.wandb.sink"],
}


@pytest.mark.parametrize(("framework", "name"), [(f, n) for f, names in MODULES.items() for n in names])
def test_docstring_examples(framework, name):
    pytest.importorskip(framework)
    module = importlib.import_module(name)
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and attempted > 0
