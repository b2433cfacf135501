"""The seed's ``tf.train.experimental.DynamicLossScale``, on the shared core."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from lossscale_callbacks import DynamicPolicy, LossScaleState, initial_state, next_state
from lossscale_callbacks.integration import check_int, check_number
from lossscale_callbacks.keras._tf_ops import TF_OPS, all_finite, replicas_agree_finite


class DynamicLossScale(tf.Module):
    """A loss scale that grows after ``increment_period`` finite steps and shrinks on overflow.

    The TensorFlow 1.x/2.x API users know (``tf.train.experimental.DynamicLossScale``),
    backed by the core's ``next_state`` with ``growth_factor = multiplier`` and
    ``backoff_factor = 1 / multiplier``. Unlike TensorFlow's, the scale is bounded by the
    core policy's defaults: it never goes below 1 nor above ``2**24``. The state lives in
    ``tf.Variable`` s, so ``tf.train.Checkpoint`` saves it (``DynamicLossScale`` is a
    ``tf.Module``).

    Args:
        initial_loss_scale: the scale to start from (default ``2**15``).
        increment_period: consecutive finite steps before the scale grows (default 2000).
        multiplier: the growth factor; overflow divides by it (default 2.0).

    Raises:
        ValueError: an argument outside its range, named with the range allowed.

    Example:
        >>> loss_scale = DynamicLossScale(initial_loss_scale=1024.0, increment_period=2)
        >>> _, should_apply = loss_scale.update([tf.constant(float("inf"))])
        >>> bool(should_apply), float(loss_scale())
        (False, 512.0)
    """

    def __init__(self, initial_loss_scale: float = 2.0**15, increment_period: int = 2000,
                 multiplier: float = 2.0) -> None:
        super().__init__(name="dynamic_loss_scale")
        # Checked here so the errors name the seed's arguments, not the policy's fields.
        multiplier = check_number("multiplier", multiplier, 1.0, 2.0**16, low_open=True)
        increment_period = check_int("increment_period", increment_period, 1, 2**31 - 1)
        initial_loss_scale = check_number("initial_loss_scale", initial_loss_scale, 1.0, 2.0**24)
        self._initial_loss_scale = initial_loss_scale
        self._increment_period = increment_period
        self._multiplier = multiplier
        self._policy = DynamicPolicy(initial_scale=initial_loss_scale, growth_interval=increment_period,
                                     growth_factor=multiplier, backoff_factor=1.0 / multiplier)
        start = initial_state(self._policy, TF_OPS)
        # ON_READ/ONLY_FIRST_REPLICA is not needed: update() reduces the finite flag, so
        # every replica writes the same value.
        self._variables = LossScaleState(*(
            tf.Variable(value, trainable=False, name=name,
                        synchronization=tf.VariableSynchronization.ON_WRITE,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for name, value in zip(LossScaleState._fields, start, strict=False)
        ))

    @property
    def initial_loss_scale(self) -> float:
        return self._initial_loss_scale

    @property
    def increment_period(self) -> int:
        return self._increment_period

    @property
    def multiplier(self) -> float:
        return self._multiplier

    @property
    def policy(self) -> DynamicPolicy:
        return self._policy

    @property
    def state(self) -> LossScaleState:
        """The state variables (scale float32, counters int64)."""
        return self._variables

    def __call__(self) -> tf.Tensor:
        """The current loss scale, a float32 scalar tensor."""
        return tf.convert_to_tensor(self._variables.scale)

    def update(self, grads: Iterable[Any]) -> tuple[None, tf.Tensor]:
        """Move the scale according to whether every gradient of this step is finite.

        Returns ``(update_op, should_apply_gradients)`` like TensorFlow's: ``update_op`` is
        ``None`` (TF2 runs the update immediately or as part of the enclosing
        ``tf.function``), ``should_apply_gradients`` a scalar bool tensor: False means the
        caller must skip this step. No host read.
        """
        finite = replicas_agree_finite(all_finite(tf.nest.flatten(list(grads))))
        current = LossScaleState(*(tf.convert_to_tensor(v) for v in self._variables))
        new = next_state(self._policy, current, finite, TF_OPS)
        for var, value in zip(self._variables, new, strict=False):
            var.assign(tf.cast(value, var.dtype))
        return None, finite

    def get_config(self) -> dict[str, Any]:
        return {"initial_loss_scale": self._initial_loss_scale, "increment_period": self._increment_period,
                "multiplier": self._multiplier}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DynamicLossScale:
        return cls(**config)
