"""Per-step overhead of ``LossScaler`` against ``torch.amp.GradScaler``, in one process.

For each optimizer (foreach SGD with momentum, fused AdamW) two identical copies of the same
model (>= 10M parameters) train with fp16 autocast, one under each scaler. Rounds alternate
which scaler runs first; each round times ``--steps`` full steps (forward, scaled backward,
unscale/check, optimizer step, update) per scaler, and the reported figure is the median over
rounds of the per-round time ratio (ours / torch's), which cancels slow drifts of a shared machine.

It also counts, for both scalers, host reads per step (``Tensor.item``, ``__bool__``, ``tolist``,
``cpu``, ``numpy``, ``__float__``, ``__int__`` and device-to-host ``.to``, with a
``TorchFunctionMode``) and dispatched aten ops (kernel launches on a GPU, with a
``TorchDispatchMode``) in a whole step and in ``update()``; times ``update()`` alone; and sets the
unscale-and-check pass (``unscale_``) against a memory-bandwidth floor measured in the same run:
bytes read and written by the pass over the bandwidth of a plain ``copy_`` of the same number of
bytes.

``--lightning`` adds ``Trainer.fit`` arms: our ``LossScalePlugin`` with a ``LossScaleMonitor``
against Lightning's stock ``MixedPrecision``, and a second stock arm (an A/A comparison: the noise
floor of the same measurement), per-step time between consecutive batch starts, rounds alternating.

    python benchmarks/torch_overhead.py                      # CUDA when available, else CPU
    python benchmarks/torch_overhead.py --device cpu --rounds 9 --lightning --json out.json
    python benchmarks/torch_overhead.py --quick              # a tiny model, 2 rounds: checks it runs
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _quick import parse_args
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.torch import LossScaler

_T = torch.Tensor
_READS = {_T.item, _T.__bool__, _T.tolist, _T.cpu, _T.numpy, _T.__float__, _T.__int__, _T.__index__}


class HostReads(TorchFunctionMode):
    """Counts calls that bring a tensor's value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.count += 1
        elif func is _T.to and args and args[0].device.type != "cpu" and any(
                str(a) == "cpu" for a in list(args[1:]) + list((kwargs or {}).values())):
            self.count += 1
        return func(*args, **(kwargs or {}))


class AtenOps(TorchDispatchMode):
    """Counts dispatched aten ops: each one is a kernel launch on a GPU (view ops too, an upper bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


# Whole-step timing: wall time on a GPU; on a CPU the process's CPU time by default, so that other
# processes on a shared machine disturb the ratio less. Set by --clock. Its resolution can be a
# scheduler tick (4 ms), so the short timings (unscale, update, copy) always use wall time.
_clock = time.perf_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(width: int, depth: int, device: torch.device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)


def build_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd_foreach":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    raise ValueError(f"optimizer must be sgd_foreach or adamw_fused, got {kind!r}")


def make_step(model, opt, scaler, x, y, device: torch.device) -> Callable[[], None]:
    fused = getattr(opt, "_step_supports_amp_scaling", False)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if not fused:
            scaler.unscale_(opt)  # where clipping would go
        scaler.step(opt)
        scaler.update()

    return step


def time_steps(step: Callable[[], None], n: int, device: torch.device) -> float:
    _sync(device)
    start = _clock()
    for _ in range(n):
        step()
    _sync(device)
    return (_clock() - start) / n


def count_reads(step: Callable[[], None]) -> int:
    with HostReads() as reads:
        step()
    return reads.count


def count_ops(step: Callable[[], None], scaler: Any) -> dict[str, int]:
    """Aten ops of one whole step, and of its ``scaler.update()`` alone."""
    update = scaler.update
    inner = AtenOps()

    def counted_update(*args: Any, **kwargs: Any) -> None:
        with inner:
            update(*args, **kwargs)

    scaler.update = counted_update
    try:
        with AtenOps() as whole:
            step()
    finally:
        del scaler.update
    return {"step": whole.count, "update": inner.count}


def bandwidth_floor(grads: list[torch.Tensor], device: torch.device, repeats: int) -> dict[str, float]:
    """Bytes the unscale-and-check pass must move, and the time a plain copy needs for as many bytes."""
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    copy_s = statistics.median(times)
    bandwidth = 2 * nbytes / copy_s  # a copy reads and writes nbytes
    moved = 2 * nbytes  # the pass reads every gradient and writes it back scaled
    return {"grad_bytes": nbytes, "copy_bandwidth_gbs": bandwidth / 1e9, "floor_s": moved / bandwidth}


def _time_one_unscale(model, opt, scaler, x, y, device: torch.device) -> float:
    opt.zero_grad(set_to_none=False)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    _sync(device)
    start = time.perf_counter()
    scaler.unscale_(opt)
    _sync(device)
    elapsed = time.perf_counter() - start
    # ne(0), not abs().sum() > 0: an overflowing pass (Inf/NaN gradients) does the same work and
    # is a fair timing; only gradients that are all zero would not be.
    if not any(bool(p.grad.ne(0).any()) for p in model.parameters()):
        raise RuntimeError("gradients are all zero: the unscale timing would be meaningless")
    return elapsed


def time_unscale(models, opts, factories, x, y, device: torch.device, repeats: int) -> dict[str, float]:
    """Median time of ``unscale_`` alone (the fused check-and-unscale pass) on fresh real gradients,
    the two scalers interleaved."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(reversed(list(models)))
        for name in order:
            times[name].append(_time_one_unscale(models[name], opts[name], factories[name](), x, y, device))
    for opt in opts.values():
        opt.zero_grad(set_to_none=False)
    return {name: statistics.median(v) for name, v in times.items()}


