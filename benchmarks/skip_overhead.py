"""What skip truth costs per step: the spike rule and holding a scheduler and an EMA, against neither.

    python benchmarks/skip_overhead.py [--rounds 11] [--steps 20] [--width 2048] [--batch 256]
                                       [--json out.json] [--quick]

Four arms of the same model in one process, taking turns step by step (the order rotating), each a
whole training step as the PyTorch AMP recipe writes it (``scaler.scale(loss).backward()``,
``scaler.step``, ``scaler.update``, ``scheduler.step()``, ``ema.update_parameters(model)``) with
``LossScaler``:

* ``off``: the scheduler (``LambdaLR``) and the EMA (``AveragedModel`` with ``get_ema_multi_avg_fn``)
  stepped as stock, no spike rule (the step outcomes are recorded in every arm: they are the scaler's);
* ``spike``: ``LossScaler(spike=SpikeRule())`` (6σ over 128 steps), the rest as ``off``;
* ``hold``: ``scaler.hold(scheduler)`` and ``scaler.hold(ema)``, the rest as ``off``;
* ``off_again``: ``off`` once more (the ``A/A`` column: how far two like arms differ).

The arms are made afresh every round (see :func:`rounds_of`).

Models, on one thread: an MLP (256 -> 2048 x 3 -> 256, 8.9M parameters, batch 256, float32: torch's
CPU float16 matmuls are emulated) and a *launch-bound* one (64 layers of 32 x 32, batch 8), where a
step's time is the ops' dispatch, as a small model's step is on a GPU: the worst case for a few more
ops. AdamW fused (the device path: the hold's device ops) and foreach (the host path). The process's
CPU time per step; the table gives the median of the per-turn ratios against ``off`` (``rounds *
steps`` turns). Target: ``spike`` / ``off`` <= 1.02.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _quick import parse_args

ARMS = ("off", "spike", "hold", "off_again")


def _model(shape: str, width: int, batch: int) -> tuple:
    import torch

    torch.manual_seed(0)
    if shape == "launch_bound":
        layers = [m for _ in range(64) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
        return torch.nn.Sequential(*layers), torch.randn(8, 32)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 256))
    return model, torch.randn(batch, 256)


def _arms(shape: str, width: int, batch: int, fused: bool, order: tuple[str, ...]) -> dict[str, tuple]:
    """Each arm's model, optimizer, scheduler, EMA, scaler and batch, made in ``order``."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from lossscale_callbacks._policy import DynamicPolicy
    from lossscale_callbacks.skips._spike import SpikeRule
    from lossscale_callbacks.torch._scaler import LossScaler

    arms = {}
    for name in order:
        model, x = _model(shape, width, batch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 1e-3 * s))
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10),
                            spike=SpikeRule() if name == "spike" else None)
        if name == "hold":
            scaler.hold(sched)
            scaler.hold(ema, optimizer=opt)
        arms[name] = (model, opt, sched, ema, scaler, x)
    return arms


def _step(arm: tuple) -> None:
    model, opt, sched, ema, scaler, x = arm
    opt.zero_grad(set_to_none=True)
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    ema.update_parameters(model)


def rounds_of(rounds: int, steps: int, fused: bool, shape: str, width: int, batch: int
              ) -> dict[str, list[float]]:
    """Per arm, the CPU time of each of its ``rounds * steps`` steps, in turns.

    Every round makes the arms afresh, in a rotated order: where an arm's tensors lie in memory moves its
    step time by up to 2 % (two arms made alike differ that much), so one set of arms would measure where
    they lie; over the rounds that averages out (the ``A/A`` arm shows what is left)."""
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for index in range(rounds):
        arms = _arms(shape, width, batch, fused, ARMS[index % len(ARMS):] + ARMS[:index % len(ARMS)])
        for name in ARMS:
            for _ in range(3):
                _step(arms[name])
        # The arms take turns step by step (the order rotating), so a burst of load on a shared machine
        # falls on all of them alike; each turn's times make one ratio.
        for turn in range(steps):
            for name in ARMS[turn % len(ARMS):] + ARMS[:turn % len(ARMS)]:
                start = time.process_time()
                _step(arms[name])
                times[name].append(time.process_time() - start)
        for name in ARMS:  # the interval's read: the held objects brought up to date, outside the timing
            arms[name][4].sync_held()
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    out = {f"{name}_ms": statistics.median(times[name]) * 1e3 for name in ARMS}
    for name in ARMS[1:]:
        out[f"{name}/off"] = statistics.median(a / b for a, b in zip(times[name], times["off"], strict=True))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=20, help="steps per arm and round")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's width (2048: 8.9M parameters)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parse_args(parser, argv, rounds=1, steps=2, width=64, batch=16)
    import torch

    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second thread adds only its spin-waits (and a shared machine's noise)
    try:
        for shape, row in (("wide", "mlp"), ("launch_bound", "launch_bound")):
            for kind, fused in (("foreach", False), ("fused", True)):
                results[f"{row}_{kind}"] = summarize(rounds_of(args.rounds, args.steps, fused, shape,
                                                               args.width, args.batch))
    finally:
        torch.set_num_threads(threads)
    print(f"{'model':<22}{'off ms':>10}{'spike ms':>10}{'hold ms':>10}{'spike/off':>11}{'hold/off':>10}"
          f"{'A/A':>8}")
    for row, r in results.items():
        print(f"{row:<22}{r['off_ms']:>10.3f}{r['spike_ms']:>10.3f}{r['hold_ms']:>10.3f}"
              f"{r['spike/off']:>11.4f}{r['hold/off']:>10.4f}{r['off_again/off']:>8.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
