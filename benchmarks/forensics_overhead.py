"""What overflow forensics cost per step: ``diagnose=True`` and ``"every_step"`` against ``diagnose=False``.

    python benchmarks/forensics_overhead.py [--rounds 11] [--steps 20] [--backends jax,torch]
                                            [--json out.json] [--quick]

Two frameworks, each with three arms of the same model in one process, the arms alternating round by
round (the order reversed every other round):

* torch: ``LossScaler`` around an MLP (256 -> 2048 x 3 -> 256, 8.9M parameters, batch 256) with
  ``AdamW(foreach)`` and with ``AdamW(fused=True)``; the process's CPU time per step. The forward runs
  in float32: torch's CPU float16 matmuls are emulated (about 15 s a step for this model here, 100x
  the float32 step), which would hide any overhead. The forensics work on the gradients whatever their
  dtype, and a faster step makes the ratio larger, not smaller. And a *launch-bound* step: 64 layers
  of 32 x 32 (128 parameter tensors, 68K parameters), batch 8, one thread, where the step's time is
  the ops' dispatch, as a small model's step is on a GPU: what forensics cost when every op counts.
* Keras, on each backend installed or those ``--backends`` names (TensorFlow, JAX, torch; each in its own
  process, since Keras picks its backend at import): ``fit`` with ``LossScaleCallback`` on the MLP of
  ``keras_overhead.py`` (mixed_float16; float32 on torch, whose CPU float16 matmuls are emulated); wall
  time per step.

Arms: ``off`` (``diagnose=False``), ``on`` (``diagnose=True``, the headroom sampled every 1000 steps:
never inside a timed round, as in a real run where it is one step in a thousand) and ``every`` (the
headroom and the Inf/NaN kind on every step, what a sampled step costs). The table gives the median
of the per-round ratios against ``off``. Target: ``on`` / ``off`` <= 1.01.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _quick import parse_args

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ARMS = ("off", "on", "every")
MODES = {"off": False, "on": True, "every": "every_step"}


def _torch_model(shape: str, width: int, batch: int) -> tuple:
    """The model and a batch: ``"wide"`` (8.9M parameters at width 2048) or ``"launch_bound"``."""
    import torch

    torch.manual_seed(0)
    if shape == "launch_bound":
        layers = [m for _ in range(64) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
        return torch.nn.Sequential(*layers), torch.randn(8, 32)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(),
                                torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 256))
    return model, torch.randn(batch, 256)


def torch_rounds(rounds: int, steps: int, fused: bool, width: int = 2048, batch: int = 256,
                 shape: str = "wide") -> dict[str, list[float]]:
    import torch

    from lossscale_callbacks._policy import DynamicPolicy
    from lossscale_callbacks.torch._scaler import LossScaler

    arms = {}
    for name in ARMS:
        model, x = _torch_model(shape, width, batch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
        scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10), diagnose=MODES[name])
        if MODES[name]:
            scaler.watch(model)
        arms[name] = (model, opt, scaler, x)

    def step(name: str) -> None:
        model, opt, scaler, x = arms[name]
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for name in ARMS:  # warm up; the "on" arm takes its step-0 headroom sample here
        for _ in range(3):
            step(name)
        if arms[name][2].forensics is not None:
            arms[name][2].read_forensics()
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for r in range(rounds):
        for name in ARMS if r % 2 == 0 else tuple(reversed(ARMS)):
            start = time.process_time()
            for _ in range(steps):
                step(name)
            times[name].append((time.process_time() - start) / steps)
    return times


def keras_rounds(rounds: int, steps: int,
                 arms_kwargs: dict[str, dict] | None = None) -> dict[str, list[float]]:
    """Per arm, the wall time per step of each round of ``fit`` on this process's Keras backend: one model
    per arm, each with a ``LossScaleCallback(**arms_kwargs[arm])`` (default: this benchmark's forensics
    modes), alternating round by round, the order reversed every other round."""
    import keras
    import numpy as np

    from lossscale_callbacks.keras import LossScaleCallback

    # torch's CPU float16 matmuls are emulated (100x the float32 step), which would hide any overhead.
    on_torch = keras.backend.backend() == "torch"
    keras.mixed_precision.set_global_policy("float32" if on_torch else "mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128 * steps, 64)).astype("float32")
    y = rng.integers(0, 10, size=(128 * steps,))
    if arms_kwargs is None:
        arms_kwargs = {name: {"diagnose": MODES[name]} for name in ARMS}
    arms = {}
    for name, kwargs in arms_kwargs.items():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10, dtype="float32")])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        arms[name] = (model, LossScaleCallback(log_every=100, health=None, **kwargs))

    def run(name: str, n: int) -> float:
        model, callback = arms[name]
        with contextlib.redirect_stdout(io.StringIO()):
            start = time.perf_counter()
            model.fit(x[:n * 128], y[:n * 128], batch_size=128, epochs=1, shuffle=False, verbose=0,
                      callbacks=[callback])
            return (time.perf_counter() - start) / n

    for name in arms:
        run(name, 20)  # compile every arm first
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in arms if r % 2 == 0 else tuple(reversed(arms)):
            times[name].append(run(name, steps))
    return times


KERAS_ROWS = {"tensorflow": "keras_fit", "jax": "keras_fit_jax", "torch": "keras_fit_torch"}


def add_backends_option(parser: argparse.ArgumentParser) -> None:
    """``--backends``: the Keras backends to time, comma-separated (default: every one installed)."""
    parser.add_argument("--backends", default=None, metavar="NAMES",
                        help=f"Keras backends to time, comma-separated, of {', '.join(KERAS_ROWS)} "
                             "(default: every one installed)")


def keras_backends(parser: argparse.ArgumentParser, value: str | None) -> list[str]:
    """The backends ``--backends`` names, each installed; every installed one where it names none.

    A name that is not a Keras backend, or one that is not installed, is the parser's usage error.
    """
    if value is None:
        return [b for b in KERAS_ROWS if importlib.util.find_spec(b) is not None]
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in KERAS_ROWS]
    if unknown or not names:
        parser.error(f"--backends must name some of {', '.join(KERAS_ROWS)}, got {value!r}")
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(f"--backends names {', '.join(missing)}, which is not installed here")
    return list(dict.fromkeys(names))


def keras_backend_results(rounds: int, steps: int, quick: bool,
                          backends: list[str]) -> dict[str, dict[str, float]]:
    """The Keras rows, one process per backend (``--only keras-here`` under ``KERAS_BACKEND``)."""
    results = {}
    for backend in backends:
        row = KERAS_ROWS[backend]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "keras.json")
            command = [sys.executable, os.path.abspath(__file__), "--only", "keras-here",
                       "--rounds", str(rounds), "--keras-steps", str(steps), "--json", out,
                       *(["--quick"] if quick else [])]
            subprocess.run(command, env=dict(os.environ, KERAS_BACKEND=backend), check=True,
                           stdout=subprocess.DEVNULL)
            with open(out) as f:
                results[row] = json.load(f)["keras_here"]
    return results


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    out = {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in ARMS}
    for name in ("on", "every"):
        out[f"{name}/off"] = statistics.median(a / b for a, b in zip(times[name], times["off"], strict=True))
    return out


def launch_bound_results(rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """The launch-bound torch rows, on one thread: a second one only adds its spin-waits to the CPU time."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {f"torch_launch_bound_{name}": summarize(torch_rounds(rounds, steps, fused,
                                                                     shape="launch_bound"))
                for name, fused in (("foreach", False), ("fused", True))}
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=20, help="steps per arm and round (torch)")
    parser.add_argument("--keras-steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=2048, help="torch MLP's width (2048: 8.9M parameters)")
    parser.add_argument("--batch", type=int, default=256, help="batch of the torch MLP")
    parser.add_argument("--only", choices=("torch", "keras", "keras-here"), default=None,
                        help="keras: every installed Keras backend, each in a subprocess; keras-here: "
                             "this process's backend only (KERAS_BACKEND)")
    add_backends_option(parser)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parse_args(parser, argv, rounds=2, steps=2, keras_steps=5, width=64, batch=16)
    if args.rounds < 3 and not args.quick:
        parser.error("--rounds must be >= 3")
    backends = keras_backends(parser, args.backends)
    results = {}
    if args.only in (None, "torch"):
        for name, fused in (("torch_adamw_foreach", False), ("torch_adamw_fused", True)):
            times = torch_rounds(args.rounds, args.steps, fused, args.width, args.batch)
            results[name] = summarize(times)
        results.update(launch_bound_results(args.rounds, args.steps * 10))
    if args.only in (None, "keras"):
        results.update(keras_backend_results(args.rounds, args.keras_steps, args.quick, backends))
    if args.only == "keras-here":
        results["keras_here"] = summarize(keras_rounds(args.rounds, args.keras_steps))
    print(f"{os.cpu_count()} CPU cores, {args.rounds} alternating rounds\n")
    print(f"{'setup':<28} {'off ms':>9} {'on ms':>9} {'every ms':>9} {'on/off':>8} {'every/off':>10}")
    for name, r in results.items():
        print(f"{name:<28} {r['off_ms']:>9.3f} {r['on_ms']:>9.3f} {r['every_ms']:>9.3f} {r['on/off']:>8.3f} "
              f"{r['every/off']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
