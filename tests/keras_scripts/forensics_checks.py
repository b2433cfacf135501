"""Overflow forensics of the Keras integration on one Keras backend; prints one JSON line of results.

Run by ``tests/test_keras_forensics.py`` once per backend, each in its own process (Keras picks its
backend at import): ``KERAS_BACKEND=jax python forensics_checks.py OUT_DIR``.

The model reads two poison flags from its input columns, so the poisoned steps are known on every
backend and inside a jitted step: ``poisonable`` (the first layer) gets an Inf in its kernel's gradient
only, ``poisonable_1`` (a late layer) an Inf in its output's gradient, which the backward pass carries
into every earlier layer. Checks: ``fit`` with ``LossScaleCallback(diagnose=True)`` (Inf steps, a NaN
loss, the TensorBoard files under OUT_DIR), the origin in both cases, ``apply`` with the variables in
another order and with a subset, freeze-and-recompile with the same optimizer, headroom and histogram
against NumPy, and (torch) the host reads of the step with and without forensics.
"""

from __future__ import annotations

import json
import math
import os
import sys

import keras
import numpy as np
from keras import ops

from lossscale_callbacks.keras._callback import LossScaleCallback
from lossscale_callbacks.keras._optimizer import LossScaleOptimizer
from lossscale_callbacks.testing import reference_headroom, reference_histogram

BACKEND = keras.backend.backend()
KERNEL_STEPS, NAN_LOSS_STEP, OUTPUT_STEPS = (2, 6), 4, (1, 7)
BATCH = 8


@ops.custom_gradient
def poison(value, hot):
    """The identity; its gradient is Inf wherever ``hot > 0``."""
    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        return ops.where(hot > 0, ops.full_like(upstream, math.inf), upstream), ops.zeros_like(hot)

    return ops.copy(value), grad


class Poisonable(keras.layers.Layer):
    """A dense layer that takes ``[inputs, flag]`` and poisons its kernel's or its output's gradient."""

    def __init__(self, units, where, activation=None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.where, self.activation = units, where, keras.activations.get(activation)

    def build(self, shapes):
        self.kernel = self.add_weight((shapes[0][-1], self.units), initializer="glorot_uniform")
        self.bias = self.add_weight((self.units,), initializer="zeros")

    def call(self, inputs):
        x, flag = inputs
        hot = ops.max(flag)
        kernel = ops.convert_to_tensor(self.kernel)
        if self.where == "kernel":
            kernel = poison(kernel, hot)
        y = ops.matmul(x, kernel) + self.bias
        if self.where == "output":
            y = poison(y, hot)
        return self.activation(y)


def fresh() -> None:
    """Keras' default layer names start again (``dense``, ``dense_1``, ...), the seed too."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)


def poisonable_model() -> keras.Model:
    """``poisonable`` (kernel poison), ``dense``, ``poisonable_1`` (output poison), ``dense_1``."""
    fresh()
    inputs = keras.Input((10,))
    features, kernel_flag, output_flag = inputs[:, :8], inputs[:, 8:9], inputs[:, 9:10]
    h = Poisonable(16, "kernel", activation="relu")([features, kernel_flag])
    h = keras.layers.Dense(16, activation="relu")(h)
    h = Poisonable(16, "output", activation="relu")([h, output_flag])
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def data(kernel_steps=(), output_steps=(), nan_step=None, batches=10) -> np.ndarray:
    x = np.random.default_rng(0).normal(size=(batches * BATCH, 10)).astype("float32")
    x[:, 8:] = 0.0
    for step in kernel_steps:
        x[step * BATCH + 1, 8] = 1.0
    for step in output_steps:
        x[step * BATCH + 1, 9] = 1.0
    if nan_step is not None:
        x[nan_step * BATCH + 3, 0] = np.nan  # that batch's loss is NaN
    return x


def fit(x, tensorboard=None, model=None, callback=None):
    model = model or poisonable_model()
    if callback is None:
        callback = LossScaleCallback(log_every=5, tensorboard=tensorboard, diagnose=True, health=None)
    if not model.compiled:
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, x[:, :1], batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[callback])
    return model, callback


def totals(callback) -> dict:
    found = callback.loop.forensics  # the run's totals over every interval
    return {"causes": {k: v for k, v in found.causes.items() if v}, "skips": dict(found.layer_skips),
            "origins": dict(found.layer_origins)}


def acceptance(out: str) -> dict:
    """An Inf in ``poisonable``'s kernel gradient at KERNEL_STEPS and a NaN loss at NAN_LOSS_STEP."""
    _, callback = fit(data(KERNEL_STEPS, nan_step=NAN_LOSS_STEP), tensorboard=os.path.join(out, "tb"))
    return {"summary": callback.summary}


def origins() -> dict:
    """Where the overflow started: a late layer's output gradient, then the first layer's weight gradient."""
    said = {}
    for case, x in (("output", data(output_steps=OUTPUT_STEPS)), ("kernel", data(KERNEL_STEPS))):
        model = poisonable_model()
        model.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam(), diagnose=True).watch(model),
                      loss="mse")
        model.fit(x, x[:, :1], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        if BACKEND == "jax":
            model.jax_state_sync()
        found = model.optimizer.read_forensics()
        said[case] = {"skips": found.layer_skips, "origins": found.layer_origins, "causes": found.causes,
                      "order": list(found.layer_order)}
    return said


def _grads_with_inf(variables, inf_at):
    grads = []
    for i, variable in enumerate(variables):
        grad = np.full(variable.shape, 0.5, "float32")
        if i == inf_at:
            grad.flat[0] = np.inf
        grads.append(ops.convert_to_tensor(grad))
    return grads


def by_variable() -> dict:
    """``apply`` with the variables reversed and with a subset: each Inf lands on its own layer."""
    fresh()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(3),
                              keras.layers.Dense(2)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), diagnose=True).watch(model)
    variables = list(model.trainable_variables)
    opt.build(variables)
    said = {}
    grads = _grads_with_inf(variables, 4)  # dense_2's kernel
    opt.apply(grads[::-1], variables[::-1])
    found = opt.read_forensics()
    said["reversed"] = [found.layer_skips, found.layer_origins]
    opt.apply(_grads_with_inf(variables, 0)[:2], variables[:2])  # the first layer only
    found = opt.read_forensics()
    said["subset"] = [found.layer_skips, found.layer_origins]
    before = [np.array(ops.convert_to_numpy(v)) for v in variables]
    opt.apply(_grads_with_inf(variables, -1)[2:], variables[2:])  # finite, the last two layers only
    after = [np.array(ops.convert_to_numpy(v)) for v in variables]
    state = opt.read_state()
    said["subset_finite"] = {"skips": opt.read_forensics().layer_skips, "steps": int(state.steps),
                             "skipped": int(state.skipped_steps),
                             "moved": [not np.array_equal(a, b) for a, b in zip(before, after, strict=True)]}
    return said


