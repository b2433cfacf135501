"""The Keras integration on one Keras backend, as a user runs it; prints one JSON line of results.

Run by ``tests/test_keras_backends.py`` once per backend, each in its own process (Keras picks its
backend at import): ``KERAS_BACKEND=jax python backend_checks.py OUT_DIR``.

Checks: the core rule in ``keras.ops`` against the NumPy reference (all conformance cases; jitted on
JAX, traced on TensorFlow with each case's start also eagerly, eager on torch), the tf.keras
documentation's ``minimize`` (0.5) and tape-style (0.25) examples, ``fit`` with ``LossScaleCallback`` and
a batch holding an Inf (the step skipped, weights and optimizer slots bit-identical, the metrics in
``logs`` and TensorBoard), ``model.save``/``load_model`` resuming the state, ``read_state()`` as one
conversion of the stacked state, and the alignment check's answer on this backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

import keras
import numpy as np
from keras import ops

from lossscale_callbacks._state import LossScaleState
from lossscale_callbacks._update import initial_state, next_state
from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer
from lossscale_callbacks.keras._keras_ops import KERAS_OPS
from lossscale_callbacks.testing import ConformanceCase, assert_conforms, conformance_cases

BACKEND = keras.backend.backend()


# TensorFlow runs each eager keras op at about 50 us: all 28,000 steps eagerly took 29 s of this script. There
# the whole cases run traced (tf.function and tf.scan: the way fit runs the rule) and each case's first
# EAGER_STEPS steps eagerly (a custom training loop's way); torch has no cheap trace and runs them all.
EAGER_STEPS = 150


def _prefix(case: ConformanceCase, steps: int) -> ConformanceCase:
    expected = LossScaleState(*(np.asarray(f)[:steps] for f in case.expected))
    return dataclasses.replace(case, finite=case.finite[:steps], expected=expected)


def _eager(case: ConformanceCase) -> LossScaleState:
    state, rows = initial_state(case.policy, KERAS_OPS), []
    for flag in case.finite:
        state = next_state(case.policy, state, bool(flag), KERAS_OPS)
        rows.append([np.asarray(ops.convert_to_numpy(x)) for x in state])
    return LossScaleState(*(np.stack(col) for col in zip(*rows, strict=True)))


def conformance() -> int:
    cases = conformance_cases()
    for case in cases:
        if BACKEND == "jax":
            import jax

            policy = case.policy

            @jax.jit
            def run(finite, policy=policy):
                def body(carry, bit):
                    new = next_state(policy, carry, bit, KERAS_OPS)
                    return new, new

                return jax.lax.scan(body, initial_state(policy, KERAS_OPS), finite)[1]

            states = run(np.asarray(case.finite))
            actual = LossScaleState(*(np.asarray(x) for x in states))
        elif BACKEND == "tensorflow":
            import tensorflow as tf

            policy = case.policy

            @tf.function
            def run(finite, policy=policy):
                return tf.scan(lambda state, flag: next_state(policy, state, flag, KERAS_OPS), finite,
                               initializer=initial_state(policy, KERAS_OPS))

            actual = LossScaleState(*(np.asarray(x) for x in run(tf.constant(case.finite, dtype=tf.bool))))
            prefix = _prefix(case, EAGER_STEPS)
            assert_conforms(prefix, _eager(prefix))
        else:
            actual = _eager(case)
        assert_conforms(case, actual)
    return len(cases)


def seed_examples() -> list[float]:
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.25))
    var = keras.Variable(1.0)

    def loss_fn():
        return var**2

    opt.minimize(loss_fn, var_list=var)
    after_minimize = float(ops.convert_to_numpy(var))
    # The tape-style example, with this backend's way to differentiate.
    if BACKEND == "jax":
        import jax

        def scaled(value):
            with keras.StatelessScope(state_mapping=[(var, value)]):
                return opt.get_scaled_loss(loss_fn())

        scaled_grad = jax.grad(scaled)(var.value)
    elif BACKEND == "torch":
        import torch

        (scaled_grad,) = torch.autograd.grad(opt.get_scaled_loss(loss_fn()), [var.value])
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            scaled_loss = opt.get_scaled_loss(loss_fn())
        scaled_grad = tape.gradient(scaled_loss, var)
    (grad,) = opt.get_unscaled_gradients([scaled_grad])
    opt.apply_gradients([(grad, var)])
    return [after_minimize, float(ops.convert_to_numpy(var))]


def _values(variables) -> list[np.ndarray]:
    return [np.array(ops.convert_to_numpy(v.value)) for v in variables]


def fit_with_inf_batch(out: str) -> dict:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4, activation="softmax", dtype="float32")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, size=64)
    callback = LossScaleCallback(log_every=1, tensorboard=os.path.join(out, "ls"), health=None,
                                 log_metrics=True, check_alignment=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                            callbacks=[callback, keras.callbacks.TensorBoard(os.path.join(out, "keras_tb"),
                                                                             update_freq="batch")])
    opt = model.optimizer
    assert isinstance(opt, LossScaleOptimizer), type(opt)
    weights, slots, state = _values(model.trainable_variables), _values(opt.inner_optimizer.variables), \
        opt.read_state()
    poisoned = x[:16].copy()
    poisoned[3, 5] = np.inf
    model.fit(poisoned, y[:16], batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    after = opt.read_state()
    result = {
        "optimizer": type(opt).__name__,
        "logged": sorted(k for k in history.history if k.startswith("loss_scale/")),
        "skipped_before": int(state.skipped_steps), "skipped_after": int(after.skipped_steps),
        "steps_after": int(after.steps),
        "scale_before": float(state.scale), "scale_after": float(after.scale),
        "weights_identical": all(np.array_equal(a, b) for a, b in
                                 zip(weights, _values(model.trainable_variables), strict=True)),
        "slots_identical": all(np.array_equal(a, b) for a, b in
                               zip(slots, _values(opt.inner_optimizer.variables), strict=True)),
        "summary": callback.summary,
        "alignment_in_fit": ("report" if hasattr(callback.alignment_report, "to_markdown") else
                             [str(w.message) for w in caught if "check_alignment" in str(w.message)]),
    }
    # Resume: save, load in this process, and the state and the slots come back.
    path = os.path.join(out, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    result["loaded_optimizer"] = type(loaded.optimizer).__name__
    result["loaded_state_equal"] = repr(loaded.optimizer.read_state()._asdict()) == repr(after._asdict())
    loaded_slots = _values(loaded.optimizer.inner_optimizer.variables)
    result["loaded_slots_equal"] = all(np.array_equal(a, b) for a, b in zip(
        _values(opt.inner_optimizer.variables), loaded_slots, strict=True))
    loaded.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0, callbacks=[LossScaleCallback(health=None)])
    result["resumed_steps"] = int(loaded.optimizer.read_state().steps)
    keras.mixed_precision.set_global_policy("float32")
    return result


def jax_data_parallel() -> dict:
    """``keras.distribution.DataParallel`` over the host's CPU devices (XLA_FLAGS gives it two): an
    Inf in the rows of the second device only. The gradients are global arrays, so the flag is too."""
    devices = keras.distribution.list_devices("cpu")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        rng = np.random.default_rng(1)
        x = rng.normal(size=(32, 16)).astype("float32")
        y = rng.normal(size=(32, 4)).astype("float32")
        callback = LossScaleCallback(log_every=1, health=None)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
        inner = model.optimizer.inner_optimizer
        weights, slots = _values(model.trainable_variables), _values(inner.variables)
        poisoned = x[:16].copy()
        poisoned[12, 0] = np.inf  # a row of the second device's shard
        model.fit(poisoned, y[:16], batch_size=16, epochs=1, verbose=0, callbacks=[callback])
        state = model.optimizer.read_state()
        return {"devices": len(devices), "skipped": int(state.skipped_steps), "steps": int(state.steps),
                "weights_identical": all(np.array_equal(a, b) for a, b in
                                         zip(weights, _values(model.trainable_variables), strict=True)),
                "slots_identical": all(np.array_equal(a, b) for a, b in
                                       zip(slots, _values(inner.variables), strict=True)),
                "kernel_sharding": str(model.trainable_variables[0].value.sharding)}
    finally:
        keras.distribution.set_distribution(None)


def jax_eager_loop() -> dict:
    """A custom loop on JAX calling our ``apply`` eagerly (outside ``jit``), an Inf at step 4 of 12: the
    weights and slots are bit-identical to Keras' own AdamW applied eagerly to the unscaled gradients, step 4
    left out by hand; and after the first two steps no step compiles anything (``lax.cond`` called eagerly
    compiled its branches again at every step)."""
    import jax

    compiles = []

    def heard(event: str, *_, **__) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(heard)
    rng = np.random.default_rng(2)
    batches = [(rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32"))
               for _ in range(12)]
    batches[3][0][1, 2] = np.inf

    def net():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(2)])

    def grads_of(model, x, y, scale):
        def loss(values):
            out, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables], x)
            return ops.mean(ops.square(out - y)) * scale
        return jax.grad(loss)([v.value for v in model.trainable_variables])

    ours, stock = net(), net()
    opt = LossScaleOptimizer(keras.optimizers.AdamW(1e-2), policy=None)
    reference = keras.optimizers.AdamW(1e-2)
    reference.build(stock.trainable_variables)
    counted = []
    for step, (x, y) in enumerate(batches, start=1):
        before = len(compiles)
        opt.apply(grads_of(ours, x, y, opt.read_state().scale), ours.trainable_variables)
        counted.append(len(compiles) - before)
        if step != 4:
            reference.apply(grads_of(stock, x, y, 1.0), stock.trainable_variables)
    state = opt.read_state()
    return {"steps": int(state.steps), "skipped": int(state.skipped_steps),
            "compiles_after_step_2": sum(counted[2:]),
            "weights_identical": all(np.array_equal(a, b) for a, b in zip(
                _values(ours.trainable_variables), _values(stock.trainable_variables), strict=True)),
            "slots_identical": all(np.array_equal(a, b) for a, b in zip(
                _values(opt.inner_optimizer.variables), _values(reference.variables), strict=True))}


def one_read() -> dict:
    """``read_state()``: one conversion to NumPy (the stacked state), no variable read; values bit-exact."""
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    opt.build([keras.Variable(np.ones(2, "float32"))])
    steps = 2**31 - 1 if opt.state_variables.steps.dtype == "int32" else 2**40 + 1  # JAX without x64: int32
    opt.assign_state({"scale": 1234.5678, "growth_counter": 7, "skipped_steps": 3, "steps": steps})
    variable_type = type(opt.state_variables.scale)
    counts = {"convert_to_numpy": 0, "variable_reads": 0}
    convert, numpy_of, array_of = ops.convert_to_numpy, variable_type.numpy, variable_type.__array__

    def counting(key, fn):
        def counted(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return counted

    ops.convert_to_numpy = counting("convert_to_numpy", convert)
    variable_type.numpy = counting("variable_reads", numpy_of)
    variable_type.__array__ = counting("variable_reads", array_of)
    try:
        state = opt.read_state()
    finally:
        ops.convert_to_numpy, variable_type.numpy, variable_type.__array__ = convert, numpy_of, array_of
    separately = [np.asarray(ops.convert_to_numpy(v.value)) for v in opt.state_variables]
    return {**counts, "exact": [np.asarray(x).item() for x in state] == [x.item() for x in separately]
            and state.scale.tobytes() == separately[0].tobytes() and int(state.steps) == steps,
            "dtypes": [np.asarray(x).dtype.name for x in state]}


def diagnose() -> str:
    """Overflow forensics: both entry points accept ``diagnose=True`` on every backend."""
    from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer

    said = []
    for make in (lambda: LossScaleCallback(diagnose=True),
                 lambda: LossScaleOptimizer(keras.optimizers.SGD(0.1), diagnose=True)):
        try:
            make()
            said.append("accepted")
        except ValueError as exc:
            said.append(f"ValueError: {exc}")
    return " | ".join(said)


def alignment() -> str:
    from lossscale_callbacks.keras._alignment import check_alignment

    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1001), keras.layers.Dense(10)])
    try:
        report = check_alignment(model)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return f"findings: {len(report.findings)}"


def main() -> None:
    out = sys.argv[1]
    result = {"backend": BACKEND, "conformance_cases": conformance(), "seed": seed_examples(),
              "fit": fit_with_inf_batch(out), "alignment": alignment(),
              "diagnose": diagnose(), "one_read": one_read()}
    if BACKEND == "jax":
        result["data_parallel"] = jax_data_parallel()
        result["eager_loop"] = jax_eager_loop()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
