"""Reading the scaler of an ``Accelerator`` (or a Trainer): ours directly, a stock one through its counts.

``LossScaler`` keeps its own state on the device (scale, counters, attempted and skipped steps) and
is read once per log interval. A stock ``torch.amp.GradScaler`` keeps only a scale and a growth
tracker: :class:`~lossscale_callbacks.torch.stock.StockScalerReader` counts its steps on the host
and its skipped steps on the device after each optimizer step (no host read), and is read once
per interval too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lossscale_callbacks.extras import require
from lossscale_callbacks.forensics import IntervalForensics
from lossscale_callbacks.sinks import GuardedSink, Sink
from lossscale_callbacks.torch.scaler import LossScaler
from lossscale_callbacks.torch.stock import StockScalerReader

__all__ = ["ScalerSource", "open_sinks"]


class ScalerSource:
    """One way to read our ``LossScaler`` or a stock ``torch.amp.GradScaler`` in place.

    Args:
        scaler: the scaler the training loop steps (enabled).

    Example:
        >>> source = ScalerSource(LossScaler("cpu", init_scale=1024.0))
        >>> source.ours, source.read().scale, source.steps
        (True, 1024.0, 0)
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.ours = isinstance(scaler, LossScaler)
        self.stock = None if self.ours else StockScalerReader(scaler)
        # Ours counts its own steps; a host copy decides when an interval ends without a device read.
        self.steps = int(scaler.get_state().steps) if self.ours else 0

    @property
    def policy(self) -> Any:
        """Our scaler's policy; ``None`` for a stock one (the logging loop then counts 1.0 as its minimum)."""
        return self.scaler.policy if self.ours else None

    def after_optimizer_step(self) -> None:
        """Count one optimizer step attempted (a stock scaler's overflow on the device). No host read."""
        self.steps += 1
        if self.stock is not None:
            self.stock.after_optimizer_step()

    def read(self) -> Any:
        """The state as host numbers: the one host read of an interval."""
        if self.stock is not None:
            return self.stock.read()
        state = self.scaler.get_state()
        self.steps = int(state.steps)  # the scaler is the truth (a checkpoint may have moved it)
        return state

    def read_forensics(self) -> IntervalForensics | None:
        """Our scaler's overflow forensics of the interval (``diagnose``), else ``None``."""
        return self.scaler.read_forensics() if self.ours else None

    def start_at(self, steps: int) -> None:
        """A stock scaler's step count when training starts (it checkpoints none; skips count from here)."""
        if self.stock is not None:
            self.stock.steps = self.steps = int(steps)


def open_sinks(tensorboard: str | os.PathLike[str] | None, wandb: bool | Mapping[str, Any] | None,
               sinks: Iterable[Sink]) -> tuple[list[Sink], list[Sink]]:
    """The sinks of the ``tensorboard=``/``wandb=``/``sinks=`` arguments, checked and made now.

    A missing extra is a :class:`~lossscale_callbacks.extras.MissingExtraError` here, at
    construction, not when training starts. Nothing is written (no file, no run) until the first
    write, and only on rank 0.

    Returns:
        Every sink (the user's guarded), and those made here, which the caller closes.
    """
    if tensorboard is not None and (not isinstance(tensorboard, (str, os.PathLike))
                                    or not os.fspath(tensorboard)):
        raise ValueError(f"tensorboard must be None or a log directory path, got {tensorboard!r}")
    if not (wandb is None or isinstance(wandb, (bool, Mapping))):
        raise ValueError(f"wandb must be None, a bool, or a dict of wandb.init arguments, got {wandb!r}")
    if sinks is None or isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
        raise ValueError(f"sinks must be an iterable of sinks, got {sinks!r}")
    owned: list[Sink] = []
    if tensorboard is not None:
        require("lossscale_callbacks.tensorboard", "tensorboard", feature="tensorboard=")
        from lossscale_callbacks.tensorboard.sink import TensorBoardSink

        owned.append(TensorBoardSink(tensorboard))
    if wandb:
        require("wandb", "wandb", feature="wandb=")
        from lossscale_callbacks.wandb.sink import WandbSink

        owned.append(WandbSink(**(dict(wandb) if isinstance(wandb, Mapping) else {})))
    return [*(GuardedSink(s) for s in sinks), *owned], owned