def time_update(models, opts, factories, x, y, device: torch.device, repeats: int) -> dict[str, Any]:
    """Median time of ``update()`` alone: the core's rule (ours) against ``_amp_update_scale_`` (torch)."""
    times: dict[str, list[float]] = {name: [] for name in models}
    prepared = {}
    for name in models:
        scaler = factories[name]()
        opts[name].zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(models[name](x).float(), y)
        scaler.scale(loss).backward()
        prepared[name] = scaler
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(reversed(list(models)))
        for name in order:
            scaler = prepared[name]
            scaler.unscale_(opts[name])
            _sync(device)
            start = time.perf_counter()
            scaler.update()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    out: dict[str, Any] = {name: statistics.median(v) for name, v in times.items()}
    out["ratio"] = statistics.median(a / b for a, b in zip(times["ours"], times["torch"], strict=True))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)  # the same inputs in every run, so that two runs time the same work
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randn(args.batch, 1, device=device)
    policy = DynamicPolicy(initial_scale=2.0**16, growth_interval=2000)
    results: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "clock": args.clock,
                               "threads": torch.get_num_threads(), "optimizers": {}}
    for kind in args.optimizers:
        models = {name: build_model(args.width, args.depth, device) for name in ("ours", "torch")}
        params = sum(p.numel() for p in models["ours"].parameters())
        opts = {name: build_optimizer(kind, m.parameters()) for name, m in models.items()}
        scalers = {"ours": LossScaler(policy=policy, device=device),
                   "torch": torch.amp.GradScaler(device.type, init_scale=2.0**16, growth_interval=2000)}
        steps = {n: make_step(models[n], opts[n], scalers[n], x, y, device) for n in models}
        for n in steps:  # warm-up: lazy init, optimizer state, allocator, kernels
            for _ in range(args.warmup):
                steps[n]()
        reads = {n: count_reads(steps[n]) for n in steps}
        ops = {n: count_ops(steps[n], scalers[n]) for n in steps}
        ratios, per_step = [], {"ours": [], "torch": []}
        for r in range(args.rounds):
            order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
            t = {n: time_steps(steps[n], args.steps, device) for n in order}
            per_step["ours"].append(t["ours"])
            per_step["torch"].append(t["torch"])
            ratios.append(t["ours"] / t["torch"])
        grads = [p.grad for p in models["ours"].parameters() if p.grad is not None]
        floor = bandwidth_floor(grads, device, args.unscale_repeats)
        # Fresh scalers at the scale training reached: a tiny model overflows at 2**16 (NaN gradients).
        now = min(float(scalers["ours"].get_scale()), float(scalers["torch"].get_scale()))
        at_now = DynamicPolicy(initial_scale=now, growth_interval=2000)
        factories = {"ours": lambda at_now=at_now: LossScaler(policy=at_now, device=device),
                     "torch": lambda now=now: torch.amp.GradScaler(device.type, init_scale=now)}
        # Fused optimizers never call unscale_ in a step; time the pass on plain SGD copies then.
        plain = {n: torch.optim.SGD(m.parameters(), lr=0.0) for n, m in models.items()}
        unscale = time_unscale(models, plain, factories, x, y, device, args.unscale_repeats)
        update = time_update(models, plain, factories, x, y, device, args.update_repeats)
        results["optimizers"][kind] = {
            "parameters": params,
            "median_ratio": statistics.median(ratios),
            "ratios": ratios,
            "median_step_s": {n: statistics.median(v) for n, v in per_step.items()},
            "host_reads_per_step": reads,
            "aten_ops": ops,
            "unscale_s": unscale,
            "update_s": update,
            "bandwidth": floor,
            "unscale_over_floor": {n: v / floor["floor_s"] for n, v in unscale.items()},
        }
        # The scalers differ only in unscale_ and update (scale and the step wrapper are the same
        # few ops): their extra cost over torch's step time is a low-noise estimate of the ratio.
        extra = (unscale["ours"] + update["ours"]) - (unscale["torch"] + update["torch"])
        results["optimizers"][kind]["derived_ratio"] = 1.0 + extra / statistics.median(per_step["torch"])
    return results


