"""Variables read to the host (and some assigned) at a log interval; during JAX's ``fit`` without syncing
every variable of the model.

During an epoch, JAX's ``fit`` keeps the variables' values in the trainer's own state,
``model._jax_state``: lists of arrays in the order of ``model.trainable_variables``,
``model.non_trainable_variables``, ``model.optimizer.variables`` and ``model.metrics_variables``, with
the arrays the next step is given; the variables themselves are purged (a purged variable's ``value``
is its initializer's, not its last one). ``model.jax_state_sync()`` assigns every one of them back
(milliseconds on a small model, more on a large one: an ``assign`` each) and makes the next step
gather them all again.

A reader that needs some of them **lends** the live values to those variables instead
(:meth:`LiveVariables.lent`): each gets the state's array as its value (no copy, no device op). A reader
that only reads leaves the state as it was: the variables are purged again, as ``fit`` keeps them (a
lent array is donated to the next step: a variable that kept it would hold a deleted array). A reader
that assigned one cannot put it back into the state: ``model._jax_state`` is a tracked **copy** of the
lists ``fit`` hands the next step (a Keras model wraps the dicts and lists set on it), so a write there
is lost. Then every variable gets its live array the same way, and the state is marked synced: the next
step gathers the variables again, the assigned one with its new value, exactly as after
``jax_state_sync()`` (which stores the same arrays, an ``assign`` each: 20 to 80 µs a variable). Where
the state is not live (another backend, outside ``fit``, after somebody synced) the variables hold their
values and nothing is lent. Read from Keras 3.15's ``keras/src/backend/jax/trainer.py`` (``fit``,
``jax_state_sync``, ``_get_jax_state``, ``_purge_model_variables``) and
``keras/src/backend/common/variables.py`` (``value``); a trainer that keeps its state otherwise falls
back to the sync.

Per backend, the cheapest way to the host (:func:`host_values`): the ``tf.Variable``'s ``value()`` on
TensorFlow (one read op, 33 µs a variable here; ``np.asarray`` of the variable copies it in an identity
op first, 108 µs), ``np.asarray`` of the array on JAX, Keras' own conversion on torch (a
parameter that requires grad). :meth:`LiveVariables.zero` assigns one zeros
tensor per shape, made once, on TensorFlow and torch (the assign copies it: a third of assigning a
NumPy array on TensorFlow); on JAX a fresh array each time (its train function donates the state's
buffers, so no two slots may share one), a NumPy array for a lent variable (the next step's call moves
it to the device with its arguments).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

__all__ = ["LiveVariables", "host_values"]

# ``model._jax_state``'s lists, each with the model's list of variables it holds the values of.
_GROUPS = (
    ("trainable_variables", lambda m: m.trainable_variables),
    ("non_trainable_variables", lambda m: m.non_trainable_variables),
    ("optimizer_variables", lambda m: m.optimizer.variables if getattr(m, "optimizer", None) else []),
    ("metrics_variables", lambda m: m.metrics_variables),
)


def host_values(variables: Sequence[Any]) -> list[np.ndarray]:
    """The variables' values on the host, as float64 arrays (one copy each: joining them on the device
    first, in one compiled TensorFlow function, was measured no faster)."""
    backend = keras.backend.backend()
    if backend == "torch":
        return [np.asarray(keras.ops.convert_to_numpy(v.value), "float64") for v in variables]
    if backend == "tensorflow":
        # The tf.Variable's value(): one read op. np.asarray of the variable reads it and copies it in an
        # identity op first: 108 against 33 µs a variable here.
        return [np.asarray(_tf_read(v.value), "float64") for v in variables]
    return [np.asarray(v.value, "float64") for v in variables]


def _tf_read(value: Any) -> Any:
    read = getattr(value, "value", None)
    return read() if callable(read) else value


class LiveVariables:
    """The variables of one model, lent JAX's live ``fit`` state while a reader reads them.

    Example:
        >>> live = LiveVariables()
        >>> with live.lent(None):  # no model: the variables themselves are read
        ...     pass
    """

    def __init__(self) -> None:
        # Per group of the state: the model's variables (as indexed) and their index by identity.
        self._indexed: dict[str, tuple[list[Any], dict[int, int]]] = {}
        self._zeros: dict[tuple[tuple[int, ...], str], Any] = {}
        self._groups: list[tuple[list[Any], tuple[list[Any], dict[int, int]]]] = []
        self._lent: set[int] = set()  # the variables lent now

    def forget(self) -> None:
        """The model's variables may have changed (a new ``fit``): index them again at the next read."""
        self._indexed = {}

    @contextlib.contextmanager
    def lent(self, model: Any, variables: Sequence[Any] | None = None) -> Iterator[bool]:
        """Within the block, ``variables`` (``None``: every variable of the model) hold their current
        values, and what is assigned to them lasts; yields whether the live state was lent.

        Raises:
            Whatever the block raises (the state is made whole first).
        """
        slots = self._slots(model, variables)
        if slots is None:
            yield False
            return
        lent = []
        for values, at, variable in slots:
            array = values[at]
            variable._value = array  # the state's own array: what jax_state_sync's assign would store
            lent.append(array)
        self._lent = {id(variable) for _, _, variable in slots}
        try:
            yield True
        finally:
            self._lent = set()
            assigned = {id(variable) for (_, _, variable), array in zip(slots, lent, strict=True)
                        if variable._value is not array}
            if assigned:
                self._hand_back(model, assigned)  # the next step must gather the variables again
            else:
                for _, _, variable in slots:
                    variable._value = None  # purged again, as fit keeps it
            # Nothing of this step's state is kept: fit frees it when the next step replaces it, as it
            # does without a reader (kept to the next read, its arrays were freed here, ~50 µs a read).
            self._groups = []

    def _hand_back(self, model: Any, assigned: set[int]) -> None:
        """Every variable but those ``assigned`` gets its live array, and the state counts as synced (see
        the module)."""
        for values, (own, _) in self._groups:
            for variable, array in zip(own, values, strict=True):
                if id(variable) not in assigned:
                    variable._value = array
        model._jax_state_synced = True

    def _slots(self, model: Any, variables: Sequence[Any] | None) -> list[tuple[list[Any], int, Any]] | None:
        """``(state list, index, variable)`` of each variable to lend, or ``None`` where nothing is lent
        (the model was synced first where its state is live but not as this module reads it)."""
        if model is None or keras.backend.backend() != "jax":
            return None
        state, synced = getattr(model, "_jax_state", None), getattr(model, "_jax_state_synced", None)
        if synced is True:  # outside fit, or synced by somebody: the variables hold their values
            return None
        if synced is not False or not isinstance(state, dict):  # a trainer not as this module reads it
            return self._sync(model)
        groups = []
        for name, listed in _GROUPS:
            values = state.get(name)
            if values is None:
                continue
            indexed = self._indexed.get(name)
            if indexed is None or len(indexed[0]) != len(values):
                own = list(listed(model))
                indexed = self._indexed[name] = (own, {id(v): i for i, v in enumerate(own)})
            if not isinstance(values, list) or len(indexed[0]) != len(values):
                return self._sync(model)
            groups.append((values, indexed))
        self._groups = groups
        if variables is None:
            slots = [(values, at, v) for values, (own, _) in groups for at, v in enumerate(own)]
        else:
            slots = []  # a variable in no list of the state is not purged: its own value is current
            for variable in variables:
                for values, (_, index) in groups:
                    at = index.get(id(variable))
                    if at is not None:
                        slots.append((values, at, variable))
                        break
        if not all(hasattr(v, "_value") for _, _, v in slots):
            return self._sync(model)
        return slots

    @staticmethod
    def _sync(model: Any) -> None:
        sync = getattr(model, "jax_state_sync", None)
        if callable(sync):
            sync()
        return None

    def zero(self, variable: Any) -> None:
        """Set ``variable`` to zeros (within :meth:`lent` during JAX's ``fit``): a fresh array each time on
        JAX (see the module docstring), one kept zeros tensor on TensorFlow and torch.

        A variable lent during JAX's ``fit`` gets a NumPy array: the next step gathers it with the others
        and its jitted call moves it to the device with its arguments. Made a JAX array here, each cost
        about 225 µs of a read during ``fit`` (a device transfer of its own), 0.68 ms of 2.4 for three."""
        shape, dtype = tuple(variable.shape), str(variable.dtype)
        if keras.backend.backend() == "jax":
            if id(variable) in self._lent:
                variable._value = np.zeros(shape, dtype)  # a new host array: counts as assigned (the module)
            else:
                variable.assign(np.zeros(shape, dtype))
            return
        key = (shape, dtype)
        if key not in self._zeros:
            self._zeros[key] = keras.ops.zeros(shape, dtype)
        variable.assign(self._zeros[key])
