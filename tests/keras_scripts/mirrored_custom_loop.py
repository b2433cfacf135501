"""The tf.keras custom loop on two replicas: each replica unscales its own gradients, then applies them.

Run as a subprocess (the logical CPUs must be made before TensorFlow initialises); prints one JSON line
``RESULT {...}``: how far one step moved the variable, eagerly and in a ``tf.function``, and the steps
the optimizer counted. Each replica's gradient is 1 (also after the mean across replicas the loop takes),
so a correct step moves it by ``-2 * lr`` (the inner optimizer sums both replicas' gradients); a replica
whose gradients were taken as still scaled would move it by less.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import keras  # noqa: E402

from lossscale_callbacks.keras._optimizer import LossScaleOptimizer  # noqa: E402


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        var = tf.Variable([0.0])
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=8.0)

    def step() -> None:
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(var * 1.0)  # the gradient is 1 on each replica
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, [var]))
        # A sync point between unscaling and applying (every replica reaches it before any goes on):
        # the replicas' unscale requests are all pending at once.
        grads = tf.distribute.get_replica_context().all_reduce("mean", grads)
        opt.apply_gradients(zip(grads, [var], strict=True))

    moved = {}
    def run() -> None:
        strategy.run(step)

    for mode, once in (("eager", run), ("function", tf.function(run))):
        before = float(var.numpy()[0])
        once()
        moved[mode] = float(var.numpy()[0]) - before
    state = opt.read_state()
    print("RESULT " + json.dumps({"replicas": strategy.num_replicas_in_sync, "moved": moved,
                                  "steps": int(state.steps), "skipped": int(state.skipped_steps)}))


if __name__ == "__main__":
    main()
