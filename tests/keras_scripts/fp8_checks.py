"""Keras' fp8 layers watched by ``Fp8ScaleCallback`` under the backend of ``KERAS_BACKEND``; prints one
``RESULT <json>`` line (run by ``tests/test_fp8_keras.py`` through ``run_checks.py``, with the other modules'
scripts of a session, one process a backend).

1. A Dense stack quantized to float8, ``d2``'s input multiplied by 50 at step 30 of 40 (the same batch every
   step otherwise): what the monitor counted and rebuilt, against a count made here from the layer's own
   variables (its input recomputed through ``d1``, its scale read before the step); the same with an amax
   history of 8 steps.
2. A checkpoint saved at step 20, loaded after step 30 into a run whose inputs grew 8 times since.
3. Whether ``fit`` waits for each step because of the monitor (where Keras runs the batch-end hooks), with
   the default rules and with ``health="stop"``, and the step a ``"stop"`` rule stops at.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings

import keras
import numpy as np
from keras import ops

from lossscale_callbacks import InMemorySink
from lossscale_callbacks.fp8._formats import E4M3
from lossscale_callbacks.keras import Fp8ScaleCallback

OUT = sys.argv[1] if len(sys.argv) > 1 else "fp8_out"
BATCH, FEATURES, UNITS, STEPS = 32, 32, 64, 40


def _sync(model):
    if keras.backend.backend() == "jax":
        model.jax_state_sync()


def build(history: int | None = None) -> keras.Model:
    keras.utils.set_random_seed(0)
    policies = keras.dtype_policies
    dtype = (None if history is None else
             policies.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=history))
    x = keras.Input((FEATURES,), name="x")
    f = keras.Input((1,), name="f")
    h = keras.layers.Dense(UNITS, activation="relu", name="d1", dtype=dtype)(x)
    h = keras.layers.Multiply(name="outlier")([h, f])
    h = keras.layers.Dense(UNITS, activation="relu", name="d2", dtype=dtype)(h)
    model = keras.Model([x, f], keras.layers.Dense(1, name="d3", dtype=dtype)(h))
    if history is None:
        model.quantize("float8")
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def data(factors: dict[int, float]) -> tuple[list[np.ndarray], np.ndarray]:
    """The same batch every step; ``d2``'s input times ``factors[step]`` at those steps (1-based)."""
    rng = np.random.default_rng(0)
    batch = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    x = np.tile(batch, (STEPS, 1))
    f = np.ones((STEPS * BATCH, 1), "float32")
    for step, factor in factors.items():
        f[(step - 1) * BATCH: step * BATCH] = factor
    y = np.tile(rng.normal(size=(BATCH, 1)).astype("float32"), (STEPS, 1))
    return [x, f], y


class Witness(keras.callbacks.Callback):
    """Reads the layer's own variables before chosen steps (a test's host reads, not the monitor's)."""

    def __init__(self, x, f, steps):
        super().__init__()
        self.x, self.f, self.steps = x, f, steps
        self.scales: dict[int, float] = {}
        self.recount: dict[int, int] = {}

    def on_train_batch_begin(self, batch, logs=None):
        step = batch + 1
        if step not in self.steps:
            return
        _sync(self.model)
        d1, d2 = self.model.get_layer("d1"), self.model.get_layer("d2")
        scale = float(ops.convert_to_numpy(d2.inputs_scale))  # Keras divides by it
        self.scales[step] = scale
        rows = slice(batch * BATCH, (batch + 1) * BATCH)
        h = ops.convert_to_numpy(d1(self.x[rows], training=False)) * self.f[rows]
        self.recount[step] = int((np.abs(h) >= E4M3.saturation * scale).sum())


def outlier_run(history: int | None, log_every: int, tensorboard: str | None, at: int = 30,
                witnessed: bool = True) -> dict:
    model = build(history)
    (x, f), y = data({at: 50.0})
    memory = InMemorySink()
    monitor = Fp8ScaleCallback(log_every=log_every, count_every=1, sinks=[memory], tensorboard=tensorboard,
                               echo=None)
    # The witness reads the model's variables, which on JAX syncs fit's state: unwitnessed, the monitor's
    # reads (and the counts they start again from zero) meet fit's live state alone.
    witness = [Witness(x, f, range(25, 36))] if witnessed else []
    model.fit([x, f], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor, *witness])
    names = {name for _, metrics in memory.records for name in metrics if name.startswith("fp8/d2/input/")}
    series = {name: [[int(s), float(v)] for s, v in memory.series(name)] for name in sorted(names)}
    return {"series": series,
            "witness_scale": {str(k): v for k, v in witness[0].scales.items()} if witness else {},
            "recount": {str(k): v for k, v in witness[0].recount.items()} if witness else {},
            "verdicts": [[v.rule, v.step, v.message] for v in monitor.loop.verdicts],
            "summary": monitor.summary,
            "texts": [text for tag, text in memory.texts if tag == "fp8/findings"]}


