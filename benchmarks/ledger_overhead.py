"""What the ledger of bad steps costs an ordinary step, against the same loop without it, in one process.

Three arms train identical copies of one model on the same clean data (no bad step: every step is an
ordinary one) with ``LossScaler`` and fp16 autocast, the batches from a ``DataLoader``:

* ``off``: no ledger;
* ``ledger``: ``scaler.track(loader)`` (each batch's sampler indices recorded on the host);
* ``replay``: ``scaler.track(loader, replay=True, loss=...)`` (also a reference to each batch and the
  RNG state before its forward, kept until the step ends).

Rounds alternate the arms' order; each round times ``--steps`` whole steps per arm (the loader's
``next`` included: that is where the ledger works), and the figure is the median over rounds of the
per-round ratio (arm / off), which cancels a shared machine's slow drifts. It also counts the host reads
of one ordinary step per arm (aten ``_local_scalar_dense``, what ``item``/``bool`` dispatch).

    python benchmarks/ledger_overhead.py                  # CUDA when available, else CPU
    python benchmarks/ledger_overhead.py --rounds 21 --steps 100
    python benchmarks/ledger_overhead.py --quick          # a tiny model, 2 rounds: checks it runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _quick import parse_args
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.torch import LossScaler

ARMS = ("off", "ledger", "replay")


class HostReads(TorchDispatchMode):
    """Counts the aten ops that bring a value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "item"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def build(arm: str, width: int, depth: int, batch: int, samples: int, device: torch.device
          ) -> tuple[Callable[[], None], Any]:
    """One arm's model, optimizer, scaler and loader; returns its step and the scaler."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(samples, width, generator=g),
                                          torch.randn(samples, 1, generator=g))
    loader: Any = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True,
                                              generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10**6)).watch(model)

    def loss_of(b: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(b[0].to(device)).float(), b[1].to(device))

    if arm != "off":
        loader = scaler.track(loader, replay=arm == "replay", loss=loss_of)
    batches: Iterator[Any] = iter(())

    def step() -> None:
        nonlocal batches
        try:
            b = next(batches)
        except StopIteration:
            batches = iter(loader)
            b = next(batches)
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = loss_of(b)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step, scaler


def host_work(batch: int, samples: int, width: int, repeats: int) -> dict[str, float]:
    """The ledger's own host work per step, alone: a pass over the loader with and without ``track``
    (and the scaler's end-of-step bookkeeping), best of ``repeats``, in microseconds per batch."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(samples, width, generator=g), torch.randn(samples, 1))
    out = {}
    for arm in ARMS:
        loader: Any = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True,
                                                  generator=torch.Generator().manual_seed(0))
        model = torch.nn.Linear(1, 1)  # held: the scaler watches it weakly
        scaler = LossScaler(device="cpu").watch(model)
        capture = None
        if arm != "off":
            loader = scaler.track(loader, replay=arm == "replay", loss=lambda b: b[0].sum())
            capture = scaler._ledger
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            count = 0
            for _ in loader:
                if capture is not None:
                    capture.end_step(False, None, None)  # what update() adds: an ordinary step
                count += 1
            best = min(best, (time.perf_counter() - start) / count)
        out[arm] = best * 1e6
    return out


def time_arm(step: Callable[[], None], n: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.process_time() if device.type == "cpu" else time.perf_counter()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.process_time() if device.type == "cpu" else time.perf_counter()) - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=15)
    args = parse_args(parser, argv, width=32, depth=2, batch=8, steps=5, rounds=2)
    device = torch.device(args.device)
    steps = {arm: build(arm, args.width, args.depth, args.batch, 64 * args.batch, device) for arm in ARMS}
    for step, _ in steps.values():  # warm-up
        for _ in range(5):
            step()
    reads = {}
    for arm, (step, _) in steps.items():
        with HostReads() as counter:
            step()
        reads[arm] = counter.count
    ratios: dict[str, list[float]] = {"ledger": [], "replay": []}
    per_step: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
        took = {arm: time_arm(steps[arm][0], args.steps, device) for arm in order}
        for arm in ARMS:
            per_step[arm].append(took[arm] / args.steps * 1e3)
        for arm in ratios:
            ratios[arm].append(took[arm] / took["off"])
    print(f"device {device}, model {args.depth}x{args.width}, batch {args.batch}, {args.steps} steps x "
          f"{args.rounds} rounds")
    print(f"{'arm':<8} {'ms/step':>9} {'host reads/step':>16}")
    for arm in ARMS:
        print(f"{arm:<8} {statistics.median(per_step[arm]):9.3f} {reads[arm]:16d}")
    out: dict[str, Any] = {"reads": reads}
    work = host_work(args.batch, 64 * args.batch, args.width, 7)
    step_us = statistics.median(per_step["off"]) * 1e3
    for arm in ("ledger", "replay"):
        added = work[arm] - work["off"]
        out[f"{arm}_host_us"] = added
        print(f"{arm} host work: {added:.2f} us per step ({added / step_us:.5f} of this step)")
    for arm, values in ratios.items():
        median = statistics.median(values)
        out[arm] = median
        print(f"{arm} / off: {median:.4f} (median of {len(values)} rounds; min {min(values):.4f}, "
              f"max {max(values):.4f})")
    return out


if __name__ == "__main__":
    main()
