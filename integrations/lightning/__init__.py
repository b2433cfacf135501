"""PyTorch and Lightning integration: ``LossScaler``, ``LossScalePlugin`` and ``LossScaleMonitor``.

``LossScaler`` and ``TorchOps`` need only torch; the plugin and the monitor need ``lightning`` or
``pytorch_lightning`` (either namespace, or both) and are imported on first use.

Example:
    >>> from lossscale_callbacks.lightning import LossScaler
    >>> LossScaler(device="cpu").get_scale()
    32768.0
"""

from __future__ import annotations

import importlib
from typing import Any

from lossscale_callbacks.lightning.ops import TorchOps
from lossscale_callbacks.lightning.scaler import LossScaler

_LAZY = {
    "LossScalePlugin": "lossscale_callbacks.lightning.plugin",
    "LossScaleMonitor": "lossscale_callbacks.lightning.monitor",
    "StockScalerReader": "lossscale_callbacks.lightning.stock",
    "check_alignment": "lossscale_callbacks.lightning.alignment",
}

__all__ = [
    "LossScaleMonitor", "LossScalePlugin", "LossScaler", "StockScalerReader", "TorchOps", "check_alignment",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
