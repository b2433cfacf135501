"""The known answer of skip truth, shared by its tests: 100 steps, an Inf gradient at steps 3, 17 and 42.

A run trains a tiny model with AdamW (fused or foreach), an LR scheduler stepped every iteration and an
EMA (``AveragedModel`` with ``get_ema_multi_avg_fn``) updated every iteration, as PyTorch's AMP recipe
teaches. The reference is the stock run with those three steps removed (their batches too): the
learning rate each applied step used must equal, bit for bit, the stock run's, the scheduler's count and
``n_averaged`` must be 97.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import lr_scheduler as lrs
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

STEPS = 100
INJECTED = (3, 17, 42)
APPLIED = STEPS - len(INJECTED)


def _transformers_linear(opt: torch.optim.Optimizer) -> Any:
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=STEPS)


def _transformers_cosine(opt: torch.optim.Optimizer) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=STEPS)


def _warmup_chain(opt: torch.optim.Optimizer) -> Any:
    return lrs.ChainedScheduler([lrs.LinearLR(opt, start_factor=0.1, total_iters=10),
                                 lrs.ExponentialLR(opt, gamma=0.99)])


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda opt: lrs.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s)),
    "OneCycleLR": lambda opt: lrs.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 10),
    "OneCycleLR_lr_only": lambda opt: lrs.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 10,
                                                     cycle_momentum=False),
    "CosineAnnealingLR": lambda opt: lrs.CosineAnnealingLR(opt, T_max=STEPS),
    "SequentialLR": lambda opt: lrs.SequentialLR(
        opt, [lrs.LinearLR(opt, start_factor=0.1, total_iters=10), lrs.CosineAnnealingLR(opt, T_max=90)],
        milestones=[10]),
    "warmup_chain": _warmup_chain,
    "transformers_linear": _transformers_linear,
    "transformers_cosine": _transformers_cosine,
}


def batch(step: int) -> torch.Tensor:
    """The batch of a step: the same in the injected run and the reference (seeded by the step)."""
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 + step))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    flag = {"fused": {"fused": True}, "foreach": {"foreach": True}}[kind]
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **flag)


def current_lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


@dataclasses.dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: AveragedModel
    lrs: list[list[float]]  # the learning rate each applied step used
    scaler: Any = None


EMAS = {
    "multi": lambda model: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
    # Lightning's EMAWeightAveraging: the per-tensor average
    "per_tensor": lambda model: AveragedModel(model, avg_fn=get_ema_avg_fn(0.9), use_buffers=True),
}


def reference(optimizer: str, scheduler: str, ema_kind: str = "multi") -> Run:
    """The stock run (no scaler, no injection) with the injected steps removed."""
    model = make_model()
    opt = make_optimizer(model, optimizer)
    sched = SCHEDULERS[scheduler](opt)
    ema = EMAS[ema_kind](model)
    used = []
    for step in range(1, STEPS + 1):
        if step in INJECTED:
            continue
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        used.append(current_lrs(opt))
        opt.step()
        sched.step()
        ema.update_parameters(model)
    return Run(model, opt, sched, ema, used)


def injected(scaler: Any, optimizer: str, scheduler: str, hold: bool = True,
             on_step: Callable[[int], None] | None = None, ema_kind: str = "multi") -> Run:
    """The run with the scaler and an Inf gradient at the injected steps; ``hold``: scheduler and EMA held."""
    model = make_model()
    opt = make_optimizer(model, optimizer)
    sched = SCHEDULERS[scheduler](opt)
    ema = EMAS[ema_kind](model)
    if hold:
        scaler.hold(sched)
        scaler.hold(ema, optimizer=opt)
    used = []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        scaler.scale(model(batch(step)).pow(2).mean()).backward()
        if step in INJECTED:
            model[0].weight.grad[0, 0] = float("inf")
        else:
            used.append(current_lrs(opt))
        scaler.step(opt)
        scaler.update()
        sched.step()
        ema.update_parameters(model)
        if on_step is not None:
            on_step(step)
    return Run(model, opt, sched, ema, used, scaler)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def scheduler_count(scheduler: Any) -> int:
    """The scheduler's steps (``last_epoch``; a ``ChainedScheduler`` has its schedulers')."""
    if hasattr(scheduler, "last_epoch"):
        return int(scheduler.last_epoch)
    return int(scheduler._schedulers[0].last_epoch)
