"""A plain training loop (no framework) logging its loss scale to TensorBoard and W&B.

The gradients are simulated with NumPy: each step draws the largest gradient magnitude of a
pretend model and calls the step non-finite when ``gradient * scale`` overflows float16. The
core decides the scale; every ``log_every`` steps the core's logging loop reads the state once,
writes the metrics to both sinks and applies the health rules (the W&B sink also turns a problem
into a W&B alert). At the end the summary goes to both sinks as text and to the console.

    python examples/plain_loop_sinks.py                 # writes runs/plain_loop and runs/wandb (offline)
    tensorboard --logdir runs                           # the "Loss scale" section of Custom Scalars
    lossscale-callbacks report runs/plain_loop --png loss_scale.png

W&B runs offline unless an API key is configured (then ``wandb sync`` is not needed).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np

from lossscale_callbacks import (
    DynamicPolicy,
    InMemorySink,
    LoggingLoop,
    Sink,
    initial_state,
    next_state,
)

FP16_MAX = 65504.0


def train(sinks: Sequence[Sink], steps: int = 2000, log_every: int = 100, seed: int = 0,
          policy: DynamicPolicy | None = None) -> list[tuple[int, dict[str, float]]]:
    """Run the simulated loop, writing to ``sinks``; return every ``(step, metrics)`` written.

    The core's :class:`~lossscale_callbacks.LoggingLoop` does everything after the read: the
    metrics, the sinks, the health rules (a W&B sink turns each problem into a W&B alert), the
    summary. The sinks are closed at the end. A sink that fails is warned about once and dropped;
    the loop always runs to the end.
    """
    rng = np.random.default_rng(seed)
    policy = policy or DynamicPolicy(initial_scale=2.0**16, growth_interval=200)
    state = initial_state(policy)
    memory = InMemorySink()  # what was written, for the caller
    loop = LoggingLoop(policy, sinks=[*sinks, memory], log_every=log_every)
    for _ in range(steps):
        # gradients of ~1e-1..1e2 with rare spikes (a bad batch), like a real run
        grad_max = rng.lognormal(mean=0.0, sigma=1.5) * (1e3 if rng.random() < 0.003 else 1.0)
        finite = grad_max * float(state.scale) < FP16_MAX  # the scaled gradient fits float16
        state = next_state(policy, state, finite)
        # The loop reads the state (here a NumPy one) only when an interval ends.
        loop.maybe_observe(int(state.steps), lambda: state)  # noqa: B023
    loop.finish(state)
    loop.close()
    return [(step, dict(metrics)) for step, metrics in memory.records]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("runs", "plain_loop"))
    parser.add_argument("--wandb-dir", default="runs")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)

    # Imported here: the loop above needs neither package, only the sinks do.
    from lossscale_callbacks.tensorboard import TensorBoardSink
    from lossscale_callbacks.wandb import WandbSink

    os.makedirs(args.wandb_dir, exist_ok=True)
    sinks = [TensorBoardSink(args.log_dir), WandbSink(project="lossscale-plain-loop", dir=args.wandb_dir)]
    written = train(sinks, steps=args.steps)
    step, metrics = written[-1]
    print(f"wrote {len(written)} log points to {args.log_dir} and W&B; at step {step} the scale is "
          f"{metrics['loss_scale/scale']:g} with {metrics['loss_scale/skipped_steps']} skipped steps")


if __name__ == "__main__":
    main()
