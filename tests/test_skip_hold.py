"""Skip truth in a plain loop: ``scaler.hold(scheduler)`` and ``scaler.hold(ema)`` advance only on applied
steps, bit for bit the stock run with the skipped steps removed, without a host read in the step."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import skip_runs as sr  # noqa: E402
from aten_ops import AtenOps  # noqa: E402
from torch.optim import lr_scheduler as lrs  # noqa: E402
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_multi_avg_fn  # noqa: E402

from lossscale_callbacks.torch import _held  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

OPTIMIZERS = ("fused", "foreach")
# The ops a held scheduler and a held EMA add to a fused step: the applied flag (1), the scheduler's
# count and lookup (2), the EMA's weight and its n_averaged correction (3).
HOLD_OPS_FUSED = 6


def _scaler() -> LossScaler:
    return LossScaler(device="cpu", init_scale=2.0**10)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("scheduler", sorted(sr.SCHEDULERS))
def test_held_the_schedule_and_the_ema_are_the_stock_runs_without_the_skipped_steps(optimizer, scheduler):
    ref = sr.reference(optimizer, scheduler)
    scaler = _scaler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler before optimizer" warning either
        run = sr.injected(scaler, optimizer, scheduler)
        scaler.sync_held()
    assert run.lrs == ref.lrs  # the learning rate of every applied step, bit for bit
    assert sr.scheduler_count(run.scheduler) == sr.scheduler_count(ref.scheduler) == sr.APPLIED
    assert run.scheduler.get_last_lr() == ref.scheduler.get_last_lr()
    assert int(run.ema.n_averaged) == int(ref.ema.n_averaged) == sr.APPLIED
    assert torch.equal(sr.flat(run.model), sr.flat(ref.model))
    assert torch.equal(sr.flat(run.ema), sr.flat(ref.ema))
    assert scaler.read_outcomes().skipped_steps == sr.INJECTED
    want = "read" if scheduler == "OneCycleLR" and optimizer == "fused" else (
        "device" if optimizer == "fused" else "host")
    assert [f.mode for f in scaler.held] == [want, "device" if optimizer == "fused" else "host"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_per_tensor_ema_is_held_too(optimizer):
    """get_ema_avg_fn, as Lightning's EMAWeightAveraging makes it: on the device path its decay becomes 1
    after a skipped step, the float32 products the stock function's."""
    ref = sr.reference(optimizer, "LambdaLR", ema_kind="per_tensor")
    scaler = _scaler()
    run = sr.injected(scaler, optimizer, "LambdaLR", ema_kind="per_tensor")
    scaler.sync_held()
    assert scaler.held[1].mode == ("device" if optimizer == "fused" else "host")
    assert int(run.ema.n_averaged) == sr.APPLIED
    assert torch.equal(sr.flat(run.ema), sr.flat(ref.ema))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_not_held_the_schedule_and_the_ema_advance_on_the_skipped_steps(optimizer):
    """What the issue reports, and what the held run's assertions would catch."""
    ref = sr.reference(optimizer, "LambdaLR")
    run = sr.injected(_scaler(), optimizer, "LambdaLR", hold=False)
    assert run.lrs != ref.lrs
    assert run.scheduler.last_epoch == sr.STEPS and int(run.ema.n_averaged) == sr.STEPS
    assert {int(s["step"]) for s in run.optimizer.state.values()} == {sr.APPLIED}


def test_a_skipped_first_step_warns_nothing_when_held_and_warns_with_the_stock_scaler():
    """pytorch#55585, Lightning#5558: the first step skipped, then scheduler.step()."""

    def first_steps(scaler, hold):
        model = sr.make_model()
        opt = sr.make_optimizer(model, "foreach")
        sched = lrs.LambdaLR(opt, lambda s: 0.5**s)
        if hold:
            scaler.hold(sched)
        for step in (1, 2):
            scaler.scale(model(sr.batch(step)).sum()).backward()
            if step == 1:
                model[0].weight.grad[0, 0] = float("nan")
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
        return sched

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = first_steps(_scaler(), hold=True)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert sched.last_epoch == 1
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        first_steps(torch.amp.GradScaler("cpu"), hold=False)


def _step_ops(hold: bool, optimizer: str) -> list[str]:
    scaler = _scaler()
    model = sr.make_model()
    opt = sr.make_optimizer(model, optimizer)
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    if hold:
        scaler.hold(sched)
        scaler.hold(ema, optimizer=opt)
    for step in range(1, 6):
        opt.zero_grad()
        scaler.scale(model(sr.batch(step)).pow(2).mean()).backward()
        if step == 5:
            model[0].weight.grad[0, 0] = float("inf")
        with AtenOps() as ops:
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update_parameters(model)
    return ops.names


def test_holding_on_the_fused_path_adds_six_ops_and_no_host_read():
    stock, held = _step_ops(False, "fused"), _step_ops(True, "fused")
    assert len(held) - len(stock) == HOLD_OPS_FUSED, (stock, held)
    # AveragedModel.update_parameters reads n_averaged twice itself (torch's code); the hold adds none.
    assert held.count("_local_scalar_dense") == stock.count("_local_scalar_dense") == 2
    assert held.count("item") == 0


