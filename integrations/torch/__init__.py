"""PyTorch: ``LossScaler``, a ``torch.amp.GradScaler`` drop-in on the shared loss-scaling core, and
``ScalerReader``, the one reader of a torch run's loss scaler (ours, a stock ``GradScaler``/
``ShardedGradScaler``, DeepSpeed's or Megatron-Core's) that every monitor uses; ``audit_precision``, the
float16 audit of a module before training, and ``keep_in_float32``, which applies its keep list.

Needs only ``torch`` (``pip install "lossscale-callbacks[torch]"``); the Lightning plugins and monitor
live in :mod:`lossscale_callbacks.lightning`. The torch ops, the stock and DeepSpeed scaler readers and
the alignment capture are private modules behind this face.

Example:
    >>> from lossscale_callbacks.torch import LossScaler
    >>> LossScaler(device="cpu").get_scale()  # GradScaler's default initial scale
    65536.0
"""

from lossscale_callbacks.integration import require

require("torch", "torch", feature="lossscale_callbacks.torch")

from lossscale_callbacks.torch._audit import audit_precision, keep_in_float32  # noqa: E402
from lossscale_callbacks.torch._reader import ScalerReader  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

__all__ = ["LossScaler", "ScalerReader", "audit_precision", "keep_in_float32"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
