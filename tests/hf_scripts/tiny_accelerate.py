"""A tiny Accelerate training loop for the tests and the two-process script.

The loop is the one of Accelerate's quick tour and guides (``backward``, ``clip_grad_norm_``,
``accumulate``, a prepared scheduler, ``save_state``/``load_state``), with the scaler installed
through :func:`lossscale_callbacks.accelerate.install_loss_scaler`: ours (``"ours"``) or torch's
``GradScaler`` (``"stock"``) in the same place. ``inject_at`` puts an Inf into one gradient after
the backward pass of the given optimizer steps (counted from 0, skipped ones included), so those
steps overflow on purpose; each optimizer step records the scale and the parameters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from lossscale_callbacks._policy import DynamicPolicy
from lossscale_callbacks.accelerate._install import install_loss_scaler
from lossscale_callbacks.accelerate._monitor import AccelerateLossScaleMonitor

INITIAL_SCALE = 2.0**10
GROWTH_INTERVAL = 3


@dataclasses.dataclass
class Setup:
    scaler: str = "ours"  # or "stock"
    steps: int = 12
    accumulate: int = 1
    clip: bool = False
    inject_at: tuple[int, ...] = (2, 3, 7)
    log_every: int = 4
    fused: bool = False  # Adam(fused=True), which skips on the device, instead of SGD with momentum
    monitor_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Record:
    step: int
    scale: float
    lr: float
    skipped: bool
    params: list[torch.Tensor]


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state, so the next Accelerator starts from its own arguments."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def make_accelerator(setup: Setup, **kwargs: Any) -> Accelerator:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=setup.accumulate,
                              **kwargs)
    if setup.scaler == "ours":
        install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=INITIAL_SCALE,
                                                              growth_interval=GROWTH_INTERVAL))
    else:
        install_loss_scaler(accelerator, torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE,
                                                              growth_interval=GROWTH_INTERVAL))
    return accelerator


def model_and_data(seed: int = 0, fused: bool = False) -> tuple[torch.nn.Module, Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01, fused=True) if fused
                 else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=4)
    return model, optimizer, scheduler, data


def run(accelerator: Accelerator, setup: Setup, *, first: int = 0, save_at: int | None = None,
        save_dir: str | None = None, resume_from: str | None = None) -> tuple[list[Record], Any]:
    """Train optimizer steps ``first`` .. ``setup.steps - 1``; optionally save after ``save_at`` steps,
    or resume from ``resume_from`` (then ``first`` must be the step it was saved at)."""
    model, optimizer, scheduler, data = accelerator.prepare(*model_and_data(fused=setup.fused))
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=setup.log_every,
                                         **{"echo": None, **setup.monitor_kwargs})
    if resume_from is not None:
        accelerator.load_state(resume_from)
        data = accelerator.skip_first_batches(data, first * setup.accumulate)
    records: list[Record] = []
    step, batches = first, iter(data)
    while step < setup.steps:
        for _ in range(setup.accumulate):
            x, y = next(batches)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients and step in setup.inject_at:
                    with torch.no_grad():
                        next(model.parameters()).grad.view(-1)[0] = math.inf
                if setup.clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                monitor.step()
        # The learning rate the next step uses (a held scheduler's is a device tensor on the fused path,
        # current at every step; get_last_lr() is brought up to date at the reads).
        records.append(Record(step, accelerator.scaler.get_scale(), float(optimizer.param_groups[0]["lr"]),
                              accelerator.optimizer_step_was_skipped,
                              [p.detach().clone() for p in model.parameters()]))
        step += 1
        if save_at is not None and step == save_at:
            accelerator.save_state(save_dir)
    monitor.finish()
    return records, monitor


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))

