"""The loss-scale state of the Keras ``LossScaleOptimizer`` in variables: layout, one host read, loading.

Layout. Keras' own ``keras.optimizers.LossScaleOptimizer`` saves ``[iteration, learning_rate,
step_counter, dynamic_scale]`` and then its inner optimizer's variables under ``optimizer/vars`` in
``model.weights.h5``, and refuses (skips, with a warning) a list of any other length. Ours keeps the
same list: our growth counter *is* Keras' ``step_counter`` (finite steps since the last change) and our
scale its ``dynamic_scale``, so Keras' class can load a file written by ours. The three values Keras
has no slot for (hysteresis left, skipped steps, steps) live in :class:`LossScaleCounters`, saved
beside it under ``optimizer/loss_scale_counters``, which Keras' class never reads.

Counters are int64, int32 on JAX without x64 (see
:func:`~lossscale_callbacks.keras._keras_ops.counter_dtype`); the scale is float32. Every variable is
``aggregation="only_first_replica"``: every replica computes the same new state (the finite flag
is all-reduced first), so any replica's value is the right one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks import LossScaleState, next_state
from lossscale_callbacks.integration import Policy, validate_state
from lossscale_callbacks.keras._keras_ops import counter_dtype


class LossScaleCounters(keras.layers.Layer):
    """The three counters Keras' own ``LossScaleOptimizer`` has no variable for; never called.

    A layer only because Keras' saving stores a layer's variables under a path of their own
    (``optimizer/loss_scale_counters``) and a layer is tracked by ``tf.train.Checkpoint``; the
    optimizer's own list must hold exactly what Keras' class reads (see the module docstring).

    Args:
        dtype: the counters' dtype.
        hysteresis: the policy's hysteresis, the starting value of ``hysteresis_left``.
        on_load: called with the saved values of the three counters when Keras loads them.
    """

    def __init__(self, dtype: str, hysteresis: int, on_load: Callable[[list[np.ndarray]], None]) -> None:
        super().__init__(name="loss_scale_counters", trainable=False)
        self.hysteresis_left = self._counter("hysteresis_left", dtype, hysteresis)
        self.skipped_steps = self._counter("skipped_steps", dtype, 0)
        self.steps = self._counter("steps", dtype, 0)
        self.built = True
        self._on_load = on_load

    def _counter(self, name: str, dtype: str, value: int) -> keras.Variable:
        return self.add_weight(shape=(), dtype=dtype, initializer=keras.initializers.Constant(value),
                               trainable=False, aggregation="only_first_replica", name=name)

    def load_own_variables(self, store: Any) -> None:
        """Hand the saved counters to the optimizer's loading (see :meth:`LossScaleVariables.stage`)."""
        self._on_load([np.asarray(store[str(i)]) for i in range(len(store.keys()))])


