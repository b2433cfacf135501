"""Keras 3 quickstart: mixed_float16 training with the loss scale on TensorBoard, W&B and in the logs.

Runs on a laptop CPU in a few seconds:

    python examples/keras_quickstart.py
    .venv/bin/tensorboard --logdir runs             # the "Loss scale" section of Custom Scalars

A small regression model trains on synthetic data under ``mixed_float16``. Its targets are
large, so with the default initial scale of 2**15 the float16 gradients overflow: the
callback skips those steps, backs the scale off until they fit, and grows it again after
``growth_interval`` clean steps. The scale and the skipped steps go to Keras' progress bar
(``log_metrics=`` puts chosen metrics into History and CSVLogger too), every metric to
TensorBoard and to an offline W&B run under ``runs/``. ``diagnose=True`` adds the
overflow forensics, one sentence per finding: why steps were skipped, the layer where the overflow
started (and how often), the flagged layers as a table, and the largest scaled gradient against
float16's maximum. The sinks get the same words (TensorBoard's Text tab), per-layer counts and a
histogram of the scaled gradients. It works the same on ``KERAS_BACKEND=jax`` or ``torch``.

Last, the precision audit (what to do when no loss scale helps): a T5-style block whose ``wo`` outgrew
float16, audited on one sample batch before training it in float16: which layers to keep in float32 and
which scale to start at.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import numpy as np

from lossscale_callbacks._cli import quiet_native_stderr

# TensorFlow's C++ start-up lines ("All log messages before absl::InitializeLog() ...", oneDNN, CPU
# features) go to file descriptor 2 whatever TF_CPP_MIN_LOG_LEVEL says: silenced while Keras and its
# backend load, as the report and check commands do. Python's own errors still show.
with quiet_native_stderr():
    import keras

    from lossscale_callbacks import DynamicPolicy, InMemorySink
    from lossscale_callbacks.keras import LossScaleCallback, audit_keras_precision


def make_data(n: int = 4096, features: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (200.0 * np.tanh(x @ w)).astype("float32")  # large targets: large gradients at a high scale
    return x, y


def t5_block() -> keras.Model:
    """A T5-style feed-forward block whose ``wo`` outputs exceed 65504 (as bf16-pretrained ones do)."""
    x = keras.Input((8,))
    wo = keras.layers.Dense(8, name="wo", kernel_initializer=keras.initializers.Constant(3e4))
    h = keras.layers.Add(name="add")([x, wo(keras.layers.Dense(16, "relu", name="wi")(x))])
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(x, keras.layers.Dense(1, name="head")(h))


def audit() -> None:
    keras.mixed_precision.set_global_policy("float32")  # the reference the audit compares float16 with
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (32, 8)).astype("float32")
    block = t5_block()
    block.compile(optimizer="adam", loss="mse")
    result = audit_keras_precision(block, [(x, x.mean(axis=1, keepdims=True))])
    print("\nPrecision audit of a T5-style block (lossscale_callbacks.keras.audit_keras_precision):")
    for sentence in result.advice.sentences():
        print(f"  {sentence}")


def main() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    os.makedirs("runs", exist_ok=True)
    x, y = make_data()
    model = keras.Sequential([
        keras.Input((x.shape[1],)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(1, dtype="float32"),  # keep the output (and the loss) in float32
    ])
    model.compile(optimizer="adam", loss="mse")  # Keras wraps Adam in its own LossScaleOptimizer

    trajectory = InMemorySink()
    callback = LossScaleCallback(
        log_every=8,
        policy=DynamicPolicy(initial_scale=2.0**15, growth_interval=32),
        tensorboard="runs/keras_quickstart",
        wandb={"project": "lossscale-callbacks-demo", "dir": "runs", "mode": "offline"},
        sinks=[trajectory],
        diagnose=True,  # overflow forensics: which layer overflowed, and why (no host read per step)
        headroom_every=64,
    )
    # The progress bar shows the scale and the skipped steps; the sinks get every metric.
    model.fit(x, y, batch_size=64, epochs=4, verbose=1, callbacks=[callback])

    print("\nLoss-scale trajectory (optimizer step: scale, skipped so far):")
    skipped = dict(trajectory.series("loss_scale/skipped_steps"))
    last = None
    for step, scale in trajectory.series("loss_scale/scale"):
        if scale != last:
            print(f"  step {step:4d}: 2^{math.log2(scale):4.1f} = {scale:8g}   skipped {int(skipped[step])}")
            last = scale
    print("TensorBoard: .venv/bin/tensorboard --logdir runs   (then open the Custom Scalars tab)")
    print("Report:      .venv/bin/lossscale-callbacks report runs")
    print("W&B:         .venv/bin/wandb sync runs/wandb/offline-run-*")
    audit()


if __name__ == "__main__":
    main()
