"""A tiny mixed-precision model whose gradients turn Inf on chosen batches, shared by the Keras tests.

The poisoned batches are marked in the data (a flag input), so a resumed run hits them at
the same steps as an uninterrupted one without any counter of its own.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from lossscale_callbacks.testing import reference_run


@tf.custom_gradient
def _poison_gradient(hidden, flag):
    def grad(upstream):
        poisoned = tf.reduce_max(flag) > 0
        factor = tf.where(poisoned, tf.constant(np.inf, upstream.dtype), tf.constant(1.0, upstream.dtype))
        return upstream * factor, tf.zeros_like(flag)

    return tf.identity(hidden), grad


@keras.saving.register_keras_serializable(package="lossscale_tests")
class GradPoison(keras.layers.Layer):
    """Identity forward; backward multiplies the gradient by Inf when any flag in the batch is set."""

    def call(self, inputs):
        hidden, flag = inputs
        return _poison_gradient(hidden, tf.cast(flag, hidden.dtype))


def build_model(seed: int = 0, units: int = 8) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((4,), name="x")
    flag = keras.Input((1,), name="flag")
    hidden = keras.layers.Dense(units, activation="relu", name="dense_1")(x)
    hidden = GradPoison(name="poison")([hidden, flag])
    out = keras.layers.Dense(1, name="dense_2", dtype="float32")(hidden)
    return keras.Model([x, flag], out)


def make_data(num_batches: int, batch_size: int = 8, poisoned=(), seed: int = 1):
    rng = np.random.default_rng(seed)
    n = num_batches * batch_size
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[0.5], [-1.0], [0.25], [2.0]], dtype="float32")).astype("float32")
    flag = np.zeros((n, 1), dtype="float32")
    for b in poisoned:
        flag[b * batch_size:(b + 1) * batch_size] = 1.0
    return {"x": x, "flag": flag}, y


class StateRecorder(keras.callbacks.Callback):
    """Test-only: after every batch, the optimizer state, the weights and the inner optimizer's variables."""

    def __init__(self, weights: bool = True) -> None:
        super().__init__()
        self.states, self.weights, self.slots, self.iterations = [], [], [], []
        self.record_weights = weights

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        self.states.append(tuple(np.asarray(v).item() for v in opt.read_state()))
        self.iterations.append(int(opt.iterations.numpy()))
        if self.record_weights:
            self.weights.append([w.copy() for w in self.model.get_weights()])
            self.slots.append([np.array(v.numpy()) for v in opt.inner_optimizer.variables])


def expected_states(policy, finite) -> list[tuple[float, ...]]:
    """The NumPy reference's state after each step, as the float tuples StateRecorder records."""
    ref = reference_run(policy, finite)
    return [tuple(float(getattr(ref, f)[t]) for f in ref._fields) for t in range(len(finite))]


def bit_identical(before, after) -> bool:
    """Whether two lists of arrays hold the same bytes, array by array."""
    if len(before) != len(after):
        return False
    return all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))
