"""Skip truth with Accelerate and the Transformers Trainer: the known answer (100 steps, an Inf at 3, 17, 42).

Accelerate: ``install_loss_scaler`` holds the schedulers ``prepare`` wraps (a fused AdamW too, whose skip
Accelerate's ``step_was_skipped`` cannot see: accelerate#4242), the EMA held with ``scaler.hold``. The
Trainer with its default ``adamw_torch_fused``: the scheduler holds on the skipped steps.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import skip_runs as sr  # noqa: E402
from hf_scripts import tiny_accelerate, tiny_trainer  # noqa: E402
from transformers import TrainerCallback, get_linear_schedule_with_warmup  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks._health import LossScaleHealthWarning  # noqa: E402
from lossscale_callbacks.accelerate import AccelerateLossScaleMonitor, install_loss_scaler  # noqa: E402
from lossscale_callbacks.transformers import LossScaleTrainerCallback  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate():
    tiny_accelerate.reset_accelerate()
    yield
    tiny_accelerate.reset_accelerate()


def _listing(monitor):
    """Every interval's listed outcomes, as the loop receives them."""
    seen, read = [], monitor.reader.read

    def reading(*args, **kwargs):
        state = read(*args, **kwargs)
        if getattr(state, "outcomes", None) is not None:
            seen.extend(state.outcomes.outcomes)
        return state

    monitor.reader.read = reading
    return seen


def _stock_lrs(make, lr: float, steps: int) -> list[float]:
    """The stock scheduler's learning rates, stepped once per applied update."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _accelerate_run(optimizer: str, hold: bool):
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=2.0**10), hold=hold)
    model = sr.make_model()
    ema = sr.AveragedModel(model, multi_avg_fn=sr.get_ema_multi_avg_fn(0.9))
    opt = sr.make_optimizer(model, optimizer)
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    model, opt, prepared = accelerator.prepare(model, opt, sched)
    if hold:
        scaler.hold(ema, optimizer=opt)
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=25, trackers=False, echo=None)
    listed, lrs = _listing(monitor), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, sr.STEPS + 1):
            accelerator.backward(model(sr.batch(step)).float().pow(2).mean())
            if step in sr.INJECTED:
                model[0].weight.grad.view(-1)[0] = float("inf")
            else:
                lrs.append(float(opt.param_groups[0]["lr"]))
            opt.step()
            prepared.step()
            opt.zero_grad()
            ema.update_parameters(model)
            monitor.step()
        monitor.finish()
    health = [w for w in caught if issubclass(w.category, LossScaleHealthWarning)]
    return sched, ema, monitor, listed, lrs, health


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_accelerate_holds_the_prepared_scheduler_and_reports_exactly_the_injected_steps(optimizer):
    sched, ema, monitor, listed, lrs, health = _accelerate_run(optimizer, hold=True)
    assert [(o.step, o.cause) for o in listed] == [(s, "overflow") for s in sr.INJECTED]
    assert lrs == _stock_lrs(sr.SCHEDULERS["LambdaLR"], 1e-2, sr.APPLIED)  # bit for bit
    assert sched.last_epoch == sr.APPLIED and int(ema.n_averaged) == sr.APPLIED
    assert monitor.loop.outcome_metrics()["loss_scale/applied_steps"] == sr.APPLIED
    assert health == [] and monitor.loop.verdicts == []


def test_accelerate_not_held_one_finding_names_the_scheduler_and_the_ema():
    sched, ema, monitor, _, _, health = _accelerate_run("fused", hold=False)
    assert sched.last_epoch == sr.STEPS and int(ema.n_averaged) == sr.STEPS
    (found,) = [v for v in monitor.loop.verdicts if v.rule == "not_held"]
    assert "LambdaLR advanced on 2 skipped optimizer steps (steps 3, 17)" in found.message
    assert "AveragedModel advanced on 2" in found.message and len(health) == 1


class _RecordLrs(TrainerCallback):
    """The learning rate each applied optimizer step uses (read before the step)."""

    def __init__(self, injected: set[int]) -> None:
        self.injected, self.lrs = injected, []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step not in self.injected:
            self.lrs.append(float(optimizer.param_groups[0]["lr"]))


@pytest.mark.slow
def test_the_trainer_with_its_default_fused_optimizer_holds_the_scheduler_on_skipped_steps(tmp_path):
    injected = tuple(s - 1 for s in sr.INJECTED)  # the Trainer's global_step before each step: 0-based
    trainer = tiny_trainer.trainer(str(tmp_path), inject_at=injected, max_steps=sr.STEPS, logging_steps=25,
                                   report_to=[])
    assert trainer.args.optim == "adamw_torch_fused"
    record = _RecordLrs(set(injected))
    trainer.add_callback(record)
    callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=2.0**10), echo=None)
    callback.attach(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        listed = callback.loop._skips.last_outcomes  # the last interval's (76..100): none
    lr = trainer.args.learning_rate
    stock = _stock_lrs(lambda opt: get_linear_schedule_with_warmup(opt, 0, sr.STEPS), lr, sr.APPLIED)
    assert record.lrs == stock  # bit for bit: the schedule with the three steps removed
    assert trainer.lr_scheduler.last_epoch == sr.APPLIED
    metrics = callback.loop.outcome_metrics()
    assert metrics["loss_scale/applied_steps"] == sr.APPLIED and metrics["loss_scale/skipped_overflow"] == 3
    assert listed is not None and listed.skipped == 0
    # The Trainer's global_step counted the three (max_steps ends the run): flagged once, nothing else.
    found = [v for v in callback.loop.verdicts if v.rule == "not_held"]
    assert len(found) == 1 and "Trainer.global_step advanced on 2" in found[0].message
    assert "LambdaLR" not in found[0].message
    assert len([w for w in caught if issubclass(w.category, LossScaleHealthWarning)]) == 1
