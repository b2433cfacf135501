"""The few array operations the update rule needs, and the NumPy reference backend.

The rule in :mod:`lossscale_callbacks._update` is written once against :class:`Ops`; a
framework backend is a handful of one-line methods (``tf.where``/``torch.where`` ...), so
the rule runs inside ``tf.function``/XLA or on a CUDA stream with no host round trip.
Besides these methods the rule uses only ``+``, ``*``, ``>=`` and ``<=`` on the tensors
it is given, which every array library overloads.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Ops(Protocol):
    """Array operations on the backend's scalar tensors. Elementwise; no host reads."""

    def scale(self, value: float) -> Any:
        """A float32 tensor holding ``value`` (rounded to float32)."""

    def count(self, value: int) -> Any:
        """An integer tensor holding ``value`` (the backend's counter dtype)."""

    def as_bool(self, value: Any) -> Any:
        """``value`` (a bool, a bool tensor or a 0/1 number) as a bool tensor."""

    def where(self, condition: Any, x: Any, y: Any) -> Any: ...

    def minimum(self, x: Any, y: Any) -> Any: ...

    def maximum(self, x: Any, y: Any) -> Any: ...

    def logical_and(self, x: Any, y: Any) -> Any: ...

    def logical_not(self, x: Any) -> Any: ...


class NumpyOps:
    """The reference backend: float32 scale, int64 counters, 0-d NumPy arrays.

    Every other backend must reproduce its results bit for bit (see
    :mod:`lossscale_callbacks.testing`). Inputs of any shape broadcast, so many
    independent states can be stepped at once.
    """

    name = "numpy"

    def scale(self, value: float) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)

    def count(self, value: int) -> np.ndarray:
        return np.asarray(value, dtype=np.int64)

    def as_bool(self, value: Any) -> np.ndarray:
        return np.asarray(value).astype(bool)

    def where(self, condition: Any, x: Any, y: Any) -> np.ndarray:
        return np.where(condition, x, y)

    def minimum(self, x: Any, y: Any) -> np.ndarray:
        return np.minimum(x, y)

    def maximum(self, x: Any, y: Any) -> np.ndarray:
        return np.maximum(x, y)

    def logical_and(self, x: Any, y: Any) -> np.ndarray:
        return np.logical_and(x, y)

    def logical_not(self, x: Any) -> np.ndarray:
        return np.logical_not(x)


NUMPY_OPS = NumpyOps()
