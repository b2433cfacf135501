"""Hugging Face Transformers: the loss scale of a ``Trainer`` in the logs of its ``report_to`` integrations.

``LossScaleTrainerCallback(...).attach(trainer)`` before ``trainer.train()``; with ``policy=`` or
``diagnose=True`` it also installs our scaler (and makes ``fp16=True`` real on the CPU). Needs
``pip install "lossscale-callbacks[transformers]"``.

Example:
    >>> from lossscale_callbacks.transformers import LossScaleTrainerCallback
    >>> LossScaleTrainerCallback(log_every=50).installs
    False
"""

from __future__ import annotations

from lossscale_callbacks.integration import require

require("transformers", "transformers", feature="lossscale_callbacks.transformers")
require("accelerate", "transformers", feature="lossscale_callbacks.transformers")  # the Trainer runs on it

from lossscale_callbacks.transformers._callback import LossScaleTrainerCallback  # noqa: E402

__all__ = ["LossScaleTrainerCallback"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
