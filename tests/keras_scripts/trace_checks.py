"""The forward trace of ``LossScaleCallback(diagnose=...)`` on one Keras backend; prints one JSON line.

Run by ``tests/test_keras_trace.py`` once per backend, each in its own process (Keras picks its backend
at import): ``KERAS_BACKEND=jax python trace_checks.py OUT_DIR``. Known-answer models under
``mixed_float16`` (real float16 compute on the CPU), built with constant weights so the answer is fixed:

- ``dense``: a frozen ``Dense`` (``grow``, kernel of ones) fed ``t * 1000`` at step ``t - 1``: its output
  ``4000 t`` crosses 65504 at step 16; a ``LayerNormalization`` and the head pass the Inf on as NaN.
  Traced every step, and every 5th step (step 16 is not traced: the skip arms a trace of step 17).
- ``t5``: a T5-style feed-forward block, ``wi`` (ReLU) then ``wo``, whose output overflows float16; the
  residual ``add`` and the ``norm`` after it turn it into NaN: the producer is ``wo``.
- ``attention``: a ``MultiHeadAttention`` whose scores overflow before the softmax: the producer is
  ``attn`` (its sublayers' inputs were already non-finite, or computed inside it).
- ``fits``: a small MLP that fits float16: no producer, every traced layer finite.
"""

from __future__ import annotations

import json
import math
import os
import sys

import keras
import numpy as np

from lossscale_callbacks.keras._callback import LossScaleCallback
from lossscale_callbacks.keras._forward_trace import activation_arguments

BACKEND = keras.backend.backend()


def fresh() -> None:
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")