def stale_run() -> dict:
    model = build()
    (x, f), y = data({s: 8.0 for s in range(21, STEPS + 1)})  # from step 21 on, d2's input 8 times larger
    checkpoint = os.path.join(OUT, "step20.weights.h5")

    class SaveAt20(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == 20:
                _sync(self.model)
                self.model.save_weights(checkpoint)

    memory = InMemorySink()
    monitor = Fp8ScaleCallback(log_every=10, count_every=10, sinks=[memory], echo=None)
    first = slice(0, 30 * BATCH)
    model.fit([x[first], f[first]], y[first], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[monitor, SaveAt20()])
    model.load_weights(checkpoint)  # after step 30: the histories of step 20
    rest = slice(30 * BATCH, None)
    model.fit([x[rest], f[rest]], y[rest], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[monitor])
    stale = [[int(s), float(v)] for s, v in memory.series("fp8/d2/input/stale_ratio")]
    return {"verdicts": [[v.rule, v.step, v.message] for v in monitor.loop.verdicts], "stale": stale}


class Threads(keras.callbacks.Callback):
    """Where Keras runs the batch-end hooks: in a worker thread of its own on JAX and torch, unless a
    callback that is not ``async_safe`` has a batch-end hook (then it waits for every step's logs)."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.on_main: set[bool] = set()

    def on_train_batch_end(self, batch, logs=None):
        self.on_main.add(threading.current_thread() is threading.main_thread())


def waiting_run(health: str) -> dict:
    """The outlier at step 30, the monitor's default rules with ``health``'s action, read every 10 steps."""
    model = build()
    (x, f), y = data({30: 50.0})
    threads = Threads()
    monitor = Fp8ScaleCallback(log_every=10, count_every=1, health=health, echo=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the findings' own warnings
        model.fit([x, f], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[monitor, threads])
    return {"on_main": sorted(threads.on_main),
            "steps": int(ops.convert_to_numpy(model.optimizer.iterations)),
            "verdicts": sorted({(v.rule, v.step) for v in monitor.loop.verdicts})}


def generator_run() -> dict:
    """A fit from a generator of 25 batches (data of unknown length: Keras begins a 26th batch, which finds
    the data exhausted and runs no step), read every 10 steps, then a second fit of 15 more. Returns per fit
    the monitor's count, the optimizer's and the batches that ended."""
    model = build()
    (x, f), y = data({})
    memory = InMemorySink()
    monitor = Fp8ScaleCallback(log_every=10, count_every=10, sinks=[memory], echo=None)

    def batches(count):
        for i in range(count):
            rows = slice(i * BATCH, (i + 1) * BATCH)
            yield (x[rows], f[rows]), y[rows]

    class Ends(keras.callbacks.Callback):
        async_safe = True  # counts, and lets Keras run its hooks as without it
        ended = 0

        def on_train_batch_end(self, batch, logs=None):
            Ends.ended += 1

    steps, replaced, counting = [], [], []
    for count in (25, 15):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras: "Your input ran out of data", as meant here
            model.fit(batches(count), epochs=1, verbose=0, callbacks=[monitor, Ends()])
        steps.append([monitor._step, int(ops.convert_to_numpy(model.optimizer.iterations)), Ends.ended])
        replaced.append(sorted({name for _, metrics in memory.records for name in metrics
                                if name.endswith(("/replaced_after", "/stale_ratio"))}))
        counting.append(monitor._counting)
    return {"steps": steps, "replaced": replaced,
            "counting_kept": counting[0] is not None and counting[1] is counting[0],
            "scale_steps": [s for s, _ in memory.series("fp8/d2/input/scale")],
            "verdicts": sorted({(v.rule, v.step) for v in monitor.loop.verdicts})}


def step_ops() -> dict:
    """The ops of one train step: no monitor, the monitor's ordinary step and a counted one. torch (eager):
    the aten ops of a step (its dispatcher sees every op a GPU would launch); TensorFlow: the operations of
    the step's graph; JAX: the instructions of the step as XLA compiled it."""
    from lossscale_callbacks.keras._fp8 import Fp8Layers

    (x, f), y = data({})
    batch = ([x[:BATCH], f[:BATCH]], y[:BATCH])
    counts = {}
    for arm in ("bare", "ordinary", "counted"):
        model = build()
        layers = Fp8Layers()
        if arm != "bare":
            layers.watch(model)
        layers.counting = arm == "counted"
        model.train_on_batch(*batch)  # builds the optimizer (with the tallies) and warms up
        counts[arm] = _ops_of_a_step(model, batch)
        layers.counting = False
    return counts


def _ops_of_a_step(model: keras.Model, batch: tuple) -> int:
    backend = keras.backend.backend()
    if backend == "torch":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from aten_ops import AtenOps

        with AtenOps() as ops:
            model.train_on_batch(*batch)
        return len(ops)
    if backend == "tensorflow":
        import tensorflow as tf

        step = tf.function(model.train_step).get_concrete_function((batch[0], batch[1]))
        return len(step.graph.get_operations())
    import jax

    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    compiled = jax.jit(model.train_step).lower(state, (batch[0], batch[1])).compile().as_text()
    return sum(" = " in line for line in compiled.splitlines())


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        unwitnessed = outlier_run(None, 10, None, at=15, witnessed=False)
    result = {
        "backend": keras.backend.backend(),
        "outlier": outlier_run(None, 10, os.path.join(OUT, "tb")),
        "short": outlier_run(8, 5, None),
        "unwitnessed": unwitnessed,
        # Keras' warning about variables without a gradient: the tallies have none on an ordinary step
        "no_gradient_warnings": [str(w.message) for w in seen if "Gradients do not exist" in str(w.message)],
        "stale": stale_run(),
        "waits": {health: waiting_run(health) for health in ("warn", "stop")},
        "generator": generator_run(),
        "ops": step_ops(),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
