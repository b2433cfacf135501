"""PyTorch: ``LossScaler``, a ``torch.amp.GradScaler`` drop-in on the shared loss-scaling core, and
``ScalerReader``, the one reader of a torch run's loss scaler (ours, a stock ``GradScaler``/
``ShardedGradScaler`` or DeepSpeed's) that every monitor uses; ``audit_precision``, the float16 audit
of a module before training, and ``keep_in_float32``, which applies its keep list.

Needs only ``torch`` (``pip install "lossscale-callbacks[torch]"``); the Lightning plugins and monitor
live in :mod:`lossscale_callbacks.lightning`. The rest is imported from its module: the torch ops
(``lossscale_callbacks.torch.ops``), what the reader uses for a stock ``GradScaler`` (``.stock``) and
for DeepSpeed's scaler (``.deepspeed_reader``), the alignment capture (``.alignment``).

Example:
    >>> from lossscale_callbacks.torch import LossScaler
    >>> LossScaler(device="cpu").get_scale()  # GradScaler's default initial scale
    65536.0
"""

from lossscale_callbacks.extras import require

require("torch", "torch", feature="lossscale_callbacks.torch")

from lossscale_callbacks.torch._audit import audit_precision, keep_in_float32  # noqa: E402
from lossscale_callbacks.torch.reader import ScalerReader  # noqa: E402
from lossscale_callbacks.torch.scaler import LossScaler  # noqa: E402

__all__ = ["LossScaler", "ScalerReader", "audit_precision", "keep_in_float32"]
