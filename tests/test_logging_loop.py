"""The one logging loop of the core, driven from a plain loop, Keras and Lightning with a fake clock."""

from __future__ import annotations

import warnings

import pytest

from lossscale_callbacks import (
    DynamicPolicy,
    FixedPolicy,
    InMemorySink,
    LoggingLoop,
    LossScaleHealthError,
    LossScaleHealthWarning,
    initial_state,
    next_state,
)
from lossscale_callbacks import _metrics as m


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _host(steps: int, skipped: int, scale: float = 1024.0) -> dict:
    return {"steps": steps, "skipped_steps": skipped, "scale": scale, "growth_counter": 0,
            "hysteresis_left": 1}


def test_every_seconds_reads_only_when_the_fake_clock_says_so():
    clock, memory, reads = FakeClock(), InMemorySink(), []
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], every_seconds=30, clock=clock, echo=None)

    def read(step):
        reads.append(step)
        return _host(step, 0)

    for step in range(1, 101):
        clock.now += 1.0  # one second per step
        loop.maybe_observe(step, lambda step=step: read(step))
    assert reads == [30, 60, 90]  # the host read happens only at the interval
    assert [s for s, _ in memory.records] == [30, 60, 90]


def test_log_every_crossing_a_multiple_counts_even_when_the_count_jumps():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], log_every=10, echo=None)
    for step in (4, 8, 12, 13, 25, 26, 30):  # several optimizer steps per call
        loop.maybe_observe(step, lambda step=step: _host(step, 0))
    assert [s for s, _ in memory.records] == [12, 25, 30]


def test_the_policy_is_written_once_and_the_summary_at_the_end():
    memory = InMemorySink()
    policy = DynamicPolicy(initial_scale=64.0, growth_interval=5)
    loop = LoggingLoop(policy, sinks=[memory], log_every=5, echo=None)
    state = initial_state(policy)
    for _ in range(20):
        state = next_state(policy, state, True)
        loop.maybe_observe(int(state.steps), lambda: state)  # noqa: B023
    text = loop.finish(state)
    assert [tag for tag, _ in memory.texts] == ["loss_scale/policy", "loss_scale/summary"]
    assert "| growth_interval | 5 |" in memory.texts[0][1] and memory.texts[1][1] == text
    assert memory.flushes == 1
    # counts as ints, the exponent next to the scale
    metrics = memory.records[-1][1]
    assert metrics[m.LOG2_SCALE] == 10.0 and metrics[m.STEPS] == 20


def test_a_second_read_at_the_same_step_writes_nothing():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None)
    loop.observe(_host(10, 1))
    loop.observe(_host(10, 1))
    assert len(memory.records) == 1


def test_rank_rules_are_the_same_everywhere():
    """Not the writer: no sink write, no warning printed, but "raise" raises and "stop" stops."""
    memory, stopped = InMemorySink(), []
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], health="stop", writer=False,
                       stop=lambda: stopped.append(True), echo=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would fail the test
        for step in range(100, 1600, 100):
            loop.observe(_host(step, step, scale=1.0))
    assert memory.records == [] and stopped
    raising = LoggingLoop(DynamicPolicy(), health="raise", writer=False, echo=None)
    with pytest.raises(LossScaleHealthError):
        for step in range(10, 100, 10):
            raising.observe(_host(step, step, scale=1.0))


def test_a_stop_rule_sets_should_stop_for_a_hand_written_loop_and_a_new_run_clears_it():
    loop = LoggingLoop(DynamicPolicy(), health="stop", writer=False, echo=None)  # no stop= callback
    assert not loop.should_stop
    for step in range(100, 1600, 100):
        loop.observe(_host(step, step, scale=1.0))  # every step skipped, scale at the minimum
    assert loop.should_stop
    loop.start()
    assert not loop.should_stop


def test_the_writer_warns_and_alerts_sinks_that_take_verdicts():
    class AlertingSink(InMemorySink):
        def __init__(self):
            super().__init__()
            self.verdicts = []

        def alert_verdict(self, verdict):
            self.verdicts.append(verdict.rule)

    sink = AlertingSink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[sink], health="warn", writer=True, echo=None)
    with pytest.warns(LossScaleHealthWarning):
        for step in range(10, 100, 10):
            loop.observe(_host(step, step, scale=1.0))
    assert sink.verdicts == ["consecutive_skips"]


def test_the_summary_is_honest_about_what_a_short_run_cannot_tell():
    """A 300-step run with 5 % skips is not called OK nor "a low skip rate"."""
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(growth_interval=2000), sinks=[memory], echo=None)
    loop.observe(_host(150, 10))
    text = loop.finish(_host(300, 15))
    assert "Health: OK" not in text and "low skip" not in text and " low" not in text
    assert "not everything could be judged" in text and "5.00% of 300 steps were skipped" not in text
    assert "whether the scale recovers could not be judged before 4000 steps" in text


