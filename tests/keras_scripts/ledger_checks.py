"""The ledger's acceptance scenario through Keras ``fit`` on one backend; prints one JSON line.

Run by ``tests/test_keras_ledger.py`` once per backend (with the session's other check scripts,
``run_checks.py``). The scenario of ``tests/ledger_scenario.py`` in Keras: 512 samples of 16 features,
samples 37 and 301 scaled by 16,000 so that ``fc2``'s float16 output overflows for the whole run (``fc1``'s
does not; finite in float32), batch size 8, 3 epochs (192 steps), ``mixed_float16``, and a one-off Inf at
step 50 on a clean batch (a ``Poison`` layer after the head multiplies its 50th training output by Inf).
Two runs:

* NumPy inputs with ``shuffle=False`` and ``LossScaleCallback(unshuffled=(512, 8))``: the entries hold the
  rows too;
* a ``tf.data`` pipeline shuffled with seed 0: the entries hold the epoch and batch index; the same pipeline
  iterated alone gives its order, to check them.

The NumPy run with ``diagnose=True, trace_every=1`` (every step traced) and ``log_every=1``: the forward
trace names the producing layer of the first non-finite step of each interval, so one step an interval names
every bad step's. The ``tf.data`` run without forensics, ``log_every=8`` (the identity alone; the traced
steps' train functions cost most of a run: JAX compiles each, torch wraps every layer call). Also counted:
the ops the optimizer's outcome ring adds to a step on this backend.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import keras
import numpy as np
from keras import ops

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer
from lossscale_callbacks.ledger._read import read_ledgers

BACKEND = keras.backend.backend()
N, FEATURES, BATCH, EPOCHS, INJECT_AT = 512, 16, 8, 3, 50
BAD, SCALE_BAD = (37, 301), 16000.0


@keras.saving.register_keras_serializable(package="lossscale_tests")
class Poison(keras.layers.Layer):
    """The identity, except that its ``at``-th training call's output is multiplied by Inf: a one-off fault
    at that step on a clean batch (its own call count, a non-trainable weight, on every backend)."""

    def __init__(self, at: int, **kwargs):
        super().__init__(**kwargs)
        self.at = at

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, dtype="float32",
                                     name="calls")

    def call(self, x, training=False):
        if not training:
            return x
        n = self.calls + 1.0
        self.calls.assign(n)
        factor = ops.where(ops.equal(n, float(self.at)), float("inf"), 1.0)
        return x * ops.cast(factor, x.dtype)

    def get_config(self):
        return {**super().get_config(), "at": self.at}


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    x[list(BAD)] *= SCALE_BAD
    return x, y


def dense(units: int, fan_in: int, name: str, **kwargs) -> keras.layers.Dense:
    """A ``Dense`` layer initialised as torch's ``nn.Linear`` (uniform within 1/sqrt(fan_in)), as the torch
    scenario's."""
    bound = fan_in ** -0.5
    init = keras.initializers.RandomUniform(-bound, bound)
    return keras.layers.Dense(units, name=name, kernel_initializer=init, bias_initializer=init, **kwargs)


def net() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        dense(64, FEATURES, "fc1"), keras.layers.ReLU(name="act1"),
        dense(64, 64, "fc2"), keras.layers.ReLU(name="act2"),
        keras.layers.Dropout(0.1, name="drop"),
        dense(1, 64, "head", dtype="float32"),
        Poison(INJECT_AT, name="poison", dtype="float32"),
    ])
    fc2 = model.get_layer("fc2")
    fc2.kernel.assign(fc2.kernel * 20.0)  # fc2 amplifies, as the torch scenario's
    return model


def maxima(model: keras.Model, x: np.ndarray) -> dict[str, float]:
    """The largest |output| of fc1 and fc2 on the bad samples, in float32: fc2's must exceed float16's range,
    fc1's not (the scenario's premise, checked)."""
    h1 = np.maximum(x[list(BAD)] @ np.asarray(model.get_layer("fc1").kernel) + np.asarray(
        model.get_layer("fc1").bias), 0.0)
    h2 = h1 @ np.asarray(model.get_layer("fc2").kernel) + np.asarray(model.get_layer("fc2").bias)
    return {"fc1": float(np.abs(h1).max()), "fc2": float(np.abs(h2).max())}


