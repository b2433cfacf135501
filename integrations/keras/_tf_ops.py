"""TensorFlow backend of the core's :class:`~lossscale_callbacks.extend.Ops` protocol.

With these ops the core's one update rule, :func:`lossscale_callbacks.next_state`,
runs eagerly, inside ``tf.function`` and under XLA (``jit_compile=True``) with no host
read: every method is a single TensorFlow op on scalar tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

# Counters are int64 on purpose. TensorFlow keeps int32 tensors in host memory even when
# an op runs on a GPU (the "int32 on host" rule), so int32 counters would force a
# device-to-host copy inside every training step. int64 tensors live on the device, and
# match the NumPy reference backend's dtype, so conformance is a plain equality.
COUNTER_DTYPE = tf.int64
SCALE_DTYPE = tf.float32


class TFOps:
    """The core's ``Ops`` in TensorFlow: float32 scale, int64 counters, 0-d tensors.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
        >>> policy = DynamicPolicy(initial_scale=8.0, growth_interval=2)
        >>> state = initial_state(policy, TF_OPS)
        >>> state = next_state(policy, state, tf.constant(False), TF_OPS)
        >>> float(state.scale), int(state.skipped_steps)
        (4.0, 1)
    """

    name = "tensorflow"

    def scale(self, value: float) -> tf.Tensor:
        # tf.constant rounds a Python float to the nearest float32, exactly like NumPy.
        return tf.constant(value, dtype=SCALE_DTYPE)

    def count(self, value: int) -> tf.Tensor:
        return tf.constant(value, dtype=COUNTER_DTYPE)

    def as_bool(self, value: Any) -> tf.Tensor:
        value = tf.convert_to_tensor(value)
        if value.dtype == tf.bool:
            return value
        return tf.not_equal(value, tf.zeros_like(value))

    def where(self, condition: Any, x: Any, y: Any) -> tf.Tensor:
        return tf.where(condition, x, y)

    def minimum(self, x: Any, y: Any) -> tf.Tensor:
        return tf.minimum(x, y)

    def maximum(self, x: Any, y: Any) -> tf.Tensor:
        return tf.maximum(x, y)

    def logical_and(self, x: Any, y: Any) -> tf.Tensor:
        return tf.logical_and(x, y)

    def logical_not(self, x: Any) -> tf.Tensor:
        return tf.logical_not(x)


TF_OPS = TFOps()


def all_finite(grads: Iterable[Any]) -> tf.Tensor:
    """A scalar bool tensor: True when every element of every gradient is finite.

    ``None`` gradients are ignored and ``tf.IndexedSlices`` are checked on their values.
    No host read: the result stays a tensor for ``tf.cond``/``tf.where``.
    """
    checks = []
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        checks.append(tf.reduce_all(tf.math.is_finite(grad)))
    if not checks:
        return tf.constant(True)
    if len(checks) == 1:
        return checks[0]
    return tf.reduce_all(tf.stack(checks))


def replicas_agree_finite(local_finite: tf.Tensor) -> tf.Tensor:
    """Make the overflow decision global: one replica's Inf/NaN makes it False on every replica.

    In a replica context of a ``tf.distribute`` strategy with several replicas, all-reduces the
    local flag (one scalar); elsewhere returns it unchanged. No host read.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return local_finite
    overflowed = tf.cast(tf.logical_not(local_finite), tf.float32)
    return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, overflowed), 0.0)


def unscale(grad: Any, scale: tf.Tensor) -> Any:
    """Divide one gradient by the float32 ``scale``, keeping the gradient's dtype.

    float16/bfloat16 gradients are divided in float32 and cast back, so a large scale's
    reciprocal never underflows in half precision; float64 gradients use the exact
    float64 value of the scale.
    """
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(unscale(grad.values, scale), grad.indices, grad.dense_shape)
    if grad.dtype == SCALE_DTYPE:
        return grad / scale
    if grad.dtype == tf.float64:
        return grad / tf.cast(scale, tf.float64)
    return tf.cast(tf.cast(grad, SCALE_DTYPE) / scale, grad.dtype)