def test_a_long_enough_short_run_is_judged_over_what_it_has():
    # 600 steps, shorter than the 1000-step window but long enough after the warm-up: judged.
    loop = LoggingLoop(DynamicPolicy(growth_interval=50), echo=None)
    with pytest.warns(LossScaleHealthWarning, match=r"6\.00% of the last 500 optimizer steps"):
        for step in range(100, 700, 100):
            loop.observe(_host(step, int(step * 0.06)))
        text = loop.finish()
    assert "skip_rate" in text and "Health: 1 problem(s) found." in text


def test_a_scale_that_only_decreases_is_flagged():
    loop = LoggingLoop(DynamicPolicy(growth_interval=10), echo=None)
    with pytest.warns(LossScaleHealthWarning, match="only ever went down"):
        for i, step in enumerate(range(10, 60, 10)):
            loop.observe(_host(step, i + 1, scale=2.0 ** (15 - i)))
        loop.finish()
    assert [v.rule for v in loop.verdicts] == ["scale_only_decreases"]


def test_a_fixed_scale_is_never_at_its_minimum_and_has_no_growth_rule():
    loop = LoggingLoop(FixedPolicy(1.0), echo=None)
    for step in range(100, 3000, 100):
        loop.observe(_host(step, 0, scale=1.0))
    assert loop.last.at_min_scale is False and "Health: OK" in loop.finish()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="log_every"):
        LoggingLoop(log_every=0)
    with pytest.raises(ValueError, match="every_seconds"):
        LoggingLoop(every_seconds=-1)
    with pytest.raises(ValueError, match="health must be"):
        LoggingLoop(health="loud")
    with pytest.raises(ValueError, match="policy must be"):
        LoggingLoop(policy=3)


# ------------------------------------------------------------------ driven by the integrations


@pytest.mark.slow
def test_keras_callback_drives_the_loop(monkeypatch):
    keras = pytest.importorskip("keras")
    from keras_scripts.toy import build_model, make_data

    from lossscale_callbacks.keras import LossScaleCallback

    clock = FakeClock()
    created = []
    real = LoggingLoop.__init__

    def spy(self, *args, **kwargs):
        kwargs["clock"] = clock
        real(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(LoggingLoop, "__init__", spy)
    memory = InMemorySink()
    model = build_model()
    model.compile(optimizer="sgd", loss="mse")
    x, y = make_data(6, poisoned=(2,))
    policy = DynamicPolicy(initial_scale=256.0, growth_interval=100)
    callback = LossScaleCallback(log_every=2, policy=policy, sinks=[memory],
                                 log_metrics=[m.SCALE, m.SKIPPED_STEPS])
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[callback])
    assert len(created) == 1 and callback.loop is created[0]
    assert [s for s, _ in memory.records] == [2, 4, 6]  # optimizer steps 2, 4, 6 (the epoch's end)
    assert memory.records[-1][1][m.SKIPPED_STEPS] == 1
    assert set(k for k in history.history if k.startswith("loss_scale/")) == {m.SCALE, m.SKIPPED_STEPS}
    assert memory.texts[-1][0] == "loss_scale/summary" and callback.summary == memory.texts[-1][1]
    del keras


@pytest.mark.slow
def test_lightning_monitor_drives_the_loop():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_scripts import tiny

    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    tiny.quiet_lightning_warnings()
    memory = InMemorySink()
    monitor = LossScaleMonitor(log_every=3, sinks=[memory], health=None)
    trainer = pl.Trainer(plugins=[LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=256.0))],
                         callbacks=[monitor], **tiny.trainer_kwargs(max_steps=7))
    trainer.fit(tiny.module_class(pl)(inject_inf_at=(1,), snapshots=False), tiny.data())
    assert isinstance(monitor.loop, LoggingLoop)
    # Lightning's logging step (2, 5) then the end-of-training read; the attempted steps as a value.
    assert [(s, mt[m.STEPS]) for s, mt in memory.records] == [(2, 3), (5, 6), (7, 7)]
    assert memory.records[-1][1][m.SKIPPED_STEPS] == 1
    assert [tag for tag, _ in memory.texts] == ["loss_scale/policy", "loss_scale/summary"]


POLICY = DynamicPolicy()


def test_may_stop_says_whether_any_rule_of_the_loop_stops_training():
    from lossscale_callbacks.fp8._rules import Fp8Saturation
    from lossscale_callbacks.loop._rank_agreement import RanksDisagree

    assert LoggingLoop(POLICY, log_every=10, health="stop", echo=None).may_stop
    assert LoggingLoop(None, log_every=10, health="stop", echo=None).may_stop  # the fp8 rules alone
    for health in ("warn", "raise", None, False):
        assert not LoggingLoop(POLICY, log_every=10, health=health, echo=None).may_stop, health
    # One rule of a list is enough, whichever room judges it (the fp8 reads, the gathered ranks).
    assert LoggingLoop(None, log_every=10, health=[Fp8Saturation(action="stop")], echo=None).may_stop
    assert LoggingLoop(POLICY, log_every=10, health=[RanksDisagree(action="stop")], echo=None).may_stop
    assert not LoggingLoop(POLICY, log_every=10, health=[RanksDisagree(action="warn")], echo=None).may_stop