def dense_model() -> keras.Model:
    inputs = keras.Input((4,))
    grow = keras.layers.Dense(8, use_bias=False, trainable=False, name="grow")
    hidden = keras.layers.LayerNormalization(name="norm")(grow(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    grow.set_weights([np.ones((4, 1), "float32") * np.arange(1, 9, dtype="float32") / 8])  # max column: 1
    return model


def dense_data(steps: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(1, steps + 1, dtype="float32")[:, None] * 1000.0 * np.ones((1, 4), "float32")
    return x, np.zeros((steps, 1), "float32")


def t5_model(blow_up: float) -> keras.Model:
    inputs = keras.Input((8,))
    wi = keras.layers.Dense(16, activation="relu", name="wi")
    wo = keras.layers.Dense(8, name="wo")
    hidden = keras.layers.Add(name="add")([inputs, wo(wi(inputs))])
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    rng = np.random.default_rng(2)
    wi.set_weights([np.full((8, 16), 0.1, "float32"), np.zeros(16, "float32")])
    wo.set_weights([rng.uniform(0.5, 1.0, (16, 8)).astype("float32") * blow_up, np.zeros(8, "float32")])
    return model


class SelfAttention(keras.layers.Layer):
    """Single-head self-attention with its scores computed inside it (as in ``MultiHeadAttention``)."""

    def __init__(self, units: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.units = units
        self.query, self.key, self.value = (keras.layers.Dense(units, name=n)
                                            for n in ("query", "key", "value"))
        self.softmax = keras.layers.Softmax(name="softmax")

    def build(self, shape) -> None:
        for dense in (self.query, self.key, self.value):
            dense.build(shape)

    def call(self, x):
        from keras import ops

        scores = ops.matmul(self.query(x), ops.transpose(self.key(x), (0, 2, 1))) / float(np.sqrt(self.units))
        return ops.matmul(self.softmax(scores), self.value(x))


def attention_model(blow_up: float) -> keras.Model:
    inputs = keras.Input((4, 8))
    attn = SelfAttention(8, name="attn")
    hidden = keras.layers.Flatten(name="flat")(attn(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    rng = np.random.default_rng(1)
    # large query and key weights: the scores overflow; the values stay small, so the model trains
    for dense, factor in ((attn.query, blow_up), (attn.key, blow_up), (attn.value, 1.0)):
        dense.set_weights([rng.uniform(0.5, 1.0, (8, 8)).astype("float32") * factor, np.zeros(8, "float32")])
    return model


def fits_model() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
                             keras.layers.Dense(1, name="out")])


def plain(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


class _Intervals(LossScaleCallback):
    """Keeps every interval's forward trace (batch 0 is an interval of its own)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.intervals = []

    def _forensics(self, state):
        forensics = super()._forensics(state)
        self.intervals.append(activation_arguments(self.forward_trace))
        return forensics


def run(model: keras.Model, x: np.ndarray, y: np.ndarray, diagnose: bool | str = "every_step",
        trace_every: int = 100) -> dict:
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    callback = _Intervals(log_every=10_000, diagnose=diagnose, trace_every=trace_every, health=None)
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[callback])
    # the interval of the first producer, else the last
    args = next((a for a in callback.intervals if a["producer"]), callback.intervals[-1])
    return {"layers": list(args["layers"]), "steps": list(args["steps"]),
            "maxima": [[plain(float(v)) for v in row] for row in args["maxima"]],
            "producer": args["producer"], "producer_step": args["producer_step"],
            "passed_on": list(args["passed_on"]), "producer_counts": args["producer_counts"],
            "traced": args["traced"], "dtype": args["dtype"],
            "armed": bool(callback.forward_trace["first_armed"][0]), "intervals": len(callback.intervals),
            "traced_total": sum(a["traced"] for a in callback.intervals),
            "skipped": int(callback.optimizer.read_state().skipped_steps)}


def cases() -> dict:
    out = {}
    fresh()
    out["dense"] = run(dense_model(), *dense_data(20))
    fresh()
    out["dense_every_5"] = run(dense_model(), *dense_data(20), diagnose=True, trace_every=5)
    rng = np.random.default_rng(0)
    fresh()
    out["t5"] = run(t5_model(2e4), rng.uniform(0.5, 1.0, (6, 8)).astype("float32"),
                    np.ones((6, 1), "float32"))
    fresh()
    out["attention"] = run(attention_model(20.0), rng.uniform(0.5, 1.0, (6, 4, 8)).astype("float32"),
                           np.ones((6, 1), "float32"))
    fresh()
    out["fits"] = run(fits_model(), rng.normal(size=(12, 8)).astype("float32"),
                      rng.normal(size=(12, 1)).astype("float32"), diagnose=True, trace_every=3)
    return out


def dashboards(out: str) -> dict:
    """The T5-style block with TensorBoard and an offline W&B run: the files are read back by the test."""
    fresh()
    model = t5_model(2e4)
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    tensorboard = os.path.join(out, "tb")
    wandb = {"dir": out, "project": "lossscale-trace", "mode": "offline"}
    callback = LossScaleCallback(log_every=2, diagnose=True, trace_every=5, health="warn",
                                 tensorboard=tensorboard, wandb=wandb)
    rng = np.random.default_rng(0)
    model.fit(rng.uniform(0.5, 1.0, (6, 8)).astype("float32"), np.ones((6, 1), "float32"), batch_size=1,
              verbose=0, callbacks=[callback])
    return {"summary": callback.summary, "tensorboard": tensorboard, "wandb": os.path.join(out, "wandb")}


def torch_host_reads() -> dict:
    """The library's host reads in ``fit`` with the trace on every step and without forensics, for two
    run lengths: the difference must not grow with the steps (the trace reads only at the interval)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_scripts.host_reads import HostReadCounter

    import lossscale_callbacks
    import lossscale_callbacks.keras

    here = tuple(os.path.dirname(m.__file__) for m in (lossscale_callbacks, lossscale_callbacks.keras))
    reads = {}
    for steps in (4, 8):
        for diagnose in (False, "every_step"):
            fresh()
            model = fits_model()
            model.compile(keras.optimizers.SGD(1e-3), "mse")
            callback = LossScaleCallback(log_every=10_000, diagnose=diagnose, health=None)
            x = np.ones((steps, 8), "float32")
            with HostReadCounter(only_under=here) as counter:
                model.fit(x, x[:, :1], batch_size=1, verbose=0, callbacks=[callback])
            reads[f"{steps}/{diagnose}"] = len(counter.reads)
    return reads


def schedule() -> dict:
    """What the trace puts in ``fit``'s steps at its default schedule (one traced step in 100): calls of the
    trace's device code (made while a step is traced: once per compiled train function on TensorFlow and
    JAX, once per traced step on torch) and the ``cond``s the trace module made; and the traced steps."""
    import keras.ops as kops

    from lossscale_callbacks.keras import _forward_device, _forward_trace

    calls = {"step_vector": 0, "fold": 0, "cond": 0}
    originals = {name: getattr(_forward_device, name) for name in ("step_vector", "fold")}
    original_cond = kops.cond

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    def cond(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename == _forward_trace.__file__:
            calls["cond"] += 1
        return original_cond(*args, **kwargs)

    fresh()
    model = fits_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    callback = _Intervals(log_every=10_000, diagnose=True, trace_every=100, health=None)
    x = np.ones((250, 8), "float32")
    for name in originals:
        setattr(_forward_device, name, counted(name))
    kops.cond = cond
    try:
        model.fit(x, x[:, :1], batch_size=1, verbose=0, callbacks=[callback])
    finally:
        for name, function in originals.items():
            setattr(_forward_device, name, function)
        kops.cond = original_cond
    return {**calls, "traced": sum(interval["traced"] for interval in callback.intervals)}


def main() -> None:
    result = {"backend": BACKEND, "cases": cases(), "dashboards": dashboards(sys.argv[1]),
              "schedule": schedule()}
    if BACKEND == "torch":
        result["host_reads"] = torch_host_reads()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
