"""How often ``fit`` syncs the model's variables back from JAX's state with ``LossScaleCallback`` on.

Run by ``tests/test_keras_backends.py`` under JAX in its own process; prints one JSON line. On JAX, ``fit``
keeps the variables in its own state; reading ``Callback.model`` syncs all of them back (and ``fit`` then
re-reads them all at the next step). A callback that looked at ``self.model`` at every batch cost 10 % of
a small model's step; ours may sync only where it reads the state: at the log interval and at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

import keras
import numpy as np

from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer

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
        count += 1
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


if __name__ == "__main__":
    keras.mixed_precision.set_global_policy("mixed_float16")
    result = {"steps": STEPS, "log_every": LOG_EVERY, "null": syncs(NullBatchEnd())}
    for diagnose in (False, True):
        result[f"ours_diagnose_{diagnose}"] = syncs(LossScaleCallback(log_every=LOG_EVERY, diagnose=diagnose,
                                                                     health=None))
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
