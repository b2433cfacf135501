"""How often ``fit`` syncs the model's variables back from JAX's state with ``LossScaleCallback`` on.

Run by ``tests/test_keras_backends.py`` under JAX in its own process; prints one JSON line. On JAX, ``fit``
keeps the variables in its own state; reading ``Callback.model`` syncs all of them back (and ``fit`` then
re-reads them all at the next step). A callback that looked at ``self.model`` at every batch cost 10 % of
a small model's step. Ours syncs nowhere at its reads: the live state is lent to the variables it reads
(``lossscale_callbacks.keras._variable_reads``); ``lent_equals_synced`` says whether reading and assigning a
variable that way gives bit for bit what reading and assigning it after a sync gives.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

import keras
import numpy as np

from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer
from lossscale_callbacks.keras._variable_reads import LiveVariables

STEPS, LOG_EVERY = 250, 100


class NullBatchEnd(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


def syncs(callback: keras.callbacks.Callback) -> int:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    count = 0
    original = type(model).jax_state_sync

    def counted(self):
        nonlocal count
        count += not self._jax_state_synced  # a sync that assigns (a call on a synced state returns at once)
        return original(self)

    x = np.ones((STEPS * 4, 8), "float32")
    y = np.ones((STEPS * 4, 1), "float32")
    type(model).jax_state_sync = counted
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    finally:
        type(model).jax_state_sync = original
    return count


class Poke(keras.callbacks.Callback):
    """Every 50 batches: read a kernel, the bias after it and the optimizer's iterations, and halve the
    kernel; through a lent state (``how`` "some": those variables, "all": every one) or after a sync."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.live, self.seen = how, LiveVariables(), []

    def on_train_batch_end(self, batch, logs=None):
        if batch % 50 != 49:
            return
        model = self._model  # not self.model: that syncs
        dense = model.layers[0]
        targets = [dense.kernel, dense.bias, model.optimizer.iterations]
        if self.how == "sync":
            model.jax_state_sync()
            block = contextlib.nullcontext()
        else:
            block = self.live.lent(model, None if self.how == "all" else targets)
        with block:
            self.seen.append([np.asarray(v.value).copy() for v in targets])
            dense.kernel.assign(dense.kernel.value * 0.5)


def poked(how: str) -> list[np.ndarray]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(STEPS * 4, 8)).astype("float32")
    poke = Poke(how)
    model.fit(x, x[:, :1], batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[poke])
    return [a for seen in poke.seen for a in seen] + [np.asarray(w) for w in model.get_weights()]


def bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


if __name__ == "__main__":
    synced = poked("sync")
    lent = {how: bitwise_equal(synced, poked(how)) for how in ("some", "all")}
    keras.mixed_precision.set_global_policy("mixed_float16")
    result = {"steps": STEPS, "log_every": LOG_EVERY, "null": syncs(NullBatchEnd()),
              "lent_equals_synced": lent, "pokes": len(synced)}
    for diagnose in (False, True):
        result[f"ours_diagnose_{diagnose}"] = syncs(LossScaleCallback(log_every=LOG_EVERY, diagnose=diagnose,
                                                                     health=None))
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
