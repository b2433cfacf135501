"""The Keras precision audit and its keep list on one Keras backend; prints one JSON line of results.

Run by ``tests/test_keras_audit.py`` once per backend, each in its own process. The known-answer models
of ``trace_checks.py``: the audit of the T5-style block and of the attention model (float32 models)
names a verified keep list; with it applied under ``mixed_float16``, ``fit`` with ``LossScaleCallback``
ends finite and near the float32 run's final loss; the advised starting scale is compared with where the
dynamic scale settles in 500 steps; the MLP that fits gets no keep list.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trace_checks import BACKEND, attention_model, fits_model, t5_model

from lossscale_callbacks._policy import DynamicPolicy
from lossscale_callbacks.keras import audit_keras_precision, keep_keras_layers_in_float32
from lossscale_callbacks.keras._callback import LossScaleCallback

STEPS = 300


def fresh(policy: str) -> None:
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(policy)


def data(shape: tuple[int, ...], count: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.uniform(0.5, 1.0, (count, *shape)).astype("float32")
    return x, (x.reshape(count, -1).mean(axis=1, keepdims=True) * 2.0 - 1.0).astype("float32")


def train(make, shape, keep=None, steps: int = STEPS, initial_scale: float | None = None) -> dict:
    """``steps`` Adam steps of a fresh model, float32 (``keep is None``) or mixed_float16 with ``keep``
    (from ``initial_scale``, default 2^15); the final loss is ``evaluate`` on held-out batches."""
    fresh("float32" if keep is None else "mixed_float16")
    model = make()
    callbacks = []
    if keep is not None:
        keep_keras_layers_in_float32(model, keep)
        policy = DynamicPolicy(initial_scale=initial_scale) if initial_scale else None
        callbacks = [LossScaleCallback(log_every=10_000, health=None, policy=policy)]
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x, y = data(shape, steps * 4 + 64)
    model.fit(x[:-64], y[:-64], batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
    out = {"loss": float(model.evaluate(x[-64:], y[-64:], batch_size=64, verbose=0))}
    if callbacks:
        state = callbacks[0].optimizer.read_state()
        out.update(scale=float(state.scale), skipped=int(state.skipped_steps))
    return out


def audit(make, shape) -> dict:
    fresh("float32")
    model = make()
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x, y = data(shape, 16)
    result = audit_keras_precision(model, [(x[:8], y[:8]), (x[8:], y[8:])])
    advice = result.advice
    return {"fits": advice.fits, "keep": list(advice.keep_float32), "verified": result.verified,
            "initial_scale": advice.initial_scale, "growth_interval": advice.growth_interval,
            "markdown": result.markdown(),
            "policies": sorted({layer.dtype_policy.name for layer in model.layers})}


def main() -> None:
    t5 = lambda: t5_model(2e4)  # noqa: E731
    attention = lambda: attention_model(20.0)  # noqa: E731
    result = {"backend": BACKEND}
    for name, make, shape in (("t5", t5, (8,)), ("attention", attention, (4, 8)), ("fits", fits_model, (8,))):
        found = audit(make, shape)
        entry = {"audit": found}
        if found["keep"]:
            entry["float32"] = train(make, shape)
            entry["kept"] = train(make, shape, found["keep"], initial_scale=found["initial_scale"])
            entry["unkept"] = train(make, shape, [], steps=5)
        result[name] = entry
    # saved models for the command line: the T5-style block (and its samples) and the MLP that fits
    out = sys.argv[1]
    for name, make, shape in (("t5", t5, (8,)), ("fits", fits_model, (8,))):
        fresh("float32")
        model = make()
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        model.save(os.path.join(out, f"{name}.keras"))
        x, y = data(shape, 16)
        np.savez(os.path.join(out, f"{name}.npz"), x=x, y=y)
    # where the dynamic scale settles with the keep list, against the advised starting scale
    result["t5"]["settled"] = train(t5, (8,), result["t5"]["audit"]["keep"], steps=500)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