def freeze_and_recompile() -> dict:
    """Fit, freeze the first layer, compile with the same optimizer, fit with a late layer poisoned."""
    model, callback = fit(data(batches=2))
    optimizer = model.optimizer
    model.layers[1].trainable = False  # layers[0] is the input layer; the slices have no weights
    model.compile(optimizer=optimizer, loss="mse")
    try:
        fit(data(output_steps=(1,), batches=2), model=model, callback=callback)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"totals": totals(callback), "summary": callback.summary}


def headroom() -> dict:
    """Per-layer headroom, underflow and histogram of one ``every_step`` sample, against NumPy."""
    fresh()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**6,
                             diagnose="every_step").watch(model)
    rng = np.random.default_rng(0)
    scaled = [rng.normal(size=v.shape).astype("float32") * s
              for v, s in zip(model.trainable_variables, (1e-6, 1.0, 300.0, 2.0**-20), strict=True)]
    opt.apply([ops.convert_to_tensor(g) for g in scaled], model.trainable_variables)
    found = opt.read_forensics()
    layers = {"dense": np.concatenate([scaled[0].ravel(), scaled[1].ravel()]) / 2.0**6,
              "dense_1": np.concatenate([scaled[2].ravel(), scaled[3].ravel()]) / 2.0**6}
    want = reference_headroom(layers, 2.0**6)
    got = {h.layer: h for h in found.headroom}
    return {"headroom": all(got[w.layer].max_abs_scaled == w.max_abs_scaled and got[w.layer].underflow
                            == w.underflow and got[w.layer].total == w.total for w in want),
            "histogram": found.histogram == reference_histogram([g / 2.0**6 for g in scaled], 2.0**6),
            "underflowing": sum(w.underflow for w in want)}


def fit_samples() -> dict:
    """The batches of ``fit`` whose read shows a headroom sample, with ``headroom_every=3`` (JAX's fit
    decides them on the host, the other backends as in a custom loop: the same steps)."""
    model = poisonable_model()
    model.compile(optimizer="adam", loss="mse")
    sampled = []

    class Reader(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if BACKEND == "jax":
                self.model.jax_state_sync()
            found = self.model.optimizer.read_forensics()
            if found.headroom:
                sampled.append(batch)

    callback = LossScaleCallback(log_every=100, diagnose=True, headroom_every=3, health=None)
    model.fit(data(batches=8), np.zeros((8 * BATCH, 1)), batch_size=BATCH, epochs=1, verbose=0,
              shuffle=False, callbacks=[Reader(), callback])  # read before the callback logs batch 0
    return {"sampled": sampled}


def torch_host_reads() -> dict:
    """The library's host reads in 6 torch steps (one skipped, samples included), forensics on and off."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_scripts.host_reads import HostReadCounter

    import lossscale_callbacks
    import lossscale_callbacks.keras

    here = [os.path.dirname(m.__file__) for m in (lossscale_callbacks, lossscale_callbacks.keras)]
    reads = {}
    for diagnose in (False, True):
        fresh()
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
        opt = LossScaleOptimizer(keras.optimizers.Adam(), diagnose=diagnose, headroom_every=2).watch(model)
        opt.build(model.trainable_variables)
        with HostReadCounter(only_under=tuple(here)) as counter:
            for step in range(6):
                grads = _grads_with_inf(model.trainable_variables, 3 if step == 3 else -1)
                opt.apply([torch.as_tensor(g) for g in grads], model.trainable_variables)
        reads[str(diagnose)] = len(counter.reads)
    reads["skips"] = opt.read_forensics().layer_skips
    return reads


def data_parallel() -> dict:
    """JAX ``DataParallel`` over two CPU devices: the late layer poisoned in the second device's rows."""
    devices = keras.distribution.list_devices("cpu")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        x = data(output_steps=(1,), batches=4)
        x[[BATCH + 1, 3 * BATCH + 6], 9] = [0.0, 1.0]  # step 3, a row of the second device's shard
        _, callback = fit(x, callback=LossScaleCallback(log_every=2, diagnose=True, health=None))
        return {"devices": len(devices), "totals": totals(callback)}
    finally:
        keras.distribution.set_distribution(None)


def main() -> None:
    out = sys.argv[1]
    result = {"backend": BACKEND, "acceptance": acceptance(out), "origins": origins(),
              "by_variable": by_variable(), "freeze": freeze_and_recompile(), "headroom": headroom(),
              "fit_samples": fit_samples()}
    if BACKEND == "torch":
        result["host_reads"] = torch_host_reads()
    if BACKEND == "jax":
        result["data_parallel"] = data_parallel()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
