"""The ledger of bad steps under Lightning: the monitor's part, written once for ``LossScaleMonitor``.

Sample identities: the train ``DataLoader``'s index sampler is recorded. Lightning takes the first epoch's
first batch before any callback hook after ``setup``, so the loader is wrapped at ``setup``: the one given to
``fit``, or the one the module's or datamodule's ``train_dataloader()`` returns (that method is wrapped for
the run). Under a distributed strategy Lightning makes a new loader with a ``DistributedSampler`` then, and
the wrapping happens at each later epoch's start only: the first epoch's entries have the epoch and
``batch_idx`` but no sample ids. Each ``on_train_batch_start`` is one received micro-batch, with the
trainer's epoch and ``batch_idx``.
Replay: the LightningModule's ``training_step`` on the same batch and ``batch_idx``, its loss divided by
``accumulate_grad_batches`` as Lightning's closure does, under the precision plugin's autocast; its
``self.log`` calls are silenced while it runs (the logged metrics stay the run's). Manual optimization has
no loss for the library to replay: the ledger records the bad steps without replay there, and says so.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lossscale_callbacks.integration import check_ledger
from lossscale_callbacks.torch import LossScaler
from lossscale_callbacks.torch.integration import check_replay, ledger_capture, loss_of_output

__all__ = ["LightningLedger"]


def _silent(*args: Any, **kwargs: Any) -> None:
    return None


class LightningLedger:
    """What ``LossScaleMonitor(ledger=..., replay=...)`` does at each hook."""

    def __init__(self, ledger: Any, replay: Any, ids: str | None) -> None:
        self.ledger = check_ledger(ledger)
        self.replay = check_replay(replay)
        if ids is not None and not isinstance(ids, str):
            raise ValueError(f"ids must be None or the name of the batch's id field, got {ids!r}")
        self.ids = ids
        self._module: Any = None
        self._trainer: Any = None
        self._batch_idx: dict[int, int] = {}

    @property
    def on(self) -> bool:
        return bool(self.ledger)

    def setup(self, trainer: Any, pl_module: Any, scaler: Any, tensorboard: Any) -> None:
        """At ``fit``'s setup, with our scaler: the folder beside the dashboards, and replay's loss."""
        if not isinstance(scaler, LossScaler):
            if trainer.is_global_zero:
                warnings.warn("[lossscale-callbacks] LossScaleMonitor(ledger=...) needs the "
                              "lossscale-callbacks scaler (plugins=[LossScalePlugin()]): no ledger in this "
                              "run.", UserWarning, stacklevel=3)
            return
        folder = self.ledger if not isinstance(self.ledger, bool) else (tensorboard or trainer.log_dir
                                                                        or trainer.default_root_dir)
        replay = self.replay
        if replay and not pl_module.automatic_optimization:
            replay = 0
            warnings.warn("[lossscale-callbacks] replay needs automatic optimization (the library cannot "
                          "find the loss of a manual step): the ledger records the bad steps without replay.",
                          UserWarning, stacklevel=3)
        self._module, self._trainer = pl_module, trainer
        scaler.watch(pl_module)
        scaler.track(None, ledger=folder, replay=replay, loss=self._loss if replay else None, ids=self.ids)
        capture = ledger_capture(scaler)
        plugin = trainer.strategy.precision_plugin
        if capture is not None and hasattr(plugin, "autocast_dtype"):
            capture.set_autocast(str(plugin.device), plugin.autocast_dtype)
        if capture is not None and trainer.world_size == 1:
            self._wrap_source(trainer, capture)

    def _wrap_source(self, trainer: Any, capture: Any) -> None:
        """The train loader's sampler recorded before Lightning takes its first batch (see the module)."""
        source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
        instance = getattr(source, "instance", None)
        if isinstance(instance, torch.utils.data.DataLoader):
            capture.watch_sampler(instance)
            return
        method = getattr(instance, "train_dataloader", None)
        if instance is None or not callable(method) or getattr(method, "_ledger_wrapped", False):
            return

        def train_dataloader() -> Any:
            loader = method()
            capture.watch_sampler(loader)
            return loader

        train_dataloader._ledger_wrapped = True  # type: ignore[attr-defined]
        instance.train_dataloader = train_dataloader

    def _loss(self, batch: Any) -> Any:
        module, trainer = self._module, self._trainer
        saved = module.__dict__.get("log"), module.__dict__.get("log_dict")
        module.log, module.log_dict = _silent, _silent  # the replay's values never reach the loggers
        try:
            out = module.training_step(batch, self._batch_idx.get(id(batch), 0))
        finally:
            for name, value in zip(("log", "log_dict"), saved, strict=True):
                if value is None:
                    module.__dict__.pop(name, None)
                else:
                    setattr(module, name, value)
        loss = loss_of_output(out)
        accumulate = getattr(trainer, "accumulate_grad_batches", 1) or 1
        return loss / accumulate if accumulate > 1 else loss

    def epoch_start(self, trainer: Any, scaler: Any) -> None:
        capture = ledger_capture(scaler)
        if capture is not None:
            capture.watch_sampler(trainer.train_dataloader)

    def batch_start(self, trainer: Any, scaler: Any, batch: Any, batch_idx: int) -> None:
        capture = ledger_capture(scaler)
        if capture is None or capture.replaying:
            return
        if len(self._batch_idx) > 4096:
            self._batch_idx.clear()
        self._batch_idx[id(batch)] = batch_idx
        capture.on_batch(batch, epoch=trainer.current_epoch, batch_idx=batch_idx)

    def batch_skipped(self, scaler: Any) -> None:
        """``training_step`` returned ``None`` (automatic optimization: no backward, no optimizer step, as
        when a ``skip_batches.json`` is honoured): the batch is withdrawn from the coming step."""
        capture = ledger_capture(scaler)
        if capture is not None:
            capture.withdraw()

    def read(self, scaler: Any) -> None:
        """After the log interval's read (which carried the skip truth's outcomes into the ledger, and the
        ledger to the loop, which tells it in the summary)."""
        self._batch_idx.clear()
