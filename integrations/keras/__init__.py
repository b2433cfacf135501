"""Keras 3 (TensorFlow backend): a LossScaleOptimizer on the shared core, and LossScaleCallback.

Example:
    >>> from lossscale_callbacks.keras import LossScaleCallback  # doctest: +SKIP
    >>> model.fit(ds, callbacks=[LossScaleCallback(log_every=100, tensorboard="runs/exp1")])  # doctest: +SKIP
"""

from typing import Any

from lossscale_callbacks.keras.callback import LossScaleCallback
from lossscale_callbacks.keras.loss_scale import DynamicLossScale
from lossscale_callbacks.keras.optimizer import LossScaleOptimizer, resolve_policy, wrap
from lossscale_callbacks.keras.tf_ops import TF_OPS, TFOps, all_finite

__all__ = [
    "TF_OPS",
    "DynamicLossScale",
    "LossScaleCallback",
    "LossScaleOptimizer",
    "TFOps",
    "all_finite",
    "check_alignment",
    "resolve_policy",
    "wrap",
]


def __getattr__(name: str) -> Any:
    # The alignment checker traces the model's graph; import it only when asked for.
    if name == "check_alignment":
        from lossscale_callbacks.keras.alignment import check_alignment

        return check_alignment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
