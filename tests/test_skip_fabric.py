"""Skip truth with Lightning Fabric: the known answer (100 steps, an Inf at 3, 17, 42). Fabric does not see
the user's scheduler or EMA: ``monitor.hold(...)`` holds them (the scaler's ``hold``), or the monitor flags
them."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import skip_runs as sr  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks._health import LossScaleHealthWarning  # noqa: E402
from lossscale_callbacks.lightning.fabric import FabricLossScaleMonitor, LossScaleFabricPlugin  # noqa: E402


def _run(optimizer: str, hold: bool):
    plugin = LossScaleFabricPlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.launch()
    model = sr.make_model()
    ema = sr.AveragedModel(model, multi_avg_fn=sr.get_ema_multi_avg_fn(0.9))
    raw = sr.make_optimizer(model, optimizer)
    sched = sr.SCHEDULERS["LambdaLR"](raw)
    model, opt = fabric.setup(model, raw)
    monitor = FabricLossScaleMonitor(fabric, log_every=25, echo=None)
    if hold:
        monitor.hold(sched)
        monitor.hold(ema, optimizer=opt)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, sr.STEPS + 1):
            opt.zero_grad()
            fabric.backward(model(sr.batch(step)).float().pow(2).mean())
            if step in sr.INJECTED:
                model.module[0].weight.grad[0, 0] = float("inf")
            else:
                lrs.append(float(raw.param_groups[0]["lr"]))
            opt.step()
            sched.step()
            ema.update_parameters(model.module)
            monitor.step()
        monitor.finish()
    health = [w for w in caught if issubclass(w.category, LossScaleHealthWarning)]
    return sched, ema, monitor, lrs, health


def _stock_lrs() -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    out = []
    for _ in range(sr.APPLIED):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_fabric_held_the_schedule_and_the_ema_follow_the_97_applied_steps(optimizer):
    sched, ema, monitor, lrs, health = _run(optimizer, hold=True)
    assert lrs == _stock_lrs()
    assert sched.last_epoch == sr.APPLIED and int(ema.n_averaged) == sr.APPLIED
    assert monitor.loop.outcome_metrics()["loss_scale/skipped_overflow"] == 3 and health == []


def test_fabric_not_held_one_finding_names_the_scheduler_and_the_ema():
    sched, ema, monitor, _, health = _run("fused", hold=False)
    assert sched.last_epoch == sr.STEPS and int(ema.n_averaged) == sr.STEPS
    (found,) = [v for v in monitor.loop.verdicts if v.rule == "not_held"]
    assert "LambdaLR advanced on 2 skipped optimizer steps (steps 3, 17)" in found.message
    assert "AveragedModel advanced on 2" in found.message and len(health) == 1
