"""The loss-scaling core on its own: a simulated fp16 gradient stream, no framework.

Each step draws the largest gradient magnitude of a pretend model, multiplies it by the
loss scale, and calls the step non-finite when that overflows float16 (65504). The core
decides what happens to the scale; the core's logging loop reads the state every 250 steps, as
an integration does at its log interval, turns it into metrics and lets the health rules judge it.

    python examples/core_simulation.py
"""

from __future__ import annotations

import math

import numpy as np

from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop, initial_state, next_state

FP16_MAX = 65504.0


def main(steps: int = 3000, log_every: int = 250, seed: int = 0) -> InMemorySink:
    rng = np.random.default_rng(seed)
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=200, hysteresis=2)
    state = initial_state(policy)
    sink = InMemorySink()
    loop = LoggingLoop(policy, sinks=[sink], log_every=log_every)

    print(f"policy: {policy}")
    print(f"{'step':>6} {'scale':>10} {'log2':>6} {'skipped':>8} {'in interval':>12} {'growth ctr':>11}")
    for step in range(1, steps + 1):
        # gradients of ~1e-1..1e2 with rare spikes (a bad batch), like a real run
        grad_max = rng.lognormal(mean=0.0, sigma=1.5) * (1e3 if rng.random() < 0.002 else 1.0)
        finite = grad_max * float(state.scale) < FP16_MAX
        state = next_state(policy, state, finite)
        snapshot = loop.maybe_observe(step, lambda: state)  # noqa: B023
        if snapshot is not None:
            print(f"{snapshot.step:>6} {snapshot.scale:>10g} {math.log2(snapshot.scale):>6.1f} "
                  f"{snapshot.skipped_steps:>8} {snapshot.skipped_in_interval:>12} "
                  f"{snapshot.growth_counter:>11}")
    loop.finish(state)
    return sink


if __name__ == "__main__":
    main()
