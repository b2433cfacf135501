"""Hugging Face Accelerate: our loss scaler in an ``Accelerator``, and the scale of the loop on its trackers.

``install_loss_scaler(accelerator, policy=...)`` after ``Accelerator(mixed_precision="fp16")`` and
before ``accelerator.prepare`` (fp16 on the CPU too); ``AccelerateLossScaleMonitor(accelerator)``
after ``prepare``, and ``monitor.step()`` after each ``optimizer.step()``. Needs
``pip install "lossscale-callbacks[accelerate]"``.

Example:
    >>> from accelerate import Accelerator
    >>> from lossscale_callbacks.accelerate import install_loss_scaler
    >>> accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    >>> install_loss_scaler(accelerator).get_scale()  # GradScaler's default initial scale
    65536.0
"""

from __future__ import annotations

from lossscale_callbacks.integration import require

require("accelerate", "accelerate", feature="lossscale_callbacks.accelerate")

from lossscale_callbacks.accelerate._install import install_loss_scaler  # noqa: E402
from lossscale_callbacks.accelerate._monitor import AccelerateLossScaleMonitor  # noqa: E402

__all__ = ["AccelerateLossScaleMonitor", "install_loss_scaler"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
