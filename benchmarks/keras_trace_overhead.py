"""What the forward trace costs a Keras ``fit`` step: ``LossScaleCallback(diagnose=True)`` with the trace at
its default (``trace_every=100``) and on every step, against the same callback with ``trace_every=None``.

    python benchmarks/keras_trace_overhead.py [--rounds 5] [--steps 200] [--backends jax,torch]
                                              [--json out.json] [--quick]

Each Keras backend installed (TensorFlow, JAX, torch; or those ``--backends`` names) runs in its own
process (Keras picks its backend at import): the mixed_float16 MLP of ``keras_overhead.py`` (float32 on
torch, whose CPU float16 matmuls are emulated), three arms in one process, alternating round by round (the
order reversed every other round), wall time per step; the table gives the median of the per-round ratios
against ``untraced``. Arms: ``untraced`` (the gradient forensics only), ``traced`` (the default: one
traced step in 100, and the step after a loss turned non-finite), ``every`` (``trace_every=1``: what a
traced step costs). Target: ``traced`` / ``untraced`` <= 1.02.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _quick import parse_args
from forensics_overhead import KERAS_ROWS, add_backends_option, keras_backends, keras_rounds

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ARMS = {"untraced": None, "traced": 100, "every": 1}


def rounds_here(rounds: int, steps: int) -> dict[str, list[float]]:
    """Per arm, the wall time per step of each round, on this process's Keras backend (the forensics
    benchmark's model and loop, with the trace's arms)."""
    return keras_rounds(rounds, steps, {name: {"diagnose": True, "trace_every": every}
                                        for name, every in ARMS.items()})


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    out = {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in ARMS}
    for name in ("traced", "every"):
        out[f"{name}/untraced"] = statistics.median(
            a / b for a, b in zip(times[name], times["untraced"], strict=True))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps per arm and round")
    parser.add_argument("--here", action="store_true", help="this process's backend only (KERAS_BACKEND)")
    add_backends_option(parser)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parse_args(parser, argv, rounds=2, steps=5)
    backends = keras_backends(parser, args.backends)
    if args.here:
        results = {"here": summarize(rounds_here(args.rounds, args.steps))}
    else:
        results = {}
        for backend in backends:
            row = KERAS_ROWS[backend]
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "here.json")
                command = [sys.executable, os.path.abspath(__file__), "--here", "--rounds", str(args.rounds),
                           "--steps", str(args.steps), "--json", out, *(["--quick"] if args.quick else [])]
                subprocess.run(command, env=dict(os.environ, KERAS_BACKEND=backend), check=True,
                               stdout=subprocess.DEVNULL)
                with open(out) as f:
                    results[row] = json.load(f)["here"]
    print(f"{os.cpu_count()} CPU cores, {args.rounds} alternating rounds of {args.steps} steps\n")
    print(f"{'setup':<18} {'untraced ms':>12} {'traced ms':>10} {'every ms':>9} {'traced/untraced':>16} "
          f"{'every/untraced':>15}")
    for name, r in results.items():
        print(f"{name:<18} {r['untraced_ms']:>12.3f} {r['traced_ms']:>10.3f} {r['every_ms']:>9.3f} "
              f"{r['traced/untraced']:>16.3f} {r['every/untraced']:>15.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
