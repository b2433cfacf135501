"""Skip truth through the logging loop: the outcome metrics on the dashboards, the summary, ``report``, and
one finding when a scheduler or an EMA advanced on skipped steps (the plain loop's known answer)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import skip_runs as sr  # noqa: E402

from lossscale_callbacks import InMemorySink, LoggingLoop  # noqa: E402
from lossscale_callbacks._health import LossScaleHealthWarning  # noqa: E402
from lossscale_callbacks.loop._skip_truth import SkipTruth  # noqa: E402
from lossscale_callbacks.skips._followers import FollowerCheck, FollowerCount  # noqa: E402
from lossscale_callbacks.skips._outcomes import IntervalOutcomes, StepOutcome  # noqa: E402
from lossscale_callbacks.torch import LossScaler, ScalerReader  # noqa: E402


def _plain_run(optimizer: str, hold: bool, tmp_path=None, log_every: int = 25, wandb=None):
    """The known answer in a plain loop, monitored as the docs show: ``ScalerReader(scaler).read`` handed
    to ``LoggingLoop.maybe_observe`` (the reader made before the first step finds the followers then)."""
    scaler = LossScaler(device="cpu", init_scale=2.0**10)
    memory = InMemorySink()
    loop = LoggingLoop(scaler.policy, log_every=log_every, sinks=[memory], echo=None, wandb=wandb,
                       tensorboard=None if tmp_path is None else str(tmp_path / "tb"))
    model = sr.make_model()
    opt = sr.make_optimizer(model, optimizer)
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    ema = sr.AveragedModel(model, multi_avg_fn=sr.get_ema_multi_avg_fn(0.9))
    if hold:
        scaler.hold(sched)
        scaler.hold(ema, optimizer=opt)
    reader = ScalerReader(scaler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, sr.STEPS + 1):
            opt.zero_grad()
            scaler.scale(model(sr.batch(step)).pow(2).mean()).backward()
            if step in sr.INJECTED:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update_parameters(model)
            loop.maybe_observe(step, reader.read)
        summary = loop.finish(reader.read())
    loop.close()
    health = [w for w in caught if issubclass(w.category, LossScaleHealthWarning)]
    return loop, memory, summary, health, sched, ema


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_not_held_one_finding_names_the_scheduler_and_the_ema_from_step_3(optimizer):
    loop, _, _, health, sched, ema = _plain_run(optimizer, hold=False)
    found = [v for v in loop.verdicts if v.rule == "not_held"]
    assert len(found) == 1 and found[0].step == 25  # the first read after the skips at 3 and 17
    assert len(health) == 1 and found[0].message in str(health[0].message)  # warned once
    words = found[0].message
    assert "LambdaLR advanced on 2 skipped optimizer steps (steps 3, 17)" in words
    assert "AveragedModel advanced on 2 skipped optimizer steps (steps 3, 17" in words
    assert "scaler.hold(scheduler)" in words and "scaler.hold(ema, optimizer=optimizer)" in words
    assert sched.last_epoch == 100 and int(ema.n_averaged) == 100


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_held_no_finding_and_the_metrics_count_97_applied(optimizer):
    loop, memory, summary, health, sched, ema = _plain_run(optimizer, hold=True)
    assert [v.rule for v in loop.verdicts] == []
    assert sched.last_epoch == 97 and int(ema.n_averaged) == 97
    assert memory.series("loss_scale/applied_steps")[-1] == (100, 97.0)
    assert memory.series("loss_scale/skipped_overflow")[-1] == (100, 3.0)
    assert [v for _, v in memory.series("loss_scale/applied_in_interval")] == [23.0, 24.0, 25.0, 25.0]
    assert memory.series("loss_scale/skipped_spike")[-1] == (100, 0.0)
    assert "Of the 100 optimizer steps, 97 were applied and 3 skipped (3 for an overflow)." in summary
    assert health == []


def test_the_outcomes_reach_tensorboard_wandb_and_report(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from report_json import the_read_run

    from lossscale_callbacks._cli import main
    from lossscale_callbacks.tensorboard._reader import read_run
    from lossscale_callbacks.wandb._reader import read_run as read_wandb
    from lossscale_callbacks.wandb._reader import read_run_info, wait_until_finished

    _plain_run("fused", hold=True, tmp_path=tmp_path,
               wandb={"project": "skip", "dir": str(tmp_path / "wb"), "mode": "offline"})
    series = read_run(str(tmp_path / "tb"))
    assert series["loss_scale/applied_steps"][-1] == (100, 97.0)
    assert series["loss_scale/skipped_overflow"][-1] == (100, 3.0)
    wait_until_finished(str(tmp_path / "wb"))
    logged = read_wandb(str(tmp_path / "wb"))
    assert logged["loss_scale/applied_steps"][-1] == (100, 97.0)
    assert read_run_info(str(tmp_path / "wb" / "wandb")).summary["loss_scale/total_applied_steps"] == 97
    capsys.readouterr()
    assert main(["report", str(tmp_path / "tb"), "--json"]) == 0
    run = the_read_run(capsys.readouterr().out)
    assert run["applied_steps"] == 97 and run["skipped_by_cause"]["overflow"] == 3
    assert "Applied steps: 97; skipped by cause: 3 overflow" in run["summary"]


def test_a_state_without_outcomes_gives_them_from_the_state():
    """Keras and a plain scaler.get_state: the skipped steps are the run's cause, no spike."""
    memory = InMemorySink()
    loop = LoggingLoop(None, sinks=[memory], echo=None)
    loop.observe({"steps": 10, "skipped_steps": 2, "scale": 8.0, "growth_counter": 0, "hysteresis_left": 0})
    row = memory.records[-1][1]
    assert (row["loss_scale/applied_steps"], row["loss_scale/skipped_overflow"],
            row["loss_scale/skipped_spike"]) == (8, 2, 0)


def test_the_skip_truth_room_and_the_check_alone():
    truth = SkipTruth()
    from lossscale_callbacks import FixedPolicy, LossScaleState
    from lossscale_callbacks._metrics import MetricsTracker

    tracker = MetricsTracker(None)
    snap = tracker.observe(LossScaleState(1.0, 0, 0, 0, 500))
    listed = (StepOutcome(60, "spike", 1.0), StepOutcome(70, "applied_nonfinite", 1.0))
    interval = IntervalOutcomes(1, 500, listed, {"spike": 1, "applied_nonfinite": 1})
    metrics = truth.metrics(snap, interval, FixedPolicy(1.0))
    assert metrics["loss_scale/applied_steps"] == 499 and metrics["loss_scale/skipped_spike"] == 1
    assert metrics["loss_scale/applied_nonfinite"] == 1 and metrics["loss_scale/skipped_nonfinite"] == 0
    assert "1 by the spike rule" in truth.sentence() and "monitoring only" in truth.sentence()
    # A trainer's step counter counts attempted steps: flagged once, with its fix.
    check = FollowerCheck()
    step = FollowerCount("Trainer.global_step", "trainer_step", 0, base=(0, 0, 0))
    words = check.observe(100, 97, [3, 17, 42], [step._replace(count=100)])
    assert "trainer's step counter Trainer.global_step advanced on 3 skipped" in words
    assert "raise max_steps by the skipped count" in words
    # An epoch scheduler (steps less often) and a follower with no skips since: never flagged.
    assert check.observe(200, 197, [], [FollowerCount("StepLR", "scheduler", 2, base=(0, 0, 0))]) is None
