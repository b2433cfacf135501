"""Lightning quickstart: fp16 with ``LossScalePlugin``, the loss scale on TensorBoard and W&B.

Trains a small regression model on synthetic data (on the CPU too: the plugin runs real float16
autocast there), logs ``loss_scale/*`` with ``LossScaleMonitor`` through a ``TensorBoardLogger``
(under ``runs/``) and an offline ``WandbLogger``, and prints a one-paragraph summary at the end.

    python examples/lightning_quickstart.py --steps 200
    tensorboard --logdir runs
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

try:  # either Lightning namespace works
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover
    import pytorch_lightning as pl

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> pl.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="runs", help="TensorBoard (and W&B) folder")
    parser.add_argument("--no-wandb", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(4096, 64)
    data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=64, shuffle=True)

    loggers = [pl.loggers.TensorBoardLogger(args.out, name="quickstart")]
    if not args.no_wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        loggers.append(pl.loggers.WandbLogger(project="lossscale-quickstart", offline=True,
                                              save_dir=args.out))

    trainer = pl.Trainer(
        max_steps=args.steps,
        plugins=[LossScalePlugin("16-mixed", policy=DynamicPolicy(growth_interval=100, hysteresis=2))],
        callbacks=[LossScaleMonitor(prog_bar=True, check_alignment=True)],
        logger=loggers,
        log_every_n_steps=10,
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(), data)
    if not args.no_wandb:
        import wandb

        wandb.finish()
    return trainer


if __name__ == "__main__":
    main()
