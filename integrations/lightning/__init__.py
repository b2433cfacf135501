"""PyTorch Lightning: ``LossScalePlugin``, ``LossScaleFSDPPlugin`` and ``LossScaleMonitor``.

Needs ``lightning`` or ``pytorch_lightning`` (either namespace, or both; ``pip install
"lossscale-callbacks[lightning]"``). Lightning Fabric's plugins and monitor are in
:mod:`lossscale_callbacks.lightning.fabric`; the scaler itself, ``LossScaler``, in
:mod:`lossscale_callbacks.torch` (it needs only torch).

Example:
    >>> from lossscale_callbacks.lightning import LossScalePlugin
    >>> LossScalePlugin(device="cpu").scaler.get_scale()  # GradScaler's default initial scale
    65536.0
"""

from lossscale_callbacks.lightning.fsdp import LossScaleFSDPPlugin
from lossscale_callbacks.lightning.monitor import LossScaleMonitor
from lossscale_callbacks.lightning.plugin import LossScalePlugin

__all__ = ["LossScaleFSDPPlugin", "LossScaleMonitor", "LossScalePlugin"]