def test_holding_on_the_host_path_adds_nothing():
    stock, held = _step_ops(False, "foreach"), _step_ops(True, "foreach")
    assert len(held) <= len(stock)  # a skipped step's held calls do less than the stock ones
    assert held.count("_local_scalar_dense") <= stock.count("_local_scalar_dense")


def test_a_held_schedulers_checkpoints_are_the_stock_ones_and_loading_moves_the_hold(tmp_path):
    scaler = _scaler()
    run = sr.injected(scaler, "fused", "LambdaLR")
    state = run.scheduler.state_dict()  # reads first: up to date without sync_held()
    assert state["last_epoch"] == sr.APPLIED and "step" not in state and "state_dict" not in state
    opt_state = run.optimizer.state_dict()
    assert all(isinstance(g["lr"], float) for g in opt_state["param_groups"])
    torch.save(state, tmp_path / "sched.pt")
    run.optimizer.load_state_dict(opt_state)
    run.scheduler.load_state_dict(torch.load(tmp_path / "sched.pt", weights_only=False))
    lr_before = float(run.optimizer.param_groups[0]["lr"])
    for step in range(101, 104):  # three more applied steps continue the schedule from 97
        run.optimizer.zero_grad()
        scaler.scale(run.model(sr.batch(step)).pow(2).mean()).backward()
        scaler.step(run.optimizer)
        scaler.update()
        run.scheduler.step()
    scaler.sync_held()
    assert run.scheduler.last_epoch == sr.APPLIED + 3
    plain = torch.optim.SGD([torch.zeros(1)], lr=1e-2)
    stock = lrs.LambdaLR(plain, lambda s: 1.0 / (1.0 + 0.1 * s))
    for _ in range(sr.APPLIED + 3):
        plain.step()
        stock.step()
    assert float(run.optimizer.param_groups[0]["lr"]) == stock.get_last_lr()[0] != lr_before


def test_release_puts_back_the_stock_methods_and_float_learning_rates():
    scaler = _scaler()
    run = sr.injected(scaler, "fused", "CosineAnnealingLR")
    scaler.release()
    assert scaler.held == []
    assert "step" not in vars(run.scheduler) and "update_parameters" not in vars(run.ema)
    assert all(type(g["lr"]) is float for g in run.optimizer.param_groups)
    assert run.scheduler.last_epoch == sr.APPLIED
    with pytest.raises(ValueError, match="not held"):
        scaler.release(run.scheduler)


def test_a_schedule_longer_than_the_table_and_a_schedule_that_ends(monkeypatch):
    monkeypatch.setattr(_held, "TABLE_CHUNK", 8)
    ref = sr.reference("fused", "transformers_linear")
    run = sr.injected(_scaler(), "fused", "transformers_linear")
    assert run.lrs == ref.lrs  # the table grew many times
    # OneCycleLR raises past total_steps; held, it raises at the same applied step, not before.
    model = sr.make_model()
    opt = sr.make_optimizer(model, "fused")
    scaler = _scaler()
    sched = scaler.hold(lrs.OneCycleLR(opt, max_lr=0.1, total_steps=5, cycle_momentum=False))
    for step in range(1, 8):
        scaler.scale(model(sr.batch(step)).sum()).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step < 7:
            sched.step()  # the 6th call is the 5th applied one: the schedule's last
        else:  # the 6th applied step: where the stock scheduler raises
            with pytest.raises(ValueError, match="Tried to step"):
                sched.step()


def test_plateau_schedulers_and_custom_averages_hold_with_one_read_per_step():
    scaler = _scaler()
    model = sr.make_model()
    opt = sr.make_optimizer(model, "fused")
    plateau = scaler.hold(lrs.ReduceLROnPlateau(opt, patience=0))
    custom = scaler.hold(AveragedModel(model, avg_fn=lambda avg, new, n: avg + (new - avg) / (n + 1)),
                         optimizer=opt)
    swa = scaler.hold(AveragedModel(model, multi_avg_fn=get_swa_multi_avg_fn()), optimizer=opt)
    assert [f.mode for f in scaler.held] == ["read", "read", "device"]
    for step in range(1, 5):
        scaler.scale(model(sr.batch(step)).sum()).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        plateau.step(1.0)
        custom.update_parameters(model)
        swa.update_parameters(model)
    scaler.sync_held()
    assert int(custom.n_averaged) == int(swa.n_averaged) == 3
    assert scaler.held[0].held == 1  # the plateau scheduler's step after the skipped one


def test_hold_checks_its_arguments():
    scaler = _scaler()
    model = sr.make_model()
    opt, other = sr.make_optimizer(model, "fused"), sr.make_optimizer(model, "foreach")
    ema = AveragedModel(model)
    with pytest.raises(ValueError, match="pass optimizer="):
        scaler.hold(ema)  # no optimizer stepped yet
    sched = scaler.hold(lrs.StepLR(opt, 1))
    with pytest.raises(ValueError, match="held already"):
        scaler.hold(sched)
    with pytest.raises(ValueError, match="takes an LR scheduler"):
        scaler.hold(model)
    for o in (opt, other):
        scaler.scale(model(sr.batch(1)).sum()).backward()
        scaler.step(o)
        scaler.update()
    with pytest.raises(ValueError, match="stepped 2 optimizers"):
        scaler.hold(ema)
    assert LossScaler(enabled=False).hold(sched) is sched
