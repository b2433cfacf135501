"""A tiny LightningModule for the Lightning tests and scripts, built for either namespace.

``inject_inf_at`` puts an Inf into one gradient right after the backward pass (and after DDP's
gradient all-reduce) at the given optimizer steps, optionally on one rank only; every step
records the parameters and optimizer state before and after, so tests can check that skipped
steps left them bit-identical.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import sys
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def exit_cleanly() -> None:
    """End a distributed script once its results are written: the ranks meet, leave the group, and exit
    without the interpreter's teardown, which gloo's threads can abort under load ("terminate called
    without an active exception", SIGABRT, seen in clean-clone CI runs)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def quiet_lightning_warnings() -> None:
    """Silence Lightning's advice for tiny CPU runs (workers, log interval) and a pytree deprecation."""
    for message in (".*does not have many workers.*", ".*isinstance.treespec, LeafSpec.*",
                    ".*log_every_n_steps.*"):
        warnings.filterwarnings("ignore", message)


def namespace(name: str) -> Any:
    return importlib.import_module(name)


def data(n: int = 64, batch_size: int = 8, seed: int = 0, same_batches: bool = False) -> DataLoader:
    """Synthetic regression data; ``same_batches`` repeats one batch (then batch order cannot matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    if same_batches:
        x, y = x[:batch_size].repeat(n // batch_size, 1), y[:batch_size].repeat(n // batch_size, 1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False, num_workers=0)


def _snapshot(module: Any) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for p in module.parameters()]
    opt = module.trainer.optimizers[0]
    return params, copy.deepcopy(opt.state_dict()["state"])


def same_bits(a: tuple, b: tuple) -> bool:
    """Parameters and optimizer state identical bit for bit."""
    for x, y in zip(a[0], b[0], strict=True):
        if not torch.equal(x.view(torch.int32), y.view(torch.int32)):
            return False
    if a[1].keys() != b[1].keys():
        return False
    for key, entry in a[1].items():
        for name, value in entry.items():
            other = b[1][key][name]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                return False
    return True


def module_class(pl: Any) -> type:
    """A tiny regression LightningModule subclassing ``pl.LightningModule``."""

    class Tiny(pl.LightningModule):
        def __init__(self, inject_inf_at: tuple[int, ...] = (), inject_rank: int | None = None,
                     optimizer: str = "sgd", lr: float = 0.05, width: int = 16, snapshots: bool = True,
                     scheduler: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                           torch.nn.Linear(width, 1))
            self.inject_inf_at = set(inject_inf_at)
            self.inject_rank = inject_rank
            self.optimizer_name = optimizer
            self.lr = lr
            self.snapshots = snapshots
            self.scheduler = scheduler
            self.autocast_dtypes: list[torch.dtype] = []
            self.steps: list[tuple[int, Any, Any]] = []
            self._before: Any = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self(x)
            self.autocast_dtypes.append(out.dtype)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            self.log("train_loss", loss)
            return loss

        def on_after_backward(self) -> None:
            here = self.inject_rank in (None, self.global_rank)
            if here and self.trainer.global_step in self.inject_inf_at:
                with torch.no_grad():
                    self.net[0].weight.grad[0, 0] = math.inf

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.snapshots:
                self._before = (self.trainer.global_step, _snapshot(self))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.snapshots:
                step, before = self._before
                self.steps.append((step, before, _snapshot(self)))

        def configure_optimizers(self) -> Any:
            if self.optimizer_name == "sgd":
                opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            elif self.optimizer_name == "adam_fused":
                opt = torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)
            elif self.optimizer_name == "plain_sgd":
                opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            else:
                raise ValueError(self.optimizer_name)
            if not self.scheduler:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Tiny


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs
