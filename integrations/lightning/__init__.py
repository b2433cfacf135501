"""PyTorch Lightning: ``LossScalePlugin``, ``LossScaleFSDPPlugin`` and ``LossScaleMonitor``.

Lightning Fabric's plugins and monitor are in :mod:`lossscale_callbacks.lightning.fabric`.
The plugins and the monitor need ``lightning`` or ``pytorch_lightning`` (either namespace, or
both) and are imported on first use. ``LossScaler``, ``TorchOps``, ``StockScalerReader`` and
``check_alignment`` live in :mod:`lossscale_callbacks.torch` (they need only torch) and are
re-exported here.

Example:
    >>> from lossscale_callbacks.lightning import LossScaler
    >>> LossScaler(device="cpu").get_scale()  # GradScaler's default initial scale
    65536.0
"""

from __future__ import annotations

import importlib
from typing import Any

from lossscale_callbacks.torch.ops import TorchOps
from lossscale_callbacks.torch.scaler import LossScaler
from lossscale_callbacks.torch.stock import StockScalerReader

_LAZY = {
    "LossScalePlugin": "lossscale_callbacks.lightning.plugin",
    "LossScaleFSDPPlugin": "lossscale_callbacks.lightning.fsdp",
    "LossScaleMonitor": "lossscale_callbacks.lightning.monitor",
    "check_alignment": "lossscale_callbacks.torch.alignment",
}

__all__ = [
    "LossScaleFSDPPlugin", "LossScaleMonitor", "LossScalePlugin", "LossScaler", "StockScalerReader",
    "TorchOps", "check_alignment",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
