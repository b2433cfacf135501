"""Variables read to the host (and one zeroed) cheaply; during JAX's ``fit`` without syncing every variable.

Per backend, the cheapest way to the host: ``np.asarray`` of the backend value on TensorFlow and JAX (a
third of ``keras.ops.convert_to_numpy``'s time on TensorFlow), Keras' own conversion on torch (a
parameter that requires grad). Zeroing assigns one zeros tensor per shape, made once, on TensorFlow and
torch (the assign copies it: a third of assigning a NumPy array on TensorFlow); JAX gets a fresh one
each time (below).

During an epoch, JAX's ``fit`` keeps the variables' values in the trainer's own state,
``model._jax_state``: lists of arrays in the order of ``model.trainable_variables``,
``model.non_trainable_variables``, ``model.optimizer.variables`` and ``model.metrics_variables``, the
very lists the next step is given; the variables themselves are purged. ``model.jax_state_sync()``
assigns every one of them back (milliseconds on a small model, more on a large one) and makes the
next step gather them all again. A reader that needs a handful of trainable variables takes their
values from that state instead, and replaces one there when it must (a tally it starts again from
zero). Where the state is not live (another backend, outside ``fit``, after somebody synced) it
syncs and reads the variables, as before. Read from Keras 3.15's ``keras/src/backend/jax/trainer.py``
(``fit``, ``jax_state_sync``); a trainer that keeps its state otherwise falls back to the sync.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

__all__ = ["LiveVariables"]


class LiveVariables:
    """Trainable variables of one model, read from JAX's live ``fit`` state when there is one.

    Example:
        >>> live = LiveVariables()
        >>> live.open(None)  # no model: the variables themselves are read
        False
    """

    def __init__(self) -> None:
        self._values: list[Any] | None = None
        self._index: dict[int, int] = {}
        self._indexed: list[Any] | None = None
        self._zeros: dict[tuple[tuple[int, ...], str], Any] = {}

    def open(self, model: Any) -> bool:
        """Before a read: whether the live state is used (else ``model`` was synced, if it needed it)."""
        self._values = None
        if model is None or keras.backend.backend() != "jax":
            return False
        state = getattr(model, "_jax_state", None)
        values = state.get("trainable_variables") if isinstance(state, dict) else None
        if isinstance(values, list) and not getattr(model, "_jax_state_synced", True):
            if self._indexed is None or len(self._indexed) != len(values):
                self._indexed = list(model.trainable_variables)
                self._index = {id(v): i for i, v in enumerate(self._indexed)}
            if len(self._indexed) == len(values):
                self._values = values
                return True
        sync = getattr(model, "jax_state_sync", None)
        if callable(sync):
            sync()
        return False

    def forget(self) -> None:
        """The model's variables may have changed (a new ``fit``): index them again at the next read."""
        self._indexed, self._index, self._values = None, {}, None

    def value(self, variable: Any) -> Any:
        """``variable``'s current value (an array)."""
        at = self._index.get(id(variable)) if self._values is not None else None
        return variable.value if at is None else self._values[at]  # type: ignore[index]

    def numpy(self, variables: list[Any]) -> list[np.ndarray]:
        """The variables' current values on the host, as float64 arrays (one copy each: joining them on
        the device first, in one compiled TensorFlow function, was measured no faster)."""
        values = [self.value(v) for v in variables]
        if keras.backend.backend() == "torch":
            return [np.asarray(keras.ops.convert_to_numpy(v), "float64") for v in values]
        return [np.asarray(v, "float64") for v in values]

    def zero(self, variable: Any) -> None:
        """Set ``variable`` to zeros: in the live state, which the next step uses (a fresh array each
        time: JAX's train function donates its state's buffers, so no two slots may share one, and one
        kept from an earlier step would be gone), or the variable itself."""
        at = self._index.get(id(variable)) if self._values is not None else None
        shape, dtype = tuple(variable.shape), str(variable.dtype)
        if at is not None:
            import jax.numpy as jnp  # the live state is JAX's

            self._values[at] = jnp.asarray(np.zeros(shape, dtype))  # type: ignore[index]  # a new buffer
        elif keras.backend.backend() == "jax":
            variable.assign(np.zeros(shape, dtype))  # a fresh array (see above)
        else:
            key = (shape, dtype)
            if key not in self._zeros:
                self._zeros[key] = keras.ops.zeros(shape, dtype)
            variable.assign(self._zeros[key])

