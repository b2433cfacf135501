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

from lossscale_callbacks.integration import MissingExtraError, require

_FEATURE = "lossscale_callbacks.lightning"


def _require_lightning() -> None:
    """torch, and either Lightning namespace; when neither is there, the error names `lightning`."""
    require("torch", "lightning", feature=_FEATURE)
    try:
        require("lightning.pytorch", "lightning", feature=_FEATURE)
    except MissingExtraError as missing:
        try:
            require("pytorch_lightning", "lightning", feature=_FEATURE)
        except MissingExtraError:
            raise missing from None


_require_lightning()

from lossscale_callbacks.lightning._monitor import LossScaleMonitor  # noqa: E402
from lossscale_callbacks.lightning._plugin import LossScaleFSDPPlugin, LossScalePlugin  # noqa: E402

__all__ = ["LossScaleFSDPPlugin", "LossScaleMonitor", "LossScalePlugin"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