def fit(x, y, folder: str, *, tf_data: bool) -> tuple[keras.Model, LossScaleCallback]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = net()
        model.compile(optimizer=keras.optimizers.SGD(1e-3, momentum=0.9), loss="mse")
        callback = LossScaleCallback(
            policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000), ledger=folder, health=None,
            echo=None, **(dict(log_every=8) if tf_data else dict(log_every=1, diagnose=True, trace_every=1,
                                                                     unshuffled=(N, BATCH))))
        with contextlib.redirect_stdout(io.StringIO()):
            if tf_data:
                model.fit(pipeline(x, y), epochs=EPOCHS, verbose=0, callbacks=[callback])
            else:
                model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          callbacks=[callback])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, callback


def pipeline(*arrays):
    """The arrays shuffled with seed 0, in batches of 8, one order for every pass (no reshuffling): Keras on
    JAX and torch peeks at batches of a pass of its own before training, so a per-pass order could not be
    told from outside; the callback cannot see it either way."""
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices(arrays)
    return data.shuffle(N, seed=0, reshuffle_each_iteration=False).batch(BATCH)


def expected(batches: list[list[int]]) -> dict[int, tuple[int, int, list[int]]]:
    """step -> (epoch, batch index, the bad samples in it) of every step whose batch holds 37 or 301, from
    the batches in the order ``fit`` took them."""
    per_epoch = N // BATCH
    return {step: ((step - 1) // per_epoch, (step - 1) % per_epoch, sorted(set(rows) & set(BAD)))
            for step, rows in enumerate(batches, start=1) if set(rows) & set(BAD)}


def entries(folder: str) -> list[dict]:
    return [json.loads(e.to_json()) for e in read_ledgers(folder)]


def ring_ops() -> tuple[int, int]:
    """The ops the outcome ring adds to one step on this backend, the ring's step alone: TensorFlow graph ops
    (reads and writes of its variables included; no constants or identities), JAX ``jaxpr`` equations,
    torch's dispatched aten ops; and how many of them read a value back to the host (a ``py_function``, a
    host callback, torch's ``_local_scalar_dense``: ``.item()``, ``bool()``)."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    opt.build([keras.Variable(np.ones(2, "float32"))])
    ring, state_vars = opt.outcome_ring, opt.loss_scale_variables
    step = opt._step
    if BACKEND == "tensorflow":
        import tensorflow as tf

        from lossscale_callbacks.keras._tf_ops import TF_OPS

        def record(finite):
            state = state_vars.values()
            ring.record(state, finite, step.scale_bits(state.scale), TF_OPS)

        graph = tf.function(record).get_concrete_function(tf.TensorSpec((), tf.bool)).graph
        skip = ("Placeholder", "Const", "Identity", "NoOp")
        kinds = [op.type for op in graph.get_operations() if op.type not in skip]
        return len(kinds), len([k for k in kinds if "PyFunc" in k])
    if BACKEND == "jax":
        import jax

        from lossscale_callbacks.keras._keras_ops import KERAS_OPS

        def next_values(rows, written, steps, scale, finite):
            return ring.next_values(rows, written, steps, step.scale_bits(scale), finite, KERAS_OPS)

        state = state_vars.values()
        jaxpr = jax.make_jaxpr(next_values)(ring.rows.value, ring.written.value, state.steps, state.scale,
                                            True)
        names = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
        return len(names), len([n for n in names if "callback" in n])
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.reads += "_local_scalar_dense" in str(func)
            return func(*args, **(kwargs or {}))

    rule_ops = step._ops_on(state_vars.scale.value.device)
    finite = torch.tensor(True)
    ring.record_torch(state_vars.values(), finite, rule_ops)  # the constants made once
    state = state_vars.values()
    with Count() as counter:
        ring.record_torch(state, finite, rule_ops)
    return counter.ops, counter.reads


def main(out: str) -> None:
    x, y = data()
    ops_added, host_reads = ring_ops()
    result = {"backend": BACKEND, "ring_ops": ops_added, "ring_host_reads": host_reads,
              "maxima": maxima(net(), x)}
    runs = {}
    for name, tf_data in (("numpy", False), ("tf_data", True)):
        folder = os.path.join(out, name)
        model, callback = fit(x, y, folder, tf_data=tf_data)
        if tf_data:  # the pipeline's order, the same every epoch
            keras.utils.set_random_seed(0)
            order = [[int(i) for i in np.asarray(b)] for (b,) in pipeline(np.arange(N))]
        else:  # shuffle=False: the rows in order
            order = [list(range(b, b + BATCH)) for b in range(0, N, BATCH)]
        runs[name] = {"entries": entries(folder), "summary": callback.summary,
                      "steps": int(model.optimizer.read_state().steps), "expected": expected(order * EPOCHS)}
    result["runs"] = runs
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
