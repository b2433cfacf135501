"""Overhead of lossscale-callbacks in Keras 3 ``fit``: ours vs ``keras.optimizers.LossScaleOptimizer``.

    python benchmarks/keras_overhead.py [--rounds 7] [--steps 300] [--quick]
    KERAS_BACKEND=jax python benchmarks/keras_overhead.py      # or torch: any Keras 3 backend

Four arms train the same mixed_float16 MLP (same initial weights, same data) in one process:

* ``keras``    ``keras.optimizers.LossScaleOptimizer(Adam)``: the baseline;
* ``ours``     ``lossscale_callbacks.keras.LossScaleOptimizer(Adam)``;
* ``ours+cb``  ours plus ``LossScaleCallback(log_every=100)``;
* ``ours+null`` ours plus a callback whose ``on_train_batch_end`` does nothing: what Keras itself
  charges for any callback with a batch-end hook (it then converts ``logs`` to Python numbers
  after every step, a host sync, and stops dispatching batch ends asynchronously).

Each round runs every arm for ``--steps`` steps of one ``fit`` call (traced beforehand), in an
order that alternates between rounds, and times it twice: wall clock (``time.perf_counter``)
and the CPU time of this process (``time.process_time``, all of TensorFlow's threads), which
other processes on a shared machine disturb much less. The table gives the median time per
step, the median over rounds of the per-round ratios (ours/keras and ours+cb/ours), which
cancels slow drifts, and the ratio of the fastest rounds (the least disturbed ones). The
callback's end-of-fit summary is silenced while timing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
from _quick import parse_args

from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer


def build(width: int, features: int, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    args = parse_args(parser, argv, rounds=2, steps=5, width=32, batch=16)
    if args.rounds < 5 and not args.quick:
        parser.error("--rounds must be >= 5")

    keras.mixed_precision.set_global_policy("mixed_float16")
    features = 64
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 16, features)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch * 16,))
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(4)
        versions = f"TensorFlow {tf.__version__}"
    else:
        # The same batches as NumPy arrays (Keras' array adapter): enough for the longest fit.
        repeats = -(-args.steps * args.batch // len(x))
        data = (np.concatenate([x] * repeats), np.concatenate([y] * repeats))
        module = __import__(backend)
        versions = f"{backend} {module.__version__}"
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    arms: dict[str, tuple[keras.Model, list[keras.callbacks.Callback]]] = {}
    class NullBatchEnd(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    for name in ("keras", "ours", "ours+cb", "ours+null"):
        model = build(args.width, features)
        inner = keras.optimizers.Adam(1e-3)
        if name == "keras":
            optimizer = keras.optimizers.LossScaleOptimizer(inner)
        else:
            optimizer = LossScaleOptimizer(inner)
        model.compile(optimizer=optimizer, loss=loss)
        callbacks = {"ours+cb": [LossScaleCallback(log_every=100, health=None)],
                     "ours+null": [NullBatchEnd()]}.get(name, [])
        arms[name] = (model, callbacks)

    def run(name: str, steps: int) -> tuple[float, float]:
        model, callbacks = arms[name]
        with contextlib.redirect_stdout(io.StringIO()):
            wall, cpu = time.perf_counter(), time.process_time()
            if isinstance(data, tuple):
                model.fit(data[0][:steps * args.batch], data[1][:steps * args.batch], batch_size=args.batch,
                          epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
            else:
                model.fit(data, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                          callbacks=callbacks)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall / steps, cpu / steps

    for name in arms:  # trace and warm up
        run(name, 20)

    walls: dict[str, list[float]] = {name: [] for name in arms}
    cpus: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else reversed(order):
            wall, cpu = run(name, args.steps)
            walls[name].append(wall)
            cpus[name].append(cpu)

    def ratios(times: dict[str, list[float]], a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(times[a], times[b], strict=True)]

    print(f"\nKeras {keras.__version__} on {versions}, {os.cpu_count()} CPU cores; MLP "
          f"{features}->{args.width}x3->10, batch {args.batch}, mixed_float16, {args.rounds} rounds x "
          f"{args.steps} steps\n")
    print(f"{'arm':<10} {'wall ms/step':>13} {'steps/s':>9} {'CPU ms/step':>12}")
    for name in arms:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        print(f"{name:<10} {wall * 1e3:>13.3f} {1.0 / wall:>9.1f} {cpu * 1e3:>12.3f}")
    print()
    print(f"{'ratio':<40} {'median of per-round':>20} {'of the fastest round':>21}")
    print(f"{'':<40} {'wall':>9} {'CPU':>10} {'wall':>10} {'CPU':>10}")
    comparisons = (("ours / keras LossScaleOptimizer", "ours", "keras"),
                   ("ours + LossScaleCallback(100) / ours", "ours+cb", "ours"),
                   ("ours + empty batch-end callback / ours", "ours+null", "ours"),
                   ("ours + LossScaleCallback / ours + empty", "ours+cb", "ours+null"))
    for label, a, b in comparisons:
        wall, cpu = ratios(walls, a, b), ratios(cpus, a, b)
        best_wall, best_cpu = min(walls[a]) / min(walls[b]), min(cpus[a]) / min(cpus[b])
        print(f"{label:<40} {statistics.median(wall):>9.3f} {statistics.median(cpu):>10.3f} "
              f"{best_wall:>10.3f} {best_cpu:>10.3f}")
    # The callback's own host work, timed directly (immune to other processes' noise): the
    # batch-end hook on a batch that does not log, and one log (state read + metrics + sinks).
    callback = arms["ours+cb"][1][0]
    n = 20000
    callback.on_train_batch_end(1, {})  # the timed calls below then cross no multiple of log_every
    start = time.perf_counter()
    for _ in range(n):
        callback.on_train_batch_end(1, {})
    hook = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for i in range(200):  # each call reaches the next multiple of log_every: one state read
        callback.on_train_batch_end(callback.log_every * (i + 1), {})
    log = (time.perf_counter() - start) / 200
    per_step = hook + log / 100
    step = statistics.median(walls["ours"])
    print(f"\nLossScaleCallback host work: {hook * 1e6:.2f} us per batch, {log * 1e6:.0f} us per log (state "
          f"read); with log_every=100: {per_step * 1e6:.2f} us per step = {per_step / step:.4%} of a "
          f"{step * 1e3:.2f} ms step (Keras' own per-callback cost is the 'empty batch-end' row)")
    print("\nper-round wall ratios (a shared machine shows here):")
    for label, a, b in comparisons[:2]:
        print(f"  {label}: " + " ".join(f"{v:.2f}" for v in ratios(walls, a, b)))

if __name__ == "__main__":
    main()
