"""Skip truth in Lightning: the known answer (100 steps, an Inf at 3, 17, 42) with LossScalePlugin, its
schedulers and Lightning's EMAWeightAveraging held by default, fused and foreach AdamW; not held, one
finding names the scheduler, the EMA and trainer.global_step."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import skip_runs as sr  # noqa: E402
from lightning_scripts import tiny  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks._health import LossScaleHealthWarning  # noqa: E402
from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin  # noqa: E402

tiny.quiet_lightning_warnings()


class KnownAnswer(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = sr.make_model()
        self.kind = optimizer
        self.lrs: list[float] = []  # the learning rate of every applied step

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def on_after_backward(self):
        if self.trainer.global_step + 1 in sr.INJECTED:
            with torch.no_grad():
                self.net[0].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer):
        if self.trainer.global_step + 1 not in sr.INJECTED:
            self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self):
        opt = sr.make_optimizer(self.net, self.kind)
        scheduler = sr.SCHEDULERS["LambdaLR"](opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data():
    batches = [sr.batch(step) for step in range(1, sr.STEPS + 1)]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches)), batch_size=8)


def _fit(optimizer: str, hold: bool):
    model = KnownAnswer(optimizer)
    ema = pl.callbacks.EMAWeightAveraging(decay=0.9)
    monitor = LossScaleMonitor(log_every=25, echo=None)
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10),
                             hold_lr_schedulers=hold)
    trainer = pl.Trainer(plugins=[plugin], callbacks=[ema, monitor],
                         **tiny.trainer_kwargs(max_steps=sr.STEPS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _data())
    health = [w for w in caught if issubclass(w.category, LossScaleHealthWarning)]
    return trainer, model, ema, monitor, plugin, health


def _stock_lrs() -> list[float]:
    """The stock LambdaLR's values, stepped once per applied update (the run without the three steps)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    lrs = []
    for _ in range(sr.APPLIED):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_held_by_default_the_schedule_and_the_ema_follow_the_97_applied_steps(optimizer):
    trainer, model, ema, monitor, plugin, health = _fit(optimizer, hold=True)
    assert model.lrs == _stock_lrs()  # bit for bit
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == sr.APPLIED and int(ema._average_model.n_averaged) == sr.APPLIED
    assert plugin.lr_scheduler_lag == 3
    last = monitor.loop.last
    assert (last.step, last.skipped_steps) == (sr.STEPS, 3)
    # Only trainer.global_step is flagged: it counts attempted steps, and max_steps ends the run.
    (found,) = [v for v in monitor.loop.verdicts if v.rule == "not_held"]
    assert "Trainer.global_step advanced on 2 skipped" in found.message and "LambdaLR" not in found.message
    assert "AveragedModel" not in found.message and len(health) == 1
    assert "Of the 100 optimizer steps, 97 were applied and 3 skipped (3 for an overflow)." in monitor.summary


def test_not_held_one_finding_names_the_scheduler_the_ema_and_the_trainers_step():
    trainer, model, ema, monitor, _, health = _fit("fused", hold=False)
    assert model.lrs != _stock_lrs()
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == sr.STEPS
    assert int(ema._average_model.n_averaged) == sr.STEPS
    (found,) = [v for v in monitor.loop.verdicts if v.rule == "not_held"]
    for name in ("LambdaLR advanced on 2 skipped optimizer steps (steps 3, 17)",
                 "AveragedModel advanced on 2", "Trainer.global_step advanced on 2"):
        assert name in found.message
    assert found.step == 25 and len(health) == 1
