"""Keras 3 on any backend (TensorFlow, JAX, torch): ``LossScaleCallback`` and ``LossScaleOptimizer`` on the
shared core, ``DynamicLossScale`` (the ``tf.train.experimental`` seed API, TensorFlow only), and the
precision audit: ``audit_keras_precision`` (does float16 fit, what to keep in float32, where to start) and
``keep_keras_layers_in_float32``, which applies its keep list.

TensorFlow is imported only on the TensorFlow backend, or when ``DynamicLossScale`` is asked for. The
ops, the optimizer wrapping and the alignment capture are private modules behind this face.

Example:
    >>> from lossscale_callbacks.keras import LossScaleCallback  # doctest: +SKIP
    >>> model.fit(ds, callbacks=[LossScaleCallback(log_every=100, tensorboard="runs/exp1")])  # doctest: +SKIP
"""

import importlib
from typing import Any

from lossscale_callbacks.integration import MissingExtraError, require

_BACKENDS = ("Keras 3 runs on a backend you install yourself: tensorflow (or tensorflow-cpu), jax or torch; "
             "choose it with the KERAS_BACKEND environment variable (tensorflow, jax or torch; Keras' "
             "default is tensorflow)")
_NEEDS_TENSORFLOW = ("DynamicLossScale is TensorFlow's tf.train.experimental API and needs tensorflow "
                     "(pip install tensorflow, or tensorflow-cpu), which is not installed")
_WITHOUT_TENSORFLOW = "LossScaleOptimizer and LossScaleCallback run on every Keras backend without it"
# The backends' packages, by the name an import error gives (jax needs jaxlib too).
_BACKEND_PACKAGES = {"tensorflow": "tensorflow", "jax": "jax", "jaxlib": "jax", "torch": "torch"}


def _require_keras() -> None:
    """Keras, and the backend it was told to use; each missing one said as such."""
    try:
        require("keras", "keras", feature="lossscale_callbacks.keras", hint=_BACKENDS)
    except MissingExtraError as exc:
        backend = _BACKEND_PACKAGES.get((exc.name or "").split(".")[0])
        if backend is None:
            raise
        cause = exc.__cause__
        raise ImportError(f"lossscale_callbacks.keras: Keras is installed, but its backend {backend!r} is "
                          f"not ({cause}). {_BACKENDS}.", name=exc.name) from cause


_require_keras()

from lossscale_callbacks.keras._audit import audit_keras_precision, keep_keras_layers_in_float32  # noqa: E402
from lossscale_callbacks.keras._callback import LossScaleCallback  # noqa: E402
from lossscale_callbacks.keras._optimizer import LossScaleOptimizer  # noqa: E402

__all__ = ["DynamicLossScale", "LossScaleCallback", "LossScaleOptimizer", "audit_keras_precision",
           "keep_keras_layers_in_float32"]


def __getattr__(name: str) -> Any:
    if name == "DynamicLossScale":
        # The seed's TensorFlow API: TensorFlow is imported only when it is asked for.
        try:
            return importlib.import_module("lossscale_callbacks.keras._loss_scale").DynamicLossScale
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "tensorflow":
                raise
            raise ImportError(f"{_NEEDS_TENSORFLOW} ({exc}); {_WITHOUT_TENSORFLOW}", name=exc.name) from exc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