class LossScaleVariables:
    """The five state variables of one optimizer, and everything that reads or writes them whole.

    Args:
        optimizer: the optimizer that owns the scale and the growth counter (created with its
            ``add_variable``, right after its iteration and learning rate: Keras' layout).
        policy: the policy the state runs under (checked on every load).
        pack: the backend's way to stack a state of tensors into one integer vector, the float32
            scale as its bits first (the backend step's ``pack_state``).

    Example:
        >>> from lossscale_callbacks.keras._optimizer import LossScaleOptimizer
        >>> from lossscale_callbacks._policy import DynamicPolicy
        >>> policy = DynamicPolicy(initial_scale=8.0, hysteresis=2)
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=policy)
        >>> opt.loss_scale_variables.read()
        LossScaleState(scale=np.float32(8.0), growth_counter=np.int64(0), hysteresis_left=np.int64(2), \
skipped_steps=np.int64(0), steps=np.int64(0))
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, policy: Policy,
                 pack: Callable[[LossScaleState], Any]) -> None:
        dtype = counter_dtype()
        self.policy = policy
        self._pack = pack
        # Keras' order: step_counter, then dynamic_scale.
        self.growth_counter = optimizer.add_variable(
            shape=(), dtype=dtype, initializer=keras.initializers.Constant(0),
            aggregation="only_first_replica", name="growth_counter")
        self.scale = optimizer.add_variable(
            shape=(), dtype="float32", initializer=keras.initializers.Constant(policy.initial_scale),
            aggregation="only_first_replica", name="loss_scale")
        self.counters = LossScaleCounters(dtype, policy.constants.hysteresis, self._finish_load)
        self._staged: tuple[list[Any], list[np.ndarray]] | None = None
        # Called with (steps, skipped_steps) after a state is assigned whole (the outcome ring's restart).
        self.on_assign: Callable[[int, int], None] | None = None

    @property
    def fields(self) -> LossScaleState:
        """The five variables, as a :class:`LossScaleState`."""
        c = self.counters
        return LossScaleState(self.scale, self.growth_counter, c.hysteresis_left, c.skipped_steps, c.steps)

    def values(self) -> LossScaleState:
        """The current values as tensors on the device (no host read)."""
        return LossScaleState(*(v.value for v in self.fields))

    def read(self) -> LossScaleState:
        """The whole state copied to the host in **one** transfer: numpy scalars (float32 scale, int64
        counters).

        The scale's float32 bits ride along with the counters (a bitcast to int32, exact both ways), so
        the five values are one stacked tensor on the device and one copy to the host.
        """
        host = np.asarray(ops.convert_to_numpy(self._pack(self.values()))).astype(np.int64)
        return _unpacked(host)

    def read_with(self, extra: Sequence[Any]) -> tuple[LossScaleState, np.ndarray]:
        """:meth:`read` and ``extra`` (integer tensors of the counters' dtype) in the **same** transfer: the
        state and the extra values as host int64."""
        packed = ops.concatenate([self._pack(self.values()), *extra])
        host = np.asarray(ops.convert_to_numpy(packed)).astype(np.int64)
        return _unpacked(host[:5]), host[5:]

    def assign(self, state: LossScaleState) -> None:
        """Write a state that :func:`~lossscale_callbacks._validation.validate_state` returned."""
        for value, var in zip(state, self.fields, strict=True):
            var.assign(ops.cast(value, var.dtype))
        if self.on_assign is not None:
            self.on_assign(int(state.steps), int(state.skipped_steps))

    def advance(self, finite: Any, rule_ops: Any) -> None:
        """One step of the core's rule on the device: no growth/backoff logic lives here, no host read."""
        new = next_state(self.policy, self.values(), finite, rule_ops)
        for var, value in zip(self.fields, new, strict=True):
            var.assign(value)

    # ---- loading a saved model (model.weights.h5) ----

    def stage(self, store: Any, layout: Sequence[Any], owner: str) -> None:
        """Keep the optimizer's saved list (``layout``'s values) until the counters arrive; assign nothing.

        Keras loads the optimizer's own list first and :class:`LossScaleCounters` next; the state is
        checked whole, then assigned whole, when the counters arrive. A list of another length is
        skipped with Keras' own warning (an unbuilt optimizer, another optimizer's file).
        """
        self._staged = None
        if len(store.keys()) != len(layout):
            warnings.warn(f"Skipping variable loading for optimizer '{owner}', because it has {len(layout)} "
                          f"variables whereas the saved optimizer has {len(store.keys())} variables. If the "
                          "optimizer has not been built yet, build it first "
                          "(optimizer.build(model.trainable_variables)).", stacklevel=3)
            return
        self._staged = (list(layout), [np.asarray(store[str(i)]) for i in range(len(layout))])

    def _finish_load(self, counters: list[np.ndarray]) -> None:
        staged, self._staged = self._staged, None
        if staged is None:
            return  # the optimizer's own list was skipped: keep the state as it is
        layout, saved = staged
        if len(counters) != 3:
            raise ValueError(
                f"the saved optimizer holds {len(counters)} loss-scale counters "
                "(optimizer/loss_scale_counters), expected 3 (hysteresis_left, skipped_steps, steps): a file "
                "saved by Keras' own LossScaleOptimizer loads into that class (LossScaleCallback then "
                "carries its scale over)")
        by_variable = {id(var): value for var, value in zip(layout, saved, strict=True)}
        state = validate_state(self.policy, {
            "scale": by_variable[id(self.scale)], "growth_counter": by_variable[id(self.growth_counter)],
            "hysteresis_left": counters[0], "skipped_steps": counters[1], "steps": counters[2],
        }, source="the saved optimizer state (model.weights.h5)")
        for var, value in zip(layout, saved, strict=True):
            if var is not self.scale and var is not self.growth_counter:
                var.assign(value)
        self.assign(state)


def _unpacked(host: np.ndarray) -> LossScaleState:
    """The state from its packed host values: the float32 scale's bits, then the four counters."""
    scale = host[:1].astype(np.int32).view(np.float32)[0]
    return LossScaleState(scale, *host[1:5])
