"""Skip truth on Keras: an Inf at steps 3, 17 and 42 of 100, on every path of ours; prints one JSON line.

Run by ``tests/test_keras_skip_truth.py`` once per backend (with the other check scripts of the session,
``run_checks.py``). Two paths, each with ``AdamW(learning_rate=<a LearningRateSchedule>, use_ema=True)``:

* ``fit`` with ``LossScaleCallback`` (which installs our ``LossScaleOptimizer`` in compile's place),
  under ``mixed_float16`` (float32 on torch, whose CPU float16 matmuls are emulated: slow);
* a custom loop with ``LossScaleOptimizer(...).minimize``.

Each runs twice: with the three batches poisoned (an Inf input: a non-finite loss and gradients) and
without those batches at all (the reference). ``iterations`` must be 97 in both, the schedule's learning
rate the one at 97, and the EMA (written into the model by ``finalize_variable_values`` after ``fit``)
and the weights equal to the reference's.
"""

from __future__ import annotations

import contextlib
import io
import json

import keras
import numpy as np

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer

BACKEND = keras.backend.backend()
STEPS, BATCH = 100, 8
INJECTED = (3, 17, 42)


def data(inject: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
    steps = [s for s in range(1, STEPS + 1) if inject or s not in INJECTED]
    rows = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH) for s in steps])
    x, y = x[rows].copy(), y[rows].copy()
    if inject:
        for s in INJECTED:
            x[(s - 1) * BATCH, 0] = np.inf
    return x, y


def schedule() -> keras.optimizers.schedules.LearningRateSchedule:
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=10, decay_rate=0.8)


def net() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1, dtype="float32")])


def _numbers(values: list) -> list[list[float]]:
    return [np.asarray(keras.ops.convert_to_numpy(v), dtype="float64").reshape(-1).tolist() for v in values]


def _summary(outer: LossScaleOptimizer, model: keras.Model) -> dict:
    inner = outer.inner_optimizer
    state = outer.read_state()
    return {"iterations": int(keras.ops.convert_to_numpy(outer.iterations)),
            "inner_iterations": int(keras.ops.convert_to_numpy(inner.iterations)),
            "steps": int(state.steps), "skipped": int(state.skipped_steps),
            "learning_rate": float(keras.ops.convert_to_numpy(inner.learning_rate)),
            "ema": _numbers(inner._model_variables_moving_average),
            "weights": _numbers(model.trainable_variables)}


def fit_run(inject: bool) -> dict:
    keras.mixed_precision.set_global_policy("float32" if BACKEND == "torch" else "mixed_float16")
    model = net()
    model.compile(optimizer=keras.optimizers.AdamW(schedule(), use_ema=True), loss="mse")
    x, y = data(inject)
    # A starting scale this model's float16 gradients never overflow at: the only skips are the injected.
    callback = LossScaleCallback(policy=DynamicPolicy(initial_scale=2.0**8), log_every=1000, health=None,
                                 echo=None)
    with contextlib.redirect_stdout(io.StringIO()):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    keras.mixed_precision.set_global_policy("float32")
    return {**_summary(model.optimizer, model), "optimizer": type(model.optimizer).__name__}


def loop_run(inject: bool) -> dict:
    model = net()
    opt = LossScaleOptimizer(keras.optimizers.AdamW(schedule(), use_ema=True))
    x, y = data(inject)
    for start in range(0, len(x), BATCH):
        xb, yb = (keras.ops.convert_to_tensor(v[start:start + BATCH]) for v in (x, y))

        def loss(xb=xb, yb=yb):
            return keras.ops.mean(keras.ops.square(model(xb) - yb))

        opt.minimize(loss, model.trainable_variables)
    opt.finalize_variable_values(model.trainable_variables)
    return _summary(opt, model)


def outcome_codes() -> dict:
    """The outcome code, the rule's input and "applied", written once against Ops, on this backend's ops
    (Keras' and, on TensorFlow, tf's): the whole truth table, as host numbers."""
    from lossscale_callbacks.keras._keras_ops import KERAS_OPS
    from lossscale_callbacks.skips._outcomes import CODES, is_applied, rule_finite, step_code

    backends = {"keras": KERAS_OPS}
    if BACKEND == "tensorflow":
        from lossscale_callbacks.keras._tf_ops import TFOps

        backends["tf"] = TFOps()
    out = {}
    for name, ops in backends.items():
        table = []
        for skip in (True, False):
            for nonfinite in (False, True):
                for spike in (False, True):
                    code = step_code(ops.as_bool(nonfinite), ops.as_bool(spike), skip, ops)
                    finite = rule_finite(ops.as_bool(nonfinite), skip, ops)
                    host = keras.ops.convert_to_numpy
                    table.append([int(host(code)), bool(host(finite))])
        applied = [bool(keras.ops.convert_to_numpy(is_applied(ops.count(c), ops))) for c in CODES]
        out[name] = {"table": table, "applied": applied}
    return out


def expected_learning_rate(applied: int) -> float:
    return float(keras.ops.convert_to_numpy(schedule()(applied)))


def main() -> None:
    result = {"backend": BACKEND, "applied_rate": expected_learning_rate(STEPS - len(INJECTED)),
              "attempted_rate": expected_learning_rate(STEPS)}
    result["codes"] = outcome_codes()
    for name, run in (("fit", fit_run), ("loop", loop_run)):
        result[name] = {"injected": run(True), "reference": run(False)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
