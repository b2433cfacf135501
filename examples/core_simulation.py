"""The loss-scaling core on its own: a simulated fp16 gradient stream, no framework.

Each step draws the largest gradient magnitude of a pretend model, multiplies it by the
loss scale, and calls the step non-finite when that overflows float16 (65504). The core
decides what happens to the scale; the tracker reads the state every 250 steps, as an
integration does at its log interval, and the health rules judge it.

    python examples/core_simulation.py
"""

from __future__ import annotations

import math

import numpy as np

from lossscale_callbacks import (
    DynamicPolicy,
    HealthMonitor,
    InMemorySink,
    MetricsTracker,
    initial_state,
    next_state,
    summarize,
)

FP16_MAX = 65504.0


def main(steps: int = 3000, log_every: int = 250, seed: int = 0) -> InMemorySink:
    rng = np.random.default_rng(seed)
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=200, hysteresis=2)
    state = initial_state(policy)
    tracker = MetricsTracker(policy.min_scale)
    health = HealthMonitor.from_spec("warn")
    sink = InMemorySink()

    print(f"policy: {policy}")
    print(f"{'step':>6} {'scale':>10} {'log2':>6} {'skipped':>8} {'in interval':>12} {'growth ctr':>11}")
    for step in range(1, steps + 1):
        # gradients of ~1e-1..1e2 with rare spikes (a bad batch), like a real run
        grad_max = rng.lognormal(mean=0.0, sigma=1.5) * (1e3 if rng.random() < 0.002 else 1.0)
        finite = grad_max * float(state.scale) < FP16_MAX
        state = next_state(policy, state, finite)
        if step % log_every == 0:
            snapshot = tracker.observe(state)  # the one host read of this interval
            sink.write(snapshot.step, snapshot.metrics())
            health.apply(health.observe(snapshot))
            print(f"{snapshot.step:>6} {snapshot.scale:>10g} {math.log2(snapshot.scale):>6.1f} "
                  f"{snapshot.skipped_steps:>8} {snapshot.skipped_in_interval:>12} "
                  f"{snapshot.growth_counter:>11}")
    print(summarize(tracker.last, policy.min_scale))
    return sink


if __name__ == "__main__":
    main()
