"""``LossScalePlugin(sync_found_inf="auto")`` under ``ModelParallelStrategy``, one CPU process (gloo).

Writes to ``argv[1]`` (JSON) the scaler's ``sync_found_inf`` when training starts, at each optimizer
step, and after ``fit``: the plugin decides it when the Trainer sets the run up, not during training.
Run as its own process: the strategy initialises ``torch.distributed``.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import tiny
from lightning.pytorch.strategies import ModelParallelStrategy

from lossscale_callbacks.lightning._plugin import LossScalePlugin


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.seen: dict = {"steps": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["train_start"] = trainer.precision_plugin.scaler.sync_found_inf

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.seen["steps"].append(trainer.precision_plugin.scaler.sync_found_inf)


class Tiny(tiny.module_class(pl)):
    def configure_model(self) -> None:
        """ModelParallelStrategy asks the module to parallelise itself; the tiny one stays as it is."""


def main(out: str) -> None:
    tiny.quiet_lightning_warnings()
    plugin = LossScalePlugin(device="cpu")
    recorder = Recorder()
    trainer = pl.Trainer(plugins=[plugin], strategy=ModelParallelStrategy(), callbacks=[recorder],
                         **tiny.trainer_kwargs(max_steps=3))
    trainer.fit(Tiny(snapshots=False), tiny.data())
    recorder.seen["after_fit"] = plugin.scaler.sync_found_inf
    with open(out, "w") as f:
        json.dump(recorder.seen, f)
    tiny.exit_cleanly()


if __name__ == "__main__":
    main(sys.argv[1])
