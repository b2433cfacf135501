"""What the forward trace costs a torch step: ``diagnose=True`` with and without tracing the forward pass.

    python benchmarks/advisor_overhead.py [--rounds 7] [--steps 20] [--shapes launch_bound mlp] [--quick]

Three arms of the same model in one process, alternating round by round (the order reversed every other
round), ``LossScaler(diagnose=True)`` with ``AdamW(foreach=True)`` in each; the process's CPU time per step:

* ``off``: the forward trace switched off (``scaler.forensics.trace_forward = False``): the gradient
  forensics alone, the baseline;
* ``on``: the default: the forward traced at the headroom samples (every 1000 steps: never inside a
  timed round, as in a real run) and for 3 steps after a skipped one (none here);
* ``traced``: every step traced (the tracer armed before each step): what one traced step costs.

Two models: a launch-bound step (64 x (Linear 32x32, Tanh), batch 8, one thread: the step's time is its
ops' dispatch, as a small model's is on a GPU) and an MLP (256 -> 1024 x 2 -> 256, batch 128). The
forward runs in float32 (torch's CPU float16 matmuls are emulated and would hide any overhead; the trace
reads the activations whatever their dtype). The table gives the median of the per-round ratios against
``off``. Target: ``on`` / ``off`` <= 1.02.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _quick import parse_args

ARMS = ("off", "on", "traced")


def _model(shape: str, quick: bool) -> tuple:
    import torch

    torch.manual_seed(0)
    if shape == "launch_bound":
        layers = [m for _ in range(4 if quick else 64) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
        return torch.nn.Sequential(*layers), torch.randn(8, 32)
    width = 64 if quick else 1024
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 256))
    return model, torch.randn(16 if quick else 128, 256)


def rounds(shape: str, n_rounds: int, steps: int, quick: bool) -> dict[str, list[float]]:
    import torch

    from lossscale_callbacks.policy import DynamicPolicy
    from lossscale_callbacks.torch import LossScaler

    arms = {}
    for name in ARMS:
        model, x = _model(shape, quick)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10), diagnose=True)
        scaler.forensics.trace_forward = name != "off"
        arms[name] = (model, opt, scaler.watch(model), x)

    def step(name: str) -> None:
        model, opt, scaler, x = arms[name]
        if name == "traced":
            scaler.forensics.tracer.arm()
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for name in ARMS:  # warm up: the step-0 samples (gradients and forward) are taken here
        for _ in range(3):
            step(name)
        arms[name][2].read_forensics()
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for r in range(n_rounds):
        for name in ARMS if r % 2 == 0 else tuple(reversed(ARMS)):
            start = time.process_time()
            for _ in range(steps):
                step(name)
            times[name].append((time.process_time() - start) / steps)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shapes", nargs="+", choices=("launch_bound", "mlp"),
                        default=["launch_bound", "mlp"])
    args = parse_args(parser, argv, rounds=2, steps=3)
    import torch

    print(f"{'setup':<14} {'off ms':>8} {'on ms':>8} {'traced ms':>10} {'on/off':>7} {'traced/off':>10}")
    for shape in args.shapes:
        threads = torch.get_num_threads()
        if shape == "launch_bound":
            torch.set_num_threads(1)
        try:
            times = rounds(shape, args.rounds, args.steps, args.quick)
        finally:
            torch.set_num_threads(threads)
        median = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        ratio = {name: statistics.median(a / b for a, b in zip(times[name], times["off"], strict=True))
                 for name in ARMS}
        print(f"{shape:<14} {median['off']:>8.3f} {median['on']:>8.3f} {median['traced']:>10.3f} "
              f"{ratio['on']:>7.3f} {ratio['traced']:>10.3f}")


if __name__ == "__main__":
    main()