LIGHTNING_ARMS = ("stock", "stock_again", "ours")


def _lightning_module(width: int) -> Any:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(),
                                           torch.nn.Linear(width, width), torch.nn.GELU(),
                                           torch.nn.Linear(width, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

    return Regression()


def _lightning_fit(arm: str, module: Any, loader: Any, steps: int) -> list[float]:
    """Per-step times of one ``fit`` of ``steps + 1`` steps (the first, with the lazy setup, left out)."""
    import lightning.pytorch as pl

    from lossscale_callbacks.lightning._monitor import LossScaleMonitor
    from lossscale_callbacks.lightning._plugin import LossScalePlugin

    marks: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            marks.append(_clock())

    if arm == "ours":
        plugin, callbacks = LossScalePlugin("16-mixed", "cpu"), [Clock(), LossScaleMonitor()]
    else:
        plugin = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        callbacks = [Clock()]
    # The same trainer for every arm; without a logger the monitor still reads the state at its
    # interval (into trainer.callback_metrics), so only the plugin and the monitor differ.
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, plugins=[plugin],
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    return [b - a for a, b in itertools.pairwise(marks[1:])]


def lightning_rounds(rounds: int, steps: int, width: int) -> dict[str, Any]:
    """``Trainer.fit`` per-step time: ours (plugin + monitor) and a second stock arm, each over stock."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    generator = torch.Generator().manual_seed(0)
    n = 64 * (steps + 2)
    x, y = torch.randn(n, 64, generator=generator), torch.randn(n, 1, generator=generator)
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    modules = {arm: _lightning_module(width) for arm in LIGHTNING_ARMS}
    for arm in LIGHTNING_ARMS:
        _lightning_fit(arm, modules[arm], loader, 2)  # imports, first-use costs
    per_step: dict[str, list[float]] = {arm: [] for arm in LIGHTNING_ARMS}
    for r in range(rounds):
        for arm in LIGHTNING_ARMS if r % 2 == 0 else tuple(reversed(LIGHTNING_ARMS)):
            per_step[arm].append(statistics.median(_lightning_fit(arm, modules[arm], loader, steps)))
    ratio = {arm: statistics.median(a / b for a, b in zip(per_step[arm], per_step["stock"], strict=True))
             for arm in ("ours", "stock_again")}
    return {"median_step_s": {arm: statistics.median(v) for arm, v in per_step.items()},
            "ours/stock": ratio["ours"], "stock_again/stock": ratio["stock_again"], "rounds": rounds,
            "steps": steps, "width": width}


def report(results: dict[str, Any]) -> str:
    lines = [f"device {results['device']}, torch {results['torch']}, clock {results['clock']}, "
             f"{results['threads']} threads", "",
             "| optimizer | params | step ours (ms) | step torch (ms) | median ratio | host reads ours/torch "
             "| unscale ours/torch (ms) | floor (ms) | ours/floor | update ours/torch (us) | derived ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, r in results["optimizers"].items():
        ms = {n: v * 1e3 for n, v in r["median_step_s"].items()}
        un = {n: v * 1e3 for n, v in r["unscale_s"].items()}
        reads = r["host_reads_per_step"]
        lines.append(
            f"| {kind} | {r['parameters'] / 1e6:.1f}M | {ms['ours']:.2f} | {ms['torch']:.2f} | "
            f"{r['median_ratio']:.4f} | {reads['ours']}/{reads['torch']} | "
            f"{un['ours']:.2f}/{un['torch']:.2f} | {r['bandwidth']['floor_s'] * 1e3:.2f} | "
            f"{r['unscale_over_floor']['ours']:.2f} | "
            f"{r['update_s']['ours'] * 1e6:.0f}/{r['update_s']['torch'] * 1e6:.0f} | "
            f"{r['derived_ratio']:.4f} |")
    bw = next(iter(results["optimizers"].values()))["bandwidth"]["copy_bandwidth_gbs"]
    lines += ["", f"copy bandwidth measured: {bw:.1f} GB/s (read + write)", "",
              "| optimizer | aten ops per step, ours / torch | in update(), ours / torch "
              "| update() time ours/torch |",
              "|---|---|---|---|"]
    for kind, r in results["optimizers"].items():
        ops = r["aten_ops"]
        lines.append(f"| {kind} | {ops['ours']['step']} / {ops['torch']['step']} | {ops['ours']['update']} / "
                     f"{ops['torch']['update']} | {r['update_s']['ratio']:.2f} |")
    fit = results.get("lightning")
    if fit:
        ms = {arm: v * 1e3 for arm, v in fit["median_step_s"].items()}
        lines += ["", "| Trainer.fit per step (ms): stock / stock again / ours | stock again / stock (A/A) "
                  "| ours / stock |", "|---|---|---|",
                  f"| {ms['stock']:.2f} / {ms['stock_again']:.2f} / {ms['ours']:.2f} | "
                  f"{fit['stock_again/stock']:.4f} | {fit['ours/stock']:.4f} |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=1792, help="hidden width (default: ~12.9M parameters)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per scaler per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--unscale-repeats", type=int, default=7)
    parser.add_argument("--optimizers", nargs="+", default=["sgd_foreach", "adamw_fused"])
    parser.add_argument("--update-repeats", type=int, default=200, help="update() timings per scaler")
    parser.add_argument("--lightning", action="store_true", help="also time Trainer.fit (CPU)")
    parser.add_argument("--lightning-rounds", type=int, default=11)
    parser.add_argument("--lightning-steps", type=int, default=20)
    parser.add_argument("--lightning-width", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--clock", choices=["auto", "wall", "process"], default="auto",
                        help="auto: wall time on CUDA, process CPU time on the CPU")
    args = parse_args(parser, argv, width=64, depth=2, batch=8, rounds=2, steps=2, warmup=1,
                      unscale_repeats=3, update_repeats=5, lightning_rounds=2, lightning_steps=3,
                      lightning_width=16)
    if args.clock == "auto":
        args.clock = "wall" if torch.device(args.device).type == "cuda" else "process"
    global _clock
    _clock = time.perf_counter if args.clock == "wall" else time.process_time
    if math.prod((args.width, args.width, args.depth)) < 10_000_000 and not args.quick:
        print("note: fewer than 10M parameters; the acceptance figure asks for at least 10M")
    results = run(args)
    if args.lightning:
        results["lightning"] = lightning_rounds(args.lightning_rounds, args.lightning_steps,
                                                args.lightning_width)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
