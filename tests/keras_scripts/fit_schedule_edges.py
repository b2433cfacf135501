"""Where the host's schedule of the Keras forward trace must not reach (TF, JAX); prints one JSON line.

Run by ``tests/test_keras_trace.py`` once per backend, in its own process (JAX with two CPU devices):

* ``steps_per_execution=4``: the device schedules the trace (the host would trace whole executions);
* a ``fit`` cut short by an exception leaves the host's schedule off;
* a custom loop driven through ``CallbackList`` (TensorFlow) traces on the device's schedule;
* ``keras.distribution.DataParallel`` (JAX): a traced train function made mid-epoch finds its variables.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

import keras
import numpy as np

from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer

BACKEND = keras.backend.backend()


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
                             keras.layers.Dense(1, name="b")])


def fit(net: keras.Model, callbacks: list, steps: int) -> None:
    x, y = np.ones((steps, 4), "float32"), np.ones((steps, 1), "float32")
    with contextlib.redirect_stdout(io.StringIO()):
        net.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def several_steps_per_execution() -> list[int]:
    net = model()
    net.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    callback = LossScaleCallback(log_every=1000, diagnose=True, trace_every=10, health=None)
    fit(net, [callback], 40)
    return sorted(int(s) for s in callback.forward_trace["ring_steps"] if s >= 0)


def interrupted() -> dict:
    net = model()
    net.compile(optimizer="sgd", loss="mse")
    callback = LossScaleCallback(log_every=1000, diagnose=True, trace_every=100, health=None)

    def boom(batch, logs):
        raise KeyboardInterrupt

    with contextlib.suppress(KeyboardInterrupt):
        fit(net, [callback, keras.callbacks.LambdaCallback(on_train_batch_end=boom)], 6)
    trace, wiring = net.optimizer.forward_trace, net.optimizer.forensics
    return {"trace": trace.host_schedule or trace.recording,
            "wiring": wiring.host_schedule or wiring.sampling}


def custom_loop() -> list[int]:
    import tensorflow as tf

    net = model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01))
    opt.build(net.trainable_variables)
    net.optimizer = opt
    callback = LossScaleCallback(log_every=1, diagnose=True, trace_every=1, health=None)
    callbacks = keras.callbacks.CallbackList([callback], model=net)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_mean(tf.square(net(x, training=True) - y)))
        grads = tape.gradient(scaled, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables, strict=True))

    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    traced = []
    with contextlib.redirect_stdout(io.StringIO()):
        callbacks.on_train_begin()
        callbacks.on_epoch_begin(0)
        for batch in range(3):
            callbacks.on_train_batch_begin(batch)
            step(x, y)
            callbacks.on_train_batch_end(batch, {})
            traced.append(int(callback.forward_trace["traced"][0]))
        callbacks.on_epoch_end(0, {})
        callbacks.on_train_end()
    return traced


def data_parallel() -> int:
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        net = model()
        net.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        callback = LossScaleCallback(log_every=1000, diagnose=True, trace_every=3, health=None)
        x = np.ones((16, 4), "float32")
        with contextlib.redirect_stdout(io.StringIO()):
            net.fit(x, np.zeros((16, 1), "float32"), batch_size=2, epochs=1, verbose=0, callbacks=[callback])
        return int(callback.forward_trace["traced"][0])
    finally:
        keras.distribution.set_distribution(None)


if __name__ == "__main__":
    result = {"backend": BACKEND, "steps_per_execution": several_steps_per_execution(),
              "interrupted": interrupted()}
    if BACKEND == "tensorflow":
        result["custom_loop"] = custom_loop()
    if BACKEND == "jax":
        result["data_parallel"] = data_parallel()
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
