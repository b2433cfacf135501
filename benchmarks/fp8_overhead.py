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
own (Keras picks its backend at import), an MLP of fp8 ``Dense`` layers in ``fit`` (``--steps`` + 1 steps),
timed from the first batch's start to the fit's end once every step is done, by a callback with no batch-end
hook (one would make Keras wait for every step on JAX and torch, in every arm). The start and the end of a
``fit``, where the callback reads the histories once and writes the summary, are left out: a run of thousands
of steps amortizes them. The monitors run with their default rules. Target: ``monitor`` / ``bare`` <= 1.02.

Two arms made alike differ by a few % on this machine (the ``A/A`` column), more than the target allows, so
each Keras backend's cost is also measured by its parts, each with a tighter measure:

* ``graph``: what the model's steps cost with the callback's train functions against the step without its
  identities, timed in **one** ``fit`` of **one** watched model that switches between them in blocks of
  ``COUNT_EVERY`` steps, a ``bare`` block (traced with the layers unwatched) and a ``monitored`` block (the
  callback's sequence: its ordinary function, one counted step), in a shuffled order per cycle: the same
  buffers, the same moment, so the layout noise between arms drops out; the median of the cycles' ratios.
  ``carried`` and ``counted`` are the ordinary and the counted step alone against the bare one (medians);
* ``hooks``: the callback's own host work (its batch hooks, the reads at ``log_every`` among them), timed on
  the main thread (``time.thread_time``: the step's own threads are not counted) in the ``monitor`` arm, over
  the ``bare`` arm's step;
* ``parts``: ``graph + hooks``, the cost these add up to.
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
from typing import Any

from _quick import parse_args

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Wall time by default; ``--cpu`` (process CPU time, every thread's) sets this to ``time.process_time``.
_CLOCK = time.perf_counter

ARMS = {"bare": None, "monitor": 100, "every": 1, "bare_again": None}
COUNT_EVERY = 100  # the monitor arm's count_every (ARMS["monitor"])


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
    """The monitors' logging arguments: their default rules (``"warn"``), no printing, and no sink or a
    TensorBoard folder (as a user runs them)."""
    import tempfile

    return {"echo": None, **({"tensorboard": tempfile.mkdtemp()} if tensorboard else {})}


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
        """The steps of a fit from the first batch's start to the fit's end, after Keras has waited for
        every step (its ``on_train_end``; first in the list, before the monitor's last read and summary).
        No batch-end hook: one would make Keras on JAX and torch wait for every step's logs (about 15 % of
        this step on JAX), in every arm alike, and hide what a monitor that makes it wait costs."""

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if batch == 0:
                self.first, self.batches = _CLOCK(), 0
            self.batches += 1

        def on_train_end(self, logs: dict | None = None) -> None:
            self.last = _CLOCK()

        def per_step(self) -> float:
            return (self.last - self.first) / max(self.batches, 1)

    # One step more than ``steps``: the read after an interval's last step runs when the next step starts,
    # so the read after step ``steps`` is timed too (a read every 100 steps, as in a long run).
    rng = np.random.default_rng(0)
    x = rng.normal(size=((steps + 1) * 128, width)).astype("float32")
    y = rng.normal(size=((steps + 1) * 128, 1)).astype("float32")

    def arm(count_every: int | None, hooks: list[float] | None = None) -> Callable[[], float]:
        model = _fp8_model(keras, width)
        timer = StepTimer()
        callbacks = ([] if count_every is None else
                     [Fp8ScaleCallback(log_every=100, count_every=count_every, **_logging(tensorboard))])
        spent = _time_hooks(callbacks[0]) if callbacks and hooks is not None else None

        def run() -> float:
            before = spent[0] if spent is not None else 0.0
            model.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0, callbacks=[timer, *callbacks])
            if spent is not None:  # the last call is the timed one (alternate's warm-up comes first)
                hooks.append((spent[0] - before) / (steps + 1))
            return timer.per_step()
        return run

    hooks: list[float] = []
    times = alternate(rounds, lambda order: {name: arm(ARMS[name], hooks if name == "monitor" else None)
                                             for name in order})
    times["hooks"] = hooks[1::2]  # each round's timed run (the runs before are its warm-ups)
    return times


def _fp8_model(keras: Any, width: int) -> Any:
    """The benchmark's model: 3 ``Dense`` layers quantized to float8, compiled with SGD."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)])
    model.quantize("float8")
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    return model


def _time_hooks(callback: Any) -> list[float]:
    """Wrap ``callback``'s batch and epoch-end hooks to add their main-thread seconds to the returned one-item
    list (one it does not override stays Keras' own: wrapped, a batch-end hook would make Keras wait for
    every step)."""
    spent = [0.0]
    for name in ("on_train_batch_begin", "on_train_batch_end", "on_epoch_end"):
        hook = getattr(callback, name)
        if getattr(hook, "_is_default", False):  # keras.src.utils.python_utils.is_default
            continue

        def timed(*args: Any, hook: Any = hook, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return hook(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start
        setattr(callback, name, timed)
    return spent


def split_keras(steps: int, width: int) -> dict[str, list[float]]:
    """One watched model's train functions interleaved in one ``fit`` (see the module), in blocks of
    ``COUNT_EVERY`` steps, a cycle being one block of each kind in a shuffled order: a ``bare`` block
    (the function traced with the layers unwatched: no identity, no count) and a ``monitored`` block,
    the callback's sequence (its ordinary function, one counted step in the middle: both switches
    inside the block). The first step of every block (the switch between blocks, alike for both) is
    left out. Returns per cycle the seconds per step of each block (``bare``, ``monitored``), and the
    steps' seconds by function (``bare_steps``, ``carried_steps``, ``counted_steps``)."""
    import random

    import keras
    import numpy as np

    from lossscale_callbacks.keras import Fp8ScaleCallback
    from lossscale_callbacks.keras._fit_sampling import _second_train_function

    model = _fp8_model(keras, width)
    callback = Fp8ScaleCallback(log_every=100, count_every=COUNT_EVERY, echo=None)
    callback.set_model(model)  # watches the layers; a fresh optimizer knows their tallies
    layers = callback.layers
    model.make_train_function()  # as fit does at its start (no-op when the callback remade it)
    carried = model.train_function
    counted = callback._counted(_second_train_function(model))
    traced_bare = _second_train_function(model)
    first = [True]

    def bare(*args: Any, **kwargs: Any) -> Any:
        if first[0]:  # traced at its first call (TensorFlow, JAX): with the layers unwatched
            first[0] = False
            layers.unwatch()
            try:
                return traced_bare(*args, **kwargs)
            finally:
                layers.watch(model)
        return traced_bare(*args, **kwargs)

    block = COUNT_EVERY
    kinds = {"bare": [("bare", bare)] * block,
             "monitored": [("carried", carried)] * block}
    kinds["monitored"][block // 2] = ("counted", counted)
    shuffle = random.Random(0).shuffle
    plan: list[tuple[int, str, str, Any]] = []  # (cycle, block kind, function name, function)
    warm = 1  # a first cycle to trace and warm every function, not timed
    cycles = warm + max(1, steps // (2 * block))
    for cycle in range(cycles):
        order = list(kinds)
        shuffle(order)
        plan += [(cycle, kind, name, function) for kind in order for name, function in kinds[kind]]
    per_block: dict[tuple[int, str], list[float]] = {}
    by_function: dict[str, list[float]] = {"bare_steps": [], "carried_steps": [], "counted_steps": []}

    class Interleave(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.at = plan[batch]
            if self._model.train_function is not self.at[3]:
                self._model.train_function = self.at[3]
            self.start = _CLOCK()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            elapsed = _CLOCK() - self.start
            cycle, kind, name, _ = self.at
            if cycle >= warm and batch % block:
                per_block.setdefault((cycle, kind), []).append(elapsed)
                by_function[f"{name}_steps"].append(elapsed)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(len(plan) * 128, width)).astype("float32")
    y = rng.normal(size=(len(plan) * 128, 1)).astype("float32")
    model.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0, callbacks=[Interleave()])
    timed = range(warm, cycles)
    return {**{kind: [statistics.fmean(per_block[c, kind]) for c in timed] for kind in kinds}, **by_function}


def summarize(times: dict[str, list[float]], split: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Medians: each arm's seconds per step, the per-round ratios against ``bare``; with the Keras parts
    (``hooks`` in ``times``, ``split`` from :func:`split_keras`) the parts' ratios and their sum."""
    out = {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in ARMS}
    for name in ("monitor", "every", "bare_again"):
        ratios = (a / b for a, b in zip(times[name], times["bare"], strict=True))
        out[f"{name}/bare"] = statistics.median(ratios)
    if times.get("hooks") and split is not None:
        out["hooks"] = statistics.median(h / b for h, b in zip(times["hooks"], times["bare"], strict=True))
        bare = statistics.median(split["bare_steps"])
        out["carried"] = statistics.median(split["carried_steps"]) / bare
        out["counted"] = statistics.median(split["counted_steps"]) / bare
        cycles = zip(split["monitored"], split["bare"], strict=True)
        out["graph"] = statistics.median(m / b for m, b in cycles)
        out["parts"] = out["graph"] + out["hooks"]
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
    parser.add_argument("--split-steps", type=int, default=3000,
                        help="steps of the interleaved fit that times the Keras parts")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parse_args(parser, argv, rounds=2, steps=5, width=64, split_steps=90)
    if args.cpu:
        global _CLOCK
        _CLOCK = time.process_time
    if args.keras_here:
        split = split_keras(args.split_steps, args.width)
        times = keras_rounds(args.rounds, args.steps, args.width, args.tensorboard)
        results = {"here": summarize(times, split)}
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
                       "--split-steps", str(args.split_steps),
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
    parts = {name: r for name, r in results.items() if "parts" in r}
    if parts:
        print(f"\nthe Keras callback by its parts (carried, counted, graph: interleaved in one fit, "
              f"{COUNT_EVERY}-step blocks; hooks: main-thread time over bare)\n")
        print(f"{'setup':<20} {'carried':>8} {'counted':>8} {'graph':>7} {'hooks':>7} {'parts':>7}")
        for name, r in parts.items():
            print(f"{name:<20} {r['carried']:>8.4f} {r['counted']:>8.4f} {r['graph']:>7.4f} "
                  f"{r['hooks']:>7.4f} {r['parts']:>7.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
