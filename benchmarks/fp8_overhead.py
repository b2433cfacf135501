"""What watching the fp8 scales costs a training step: torchao's float8 training with ``Fp8ScaleMonitor``, and
a Keras ``fit`` of a model quantized to float8 with ``Fp8ScaleCallback``, each against the run without it.

    python benchmarks/fp8_overhead.py [--rounds 5] [--steps 200] [--width 1024] [--backends jax]
                                      [--tensorboard] [--json out.json] [--quick]

Four arms in one process, made afresh every round in a rotated order (see :func:`alternate`), wall time per
step; the table gives the median of the per-round ratios against ``bare``. Arms: ``bare`` (no monitor),
``monitor`` (the defaults: a read every 100 steps, one counted step in 100), ``every`` (``count_every=1``:
what a counted step costs) and ``bare_again`` (``bare`` once more: the ``A/A`` column, how far two like arms
differ). With ``--tensorboard`` the monitors write to a TensorBoard folder, as users run them (every rebuilt
step's amax and scale of delayed scaling goes to the dashboard at each read). The torchao arm is an MLP of
``Float8Linear`` layers (``tensorwise``) in a plain loop; each Keras backend named runs in a process of its
own (Keras picks its backend at import), an MLP of fp8 ``Dense`` layers in ``fit``, timed from the first
batch's end to the last's (the start and the end of a ``fit``, where the callback reads the histories once and
writes the summary, are left out: a run of thousands of steps amortizes them). Target: ``monitor`` / ``bare``
<= 1.02.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from _quick import parse_args

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Wall time by default; ``--cpu`` (process CPU time, every thread's) sets this to ``time.process_time``.
_CLOCK = time.perf_counter

ARMS = {"bare": None, "monitor": 100, "every": 1, "bare_again": None}


def alternate(rounds: int, make: Callable[[tuple[str, ...]], dict[str, Callable[[], float]]]
              ) -> dict[str, list[float]]:
    """Per arm, the seconds per step of each round. Every round makes the arms afresh (``make``, in a
    rotated order), runs each once untimed (a warm-up: Keras compiles its train function), then times each
    once: two arms made alike differ by a few % by where their buffers lie, which a single set of arms
    would measure (``bare_again`` shows what is left)."""
    names = tuple(ARMS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        arms = make(order)
        for name in order:
            arms[name]()
        for name in order:
            times[name].append(arms[name]())
    return times


def _logging(tensorboard: bool) -> dict:
    """The monitors' logging arguments: no sink, or a TensorBoard folder (as a user runs them)."""
    import tempfile

    return {"health": None, "echo": None, **({"tensorboard": tempfile.mkdtemp()} if tensorboard else {})}


def torchao_rounds(rounds: int, steps: int, width: int, tensorboard: bool = False) -> dict[str, list[float]]:
    import torch
    from torchao.float8 import convert_to_float8_training

    from lossscale_callbacks.torch import Fp8ScaleMonitor

    torch.manual_seed(0)
    x = torch.randn(256, width)

    def arm(count_every: int | None) -> Callable[[], float]:
        net = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                                  torch.nn.Linear(2 * width, width))
        convert_to_float8_training(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
        monitor = (None if count_every is None else
                   Fp8ScaleMonitor(net, log_every=100, count_every=count_every, **_logging(tensorboard)))

        def run() -> float:
            start = _CLOCK()
            for _ in range(steps):
                net(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if monitor is not None:
                    monitor.step()
            return (_CLOCK() - start) / steps
        return run

    return alternate(rounds, lambda order: {name: arm(ARMS[name]) for name in order})


def keras_rounds(rounds: int, steps: int, width: int, tensorboard: bool = False) -> dict[str, list[float]]:
    import keras
    import numpy as np

    from lossscale_callbacks.keras import Fp8ScaleCallback

    class StepTimer(keras.callbacks.Callback):
        """The steps of a fit from the first batch's end to the last's: the fit's own start and end (the
        callback's first read of the histories, the summary) are left out, as a long run amortizes them."""

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            now = _CLOCK()
            if batch == 0:
                self.first, self.batches = now, 0
            self.last, self.batches = now, batch

        def per_step(self) -> float:
            return (self.last - self.first) / max(self.batches, 1)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 128, width)).astype("float32")
    y = rng.normal(size=(steps * 128, 1)).astype("float32")

    def arm(count_every: int | None) -> Callable[[], float]:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)])
        model.quantize("float8")
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        timer = StepTimer()
        callbacks = ([] if count_every is None else
                     [Fp8ScaleCallback(log_every=100, count_every=count_every, **_logging(tensorboard))])

        def run() -> float:
            model.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0, callbacks=[*callbacks, timer])
            return timer.per_step()
        return run

    return alternate(rounds, lambda order: {name: arm(ARMS[name]) for name in order})


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    out = {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in ARMS}
    for name in ("monitor", "every", "bare_again"):
        ratios = (a / b for a, b in zip(times[name], times["bare"], strict=True))
        out[f"{name}/bare"] = statistics.median(ratios)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps per arm and round")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--backends", default="jax", help="Keras backends, comma-separated ('' for none)")
    parser.add_argument("--tensorboard", action="store_true", help="the monitors write to TensorBoard")
    parser.add_argument("--cpu", action="store_true", help="process CPU time (all threads), not wall time")
    parser.add_argument("--keras-here", action="store_true", help="this process's Keras backend only")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parse_args(parser, argv, rounds=2, steps=5, width=64)
    if args.cpu:
        global _CLOCK
        _CLOCK = time.process_time
    if args.keras_here:
        results = {"here": summarize(keras_rounds(args.rounds, args.steps, args.width, args.tensorboard))}
        with open(args.json, "w") as f:
            json.dump(results, f)
        return
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in ("tensorflow", "jax", "torch")]
    if unknown:
        parser.error(f"--backends must name some of tensorflow, jax, torch, got {args.backends!r}")
    results = {"torchao_tensorwise": summarize(torchao_rounds(args.rounds, args.steps, args.width,
                                                              args.tensorboard))}
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "here.json")
            command = [sys.executable, os.path.abspath(__file__), "--keras-here",
                       "--rounds", str(args.rounds), "--steps", str(args.steps), "--width", str(args.width),
                       "--json", out, *(["--tensorboard"] if args.tensorboard else []),
                       *(["--cpu"] if args.cpu else []),
                       *(["--quick"] if args.quick else [])]
            subprocess.run(command, env=dict(os.environ, KERAS_BACKEND=backend), check=True,
                           stdout=subprocess.DEVNULL)
            with open(out) as f:
                results[f"keras_fit_{backend}"] = json.load(f)["here"]
    print(f"{os.cpu_count()} CPU cores, {args.rounds} alternating rounds of {args.steps} steps, "
          f"width {args.width}\n")
    print(f"{'setup':<20} {'bare ms':>9} {'monitor ms':>11} {'every ms':>9} {'monitor/bare':>13} "
          f"{'every/bare':>11} {'A/A':>6}")
    for name, r in results.items():
        print(f"{name:<20} {r['bare_ms']:>9.3f} {r['monitor_ms']:>11.3f} {r['every_ms']:>9.3f} "
              f"{r['monitor/bare']:>13.3f} {r['every/bare']:>11.3f} {r['bare_again/bare']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
