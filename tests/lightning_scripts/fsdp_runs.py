"""FSDP on 2 CPU processes (gloo), with the Trainer and with Fabric, an Inf injected on rank 1 only.

Run by ``tests/test_lightning_fsdp.py`` as one subprocess for every mode (Lightning launches rank 1 by
re-running this script at the first mode; the later Trainers and Fabrics find the process group there
and launch nothing, so the two interpreters start once, not once a mode). The Inf goes into rank 1's
shard of a gradient after FSDP's reduce-scatter, where rank 0 cannot see it: only an all-reduced
overflow flag makes both ranks skip.

Lightning refuses ``strategy="fsdp"`` without a GPU, and torch's FSDP needs ``device_id=cpu`` to run on
the CPU, so the strategies here are FSDP strategy subclasses that wrap the model with that one argument
added; everything else is Lightning's.

Modes (run in the order given; each writes ``<out>/<mode>_rank<r>.json``):

* ``trainer``: ``Trainer(strategy=FSDP, plugins=[LossScaleFSDPPlugin()])`` with ``LossScaleMonitor`` and a
  ``TensorBoardLogger``; ``ModelCheckpoint`` writes ``<out>/epoch=0.ckpt`` at the end of the first
  epoch, which is ``--checkpoint-step`` optimizer steps long.
* ``trainer_resumed``: the same run resumed from ``epoch=0.ckpt``.
* ``trainer_unsynced``: the control, ``sync_found_inf=False``: only rank 1 skips.
* ``trainer_stock``: Lightning's own ``FSDPPrecision`` with a CPU ``ShardedGradScaler``, read by the monitor.
* ``fabric``: ``Fabric(strategy=FSDP, plugins=[LossScaleFabricFSDPPlugin()])`` and
  ``FabricLossScaleMonitor``;
  ``fabric.save`` writes ``<out>/fabric_ckpt`` (model, optimizer and the monitor, which carries the scaler)
  after step ``--checkpoint-step``.
* ``fabric_resumed``: the same run resumed from ``fabric_ckpt``.
* ``fabric_stock``: Fabric's own ``FSDPPrecision`` with a CPU ``ShardedGradScaler``, read by the monitor.

Usage: python fsdp_runs.py OUT_DIR MODE [MODE ...] [--steps 5] [--inject-steps 1,3] [--checkpoint-step 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import lightning.pytorch as pl
import tiny  # this folder, first on sys.path when the script runs
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.lightning import LossScaleFSDPPlugin, LossScaleMonitor
from lossscale_callbacks.lightning.fabric import (
    FabricLossScaleMonitor,
    LossScaleFabricFSDPPlugin,
)

POLICY = DynamicPolicy(initial_scale=2.0**10, growth_interval=100)
STATE_DICT_TYPE = os.environ.get("FSDP_STATE_DICT_TYPE", "sharded")


class CPUFSDPStrategy(pl.strategies.FSDPStrategy):
    """Lightning's FSDPStrategy on the CPU: the model is wrapped with ``device_id=cpu`` (see above)."""

    def _setup_model(self, model):
        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(model, mixed_precision=self.mixed_precision_config,
                                             sharding_strategy=self.sharding_strategy,
                                             device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(model)


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    def setup_module(self, module):
        if not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            module = FullyShardedDataParallel(module, mixed_precision=self.mixed_precision_config,
                                              sharding_strategy=self.sharding_strategy,
                                              device_id=torch.device("cpu"), **self._fsdp_kwargs)
        return super().setup_module(module)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _data(batches_per_rank: int):
    """One sample repeated: every batch on every rank is the same, so a resumed run sees the same data
    whatever the sampler does on resume (Lightning restarts a plain DataLoader's epoch)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, generator=g).repeat(8 * 2 * batches_per_rank, 1)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 0.5)


def _poison(parameters, rank: int) -> None:
    """An Inf in rank 1's own shard of the first gradient it holds (after the reduce-scatter)."""
    if rank != 1:
        return
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None and p.grad.numel():
                p.grad.view(-1)[0] = math.inf
                return


def _full_params(module) -> list[list[float]]:
    fsdp = next(m for m in module.modules() if isinstance(m, FullyShardedDataParallel))
    with FullyShardedDataParallel.summon_full_params(fsdp):
        return [p.detach().float().flatten().tolist() for p in fsdp.parameters()]


class Module(pl.LightningModule):
    def __init__(self, inject_steps: list[int]) -> None:
        super().__init__()
        self.net = _net()
        self.inject_steps = inject_steps
        self.states: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inject_steps:
            _poison(self.parameters(), self.global_rank)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        scaler = self.trainer.strategy.precision_plugin.scaler
        ours = hasattr(scaler, "get_state")
        state = scaler.get_state()._asdict() if ours else {"scale": scaler.get_scale()}
        self.states.append({**state, "batch": float(batch[0].sum())})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def run_trainer(mode: str, out: str, steps: int, inject_steps: list[int], checkpoint_step: int) -> None:
    if mode == "trainer_stock":
        plugin = pl.plugins.precision.FSDPPrecision("16-mixed")
        # FSDPPrecision's scaler targets CUDA; on the CPU a user gives it a CPU one.
        plugin.scaler = ShardedGradScaler(device="cpu", init_scale=POLICY.initial_scale, growth_interval=100)
    else:
        plugin = LossScaleFSDPPlugin(device="cpu", policy=POLICY, sync_found_inf=mode != "trainer_unsynced")
    logger = pl.loggers.TensorBoardLogger(os.path.join(out, "tb"), name=mode, version=0)
    model = Module(inject_steps)
    callbacks = [LossScaleMonitor(log_every=1, health=None)]
    if mode == "trainer":
        # how users checkpoint: at each epoch's end (an epoch is --checkpoint-step batches per rank, so that
        # the resumed run sees the same batches; Lightning restarts a plain DataLoader's epoch on resume)
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1,
                                                      every_n_epochs=1, save_on_train_epoch_end=True))
    strategy = CPUFSDPStrategy(process_group_backend="gloo", state_dict_type=STATE_DICT_TYPE)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                         plugins=[plugin], callbacks=callbacks, max_steps=steps, logger=[logger],
                         enable_checkpointing=mode == "trainer", enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(_data(checkpoint_step), batch_size=8, shuffle=False)
    resume = os.path.join(out, "epoch=0.ckpt") if mode == "trainer_resumed" else None
    trainer.fit(model, loader, ckpt_path=resume)
    params = _full_params(trainer.strategy.model)
    result = {"rank": trainer.global_rank, "states": model.states, "params": params}
    with open(os.path.join(out, f"{mode}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


def run_fabric(mode: str, out: str, steps: int, inject_steps: list[int], checkpoint_step: int) -> None:
    if mode == "fabric_stock":
        from lightning.fabric.plugins.precision import FSDPPrecision

        plugin = FSDPPrecision("16-mixed")
        plugin.scaler = ShardedGradScaler(device="cpu", init_scale=POLICY.initial_scale, growth_interval=100)
    else:
        plugin = LossScaleFabricFSDPPlugin(device="cpu", policy=POLICY)
    from lightning.fabric.loggers import TensorBoardLogger

    logger = TensorBoardLogger(os.path.join(out, "tb"), name=mode, version=0)
    strategy = CPUFabricFSDPStrategy(process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], loggers=[logger])
    fabric.launch()
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_data(steps), batch_size=8, shuffle=False))
    monitor = FabricLossScaleMonitor(fabric, log_every=1, health=None)
    ckpt = os.path.join(out, "fabric_ckpt")
    first = 0
    if mode == "fabric_resumed":
        # The monitor carries the scaler's state (Fabric does not checkpoint its precision plugin). It
        # is read from the remainder: Fabric's FSDP loader puts saved dicts back into `state` instead
        # of calling load_state_dict, other strategies call it; the remainder is the same everywhere.
        remainder = fabric.load(ckpt, {"model": model, "optimizer": optimizer})
        monitor.load_state_dict(remainder["loss_scale"])
        first = remainder["step"]
    states = []
    for step, (x, y) in enumerate(loader, start=first):
        if step == steps:
            break
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if step in inject_steps:
            _poison(model.parameters(), fabric.global_rank)
        optimizer.step()
        monitor.step()
        states.append({**{k.split("/")[-1]: v for k, v in monitor.loop.last.metrics().items()}, "step": step})
        if mode == "fabric" and step + 1 == checkpoint_step:
            state = {"model": model, "optimizer": optimizer, "loss_scale": monitor, "step": step + 1}
            fabric.save(ckpt, state)
    monitor.finish()
    result = {"rank": fabric.global_rank, "states": states, "params": _full_params(model)}
    with open(os.path.join(out, f"{mode}_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(result, f)


MODES = ("trainer", "trainer_resumed", "trainer_unsynced", "trainer_stock", "fabric", "fabric_resumed",
         "fabric_stock")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("modes", nargs="+", choices=MODES,
                        help="run in this order: a resumed mode reads what its mode before wrote")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inject-steps", default="1,3", help="comma-separated global steps")
    parser.add_argument("--checkpoint-step", type=int, default=3)
    args = parser.parse_args()
    inject_steps = [int(s) for s in args.inject_steps.split(",")]
    for mode in args.modes:
        print(f"[fsdp_runs] {mode}", flush=True)  # which mode a failure belongs to
        run = run_fabric if mode.startswith("fabric") else run_trainer
        run(mode, args.out, args.steps, inject_steps, args.checkpoint_step)
    tiny.exit_cleanly()


if __name__ == "__main__":
    main()
