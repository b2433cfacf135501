"""Keras 3 on any backend (TensorFlow, JAX, torch): ``LossScaleCallback`` and ``LossScaleOptimizer`` on the
shared core, and ``DynamicLossScale`` (the ``tf.train.experimental`` seed API, TensorFlow only).

TensorFlow is imported only on the TensorFlow backend, or when ``DynamicLossScale`` is asked for. The
rest is imported from its module: ``wrap`` and ``resolve_policy`` (``lossscale_callbacks.keras.optimizer``),
the ops (``.keras_ops``, ``.tf_ops``), the alignment capture (``.alignment``).

Example:
    >>> from lossscale_callbacks.keras import LossScaleCallback  # doctest: +SKIP
    >>> model.fit(ds, callbacks=[LossScaleCallback(log_every=100, tensorboard="runs/exp1")])  # doctest: +SKIP
"""

import importlib
from typing import Any

from lossscale_callbacks.keras.callback import LossScaleCallback
from lossscale_callbacks.keras.optimizer import LossScaleOptimizer

__all__ = ["DynamicLossScale", "LossScaleCallback", "LossScaleOptimizer"]


def __getattr__(name: str) -> Any:
    if name == "DynamicLossScale":
        # The seed's TensorFlow API: TensorFlow is imported only when it is asked for.
        return importlib.import_module("lossscale_callbacks.keras.loss_scale").DynamicLossScale
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
