"""A custom Keras 3 training loop with GradientTape and the seed API of LossScaleOptimizer.

    python examples/keras_custom_loop.py

The loop is the one tf.keras documented for ``LossScaleOptimizer``: scale the loss with
``get_scaled_loss``, differentiate the scaled loss, unscale with ``get_unscaled_gradients``,
then ``apply_gradients`` (which skips the step when a gradient is Inf/NaN and moves the scale
with the core's update rule). The step is a ``tf.function``; the state is read back on the host
only every ``LOG_EVERY`` steps, by the core's ``LoggingLoop``, which also writes TensorBoard
scalars to ``runs/keras_custom_loop`` and prints the summary at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

from lossscale_callbacks import LoggingLoop
from lossscale_callbacks.keras import LossScaleOptimizer

LOG_EVERY = 25


def main() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (100.0 * np.sin(x[:, :1] * 3.0)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).batch(32).repeat(3)

    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**15,
                                   dynamic_growth_steps=50)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(inputs, targets):
        with tf.GradientTape() as tape:
            loss = loss_fn(targets, model(inputs, training=True))
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))  # skips on Inf/NaN
        return loss

    from lossscale_callbacks.tensorboard import TensorBoardSink

    loop = LoggingLoop(optimizer.policy, sinks=[TensorBoardSink(os.path.join("runs", "keras_custom_loop"))],
                       log_every=LOG_EVERY)
    for step, (inputs, targets) in enumerate(dataset, start=1):
        loss = train_step(inputs, targets)
        # optimizer.read_state() (the one host read of an interval) runs only when one ends.
        snapshot = loop.maybe_observe(step, optimizer.read_state)
        if snapshot is not None:
            print(f"step {snapshot.step:4d}  loss {float(loss):9.2f}  scale {snapshot.scale:8g}  "
                  f"skipped {snapshot.skipped_steps}")
    loop.finish(optimizer.read_state())
    loop.close()
    print(f"applied steps (optimizer.iterations): {int(optimizer.iterations.numpy())}")


if __name__ == "__main__":
    main()
