"""PyTorch: ``LossScaler`` (a ``torch.amp.GradScaler`` on the core), torch ops, stock scalers, alignment.

Everything here needs only ``torch`` (``pip install lossscale-callbacks[torch]``); the Lightning
plugin and monitor live in :mod:`lossscale_callbacks.lightning`, which re-exports ``LossScaler``.

Example:
    >>> from lossscale_callbacks.torch import LossScaler
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
    # The alignment checker imports torch's dispatch machinery; only when asked for.
    "check_alignment": "lossscale_callbacks.torch.alignment",
    "DeepSpeedScalerReader": "lossscale_callbacks.torch.deepspeed_reader",
}

__all__ = ["DeepSpeedScalerReader", "LossScaler", "StockScalerReader", "TorchOps", "check_alignment"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
