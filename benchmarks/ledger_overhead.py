"""What the ledger of bad steps costs an ordinary step, against the same loop without it, in one process.

Four arms train identical copies of one model on the same clean data (no bad step: every step is an
ordinary one) with ``LossScaler`` and fp16 autocast, the batches from a ``DataLoader``:

* ``off``: no ledger;
* ``off2``: no ledger either, a second copy: the A/A arm, whose ratio to ``off`` is the noise floor;
* ``ledger``: ``scaler.track(loader)`` (each batch's sampler indices recorded on the host);
* ``replay``: ``scaler.track(loader, replay=True, loss=...)`` (also a reference to each batch and the
  RNG state before its forward, kept until the step ends).

Noise on a shared machine comes in bursts longer than a step, so the arms are interleaved step by step
(each step of a round runs one step of every arm, in an order that rotates from step to step), each
step timed alone (the loader's ``next`` included: that is where the ledger works); a round's ratio is an
arm's summed time over ``off``'s, and the figure is the median of the rounds' ratios. Times are the
process's CPU time (what the run costs; a busy neighbour's time is not in it) and wall time, with one
intra-op thread (``--threads``), so that the two cores of a small machine do not trade work between the
arms. The default model (4 x 256, batch 32) takes about 10 ms a step on the CPU. It also counts the host
reads of one ordinary step per arm (aten ``_local_scalar_dense``, what ``item``/``bool`` dispatch), and
measures the ledger's own host work per step alone.

    python benchmarks/ledger_overhead.py                  # CUDA when available, else CPU
    python benchmarks/ledger_overhead.py --rounds 41 --steps 50
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

ARMS = ("off", "off2", "ledger", "replay")
MEASURED = ("off2", "ledger", "replay")  # each against off


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

    if arm in ("ledger", "replay"):
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
    for arm in ("off", "ledger", "replay"):
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


def _clocks(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.process_time(), time.perf_counter()


def run_round(steps: dict[str, Callable[[], None]], n: int, device: torch.device
              ) -> dict[str, tuple[float, float]]:
    """``n`` steps of every arm, interleaved step by step in a rotating order: each arm's summed (CPU,
    wall) seconds."""
    arms = list(steps)
    took = {arm: [0.0, 0.0] for arm in arms}
    for i in range(n):
        k = i % len(arms)
        for arm in arms[k:] + arms[:k]:
            cpu, wall = _clocks(device)
            steps[arm]()
            cpu_end, wall_end = _clocks(device)
            took[arm][0] += cpu_end - cpu
            took[arm][1] += wall_end - wall
    return {arm: (cpu, wall) for arm, (cpu, wall) in took.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="steps of each arm per round")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = parse_args(parser, argv, width=32, depth=2, batch=8, steps=5, rounds=2)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    built = {arm: build(arm, args.width, args.depth, args.batch, 64 * args.batch, device) for arm in ARMS}
    steps = {arm: step for arm, (step, _) in built.items()}
    run_round(steps, 5, device)  # warm-up
    reads = {}
    for arm, step in steps.items():
        with HostReads() as counter:
            step()
        reads[arm] = counter.count
    ratios: dict[str, dict[str, list[float]]] = {arm: {"cpu": [], "wall": []} for arm in MEASURED}
    per_step: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        took = run_round(steps, args.steps, device)
        for arm in ARMS:
            per_step[arm].append(took[arm][0] / args.steps * 1e3)
        for arm in MEASURED:
            ratios[arm]["cpu"].append(took[arm][0] / took["off"][0])
            ratios[arm]["wall"].append(took[arm][1] / took["off"][1])
    threads = f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""
    print(f"device {device}{threads}, model {args.depth}x{args.width}, batch {args.batch}, "
          f"{args.steps} steps x {args.rounds} rounds, arms interleaved step by step")
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
    for arm in MEASURED:
        cpu, wall = ratios[arm]["cpu"], ratios[arm]["wall"]
        out[arm] = statistics.median(cpu)
        out[f"{arm}_wall"] = statistics.median(wall)
        quartiles = statistics.quantiles(cpu, n=4) if len(cpu) > 1 else [cpu[0]] * 3
        print(f"{arm} / off: {statistics.median(cpu):.4f} (median of {len(cpu)} rounds; min {min(cpu):.4f}, "
              f"max {max(cpu):.4f}; quartiles {quartiles[0]:.4f}-{quartiles[2]:.4f}; wall "
              f"{statistics.median(wall):.4f})")
    return out


if __name__ == "__main__":
    main()
