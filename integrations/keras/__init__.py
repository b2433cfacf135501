"""Keras 3 on any backend (TensorFlow, JAX, torch): LossScaleOptimizer on the shared core, LossScaleCallback.

TensorFlow is imported only on the TensorFlow backend, or when one of its pieces is asked for:
``DynamicLossScale`` (the ``tf.train.experimental`` seed API), ``TFOps``/``TF_OPS`` and the
alignment checker (``check_alignment``) need it.

Example:
    >>> from lossscale_callbacks.keras import LossScaleCallback  # doctest: +SKIP
    >>> model.fit(ds, callbacks=[LossScaleCallback(log_every=100, tensorboard="runs/exp1")])  # doctest: +SKIP
"""

import importlib
from typing import Any

from lossscale_callbacks.keras.arguments import resolve_policy
from lossscale_callbacks.keras.callback import LossScaleCallback
from lossscale_callbacks.keras.keras_ops import KERAS_OPS, KerasOps
from lossscale_callbacks.keras.optimizer import LossScaleOptimizer
from lossscale_callbacks.keras.wrapping import wrap

__all__ = [
    "KERAS_OPS",
    "TF_OPS",
    "DynamicLossScale",
    "KerasOps",
    "LossScaleCallback",
    "LossScaleOptimizer",
    "TFOps",
    "all_finite",
    "check_alignment",
    "resolve_policy",
    "wrap",
]

_LAZY = {
    "DynamicLossScale": "lossscale_callbacks.keras.loss_scale",
    "TF_OPS": "lossscale_callbacks.keras.tf_ops",
    "TFOps": "lossscale_callbacks.keras.tf_ops",
    # The alignment checker traces the model's graph; imported only when asked for.
    "check_alignment": "lossscale_callbacks.keras.alignment",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "all_finite":
        # The backend's: TensorFlow's also reads tf.IndexedSlices.
        import keras

        module = "tf_ops" if keras.backend.backend() == "tensorflow" else "keras_ops"
        return importlib.import_module(f"lossscale_callbacks.keras.{module}").all_finite
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
