"""The logging loop's rooms, each alone: the interval clock, the run's sinks, the segments, rank agreement,
the forensics and advice verdicts, and the summary. ``test_logging_loop*.py`` drive them together through
``LoggingLoop``. Runtime: a few seconds.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks import DynamicPolicy, FixedPolicy, InMemorySink, LossScaleState
from lossscale_callbacks import _metrics as m
from lossscale_callbacks._health import HealthMonitor, Verdict
from lossscale_callbacks._metrics import MetricsTracker
from lossscale_callbacks._sinks import _REGISTRY, SinkGroup, register_sink
from lossscale_callbacks.forensics._activations import ActivationTrace
from lossscale_callbacks.forensics._gradients import FORENSICS_TAG, HISTOGRAM_TAG, IntervalForensics
from lossscale_callbacks.loop._clock import IntervalClock
from lossscale_callbacks.loop._rank_agreement import RankAgreement, RanksDisagree, RankStates
from lossscale_callbacks.loop._run_sinks import RunSinks
from lossscale_callbacks.loop._segments import Segments
from lossscale_callbacks.loop._summary import run_summary
from lossscale_callbacks.loop._verdicts import Diagnosis, judge_by, rules_action


def _state(steps: int, skipped: int = 0, scale: float = 1024.0) -> LossScaleState:
    return LossScaleState(scale, 0, 1, skipped, steps)


# ---------------------------------------------------------------------------------------- the clock


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 50), st.lists(st.integers(0, 40), min_size=1, max_size=40))
def test_an_interval_ends_each_time_the_count_crosses_a_multiple(log_every, jumps):
    clock, previous = IntervalClock(log_every=log_every), 0
    for jump in jumps:
        step = previous + jump
        assert clock.due(step) == (step // log_every > previous // log_every)
        previous = step


def test_every_seconds_counts_from_the_last_read_and_needs_the_count_to_move():
    now = [0.0]
    clock = IntervalClock(every_seconds=10, clock=lambda: now[0])
    now[0] = 10.0
    assert clock.due(1) and not clock.due(1)  # the same count twice: no new interval
    clock.read()
    now[0] = 15.0
    assert not clock.due(2)
    now[0] = 20.0
    assert clock.due(3)


def test_a_count_that_starts_again_logs_its_first_step_and_a_count_that_went_back_restarts():
    clock = IntervalClock(log_every=4)
    assert [s for s in range(1, 9) if clock.due(s)] == [4, 8]
    clock.restart(-1)
    assert clock.due(0)  # Keras' batch 0 of a new epoch
    assert not clock.due(2) and clock.due(5)
    assert not clock.due(3)  # went back without restart(): starts again just before 3
    clock.start()
    assert not clock.due(3) and clock.due(4)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"log_every": 0}, "log_every"), ({"log_every": 2.5}, "log_every"),
    ({"every_seconds": 0}, "every_seconds"), ({"clock": 3}, "clock")])
def test_the_clock_refuses_bad_arguments_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        IntervalClock(**kwargs)
    with pytest.raises(ValueError, match="step"):
        IntervalClock(log_every=1).due(-2)


# ---------------------------------------------------------------------------------------- the sinks


@pytest.fixture
def counted_sink():
    made: list[InMemorySink] = []

    def factory(value):
        made.append(InMemorySink())
        return made[-1]

    register_sink("rooms_test_sink", factory)
    yield made
    _REGISTRY.pop("rooms_test_sink", None)


def test_owned_sinks_are_made_at_the_first_write_of_a_run_and_closed_at_its_end(counted_sink):
    caller = InMemorySink()
    sinks = RunSinks(None, None, {"rooms_test_sink": "x"}, writer=True)
    checked = len(counted_sink)  # made once to check it, then let go: the run has none yet
    sinks.out.write(1, {m.SCALE: 2.0})
    first = counted_sink[checked]
    assert len(counted_sink) == checked + 1 and first.series(m.SCALE) == [(1, 2.0)]
    sinks.start_run([*SinkGroup([caller]).sinks])  # the next run: the last one's owned sink is closed
    assert first.closed
    sinks.out.write(2, {m.SCALE: 4.0})
    assert len(counted_sink) == checked + 2 and caller.series(m.SCALE) == [(2, 4.0)]
    sinks.close_owned()
    assert counted_sink[-1].closed and not caller.closed
    sinks.close()
    assert caller.closed


def test_a_process_that_does_not_write_opens_and_writes_nothing(counted_sink):
    caller = InMemorySink()
    sinks = RunSinks(None, None, [caller], writer=False)
    sinks.out.write(1, {m.SCALE: 2.0})
    sinks.write_config_once(DynamicPolicy())
    assert caller.records == [] and caller.texts == []
    sinks.writer = True
    sinks.write_config_once(DynamicPolicy())
    sinks.write_config_once(DynamicPolicy())
    assert [tag for tag, _ in caller.texts] == [m.POLICY_TAG]  # once a run
    sinks.start_run([])
    sinks.write_config_once(DynamicPolicy())
    assert [tag for tag, _ in caller.texts] == [m.POLICY_TAG] * 2
    with pytest.raises(ValueError, match="writer"):
        RunSinks(None, None, writer="yes")


# ---------------------------------------------------------------------------------------- segments


def test_a_read_at_the_step_of_the_last_one_is_a_repeat_and_other_counts_there_warn_once():
    segments, last = Segments(), MetricsTracker(1.0).observe(_state(10, 1))
    assert not segments.repeated(_state(11), last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert segments.repeated(_state(10, 1), last)
        assert segments.repeated(_state(10, 2), last) and segments.repeated(_state(10, 3), last)
    assert [w.category for w in caught] == [RuntimeWarning]


def test_a_restart_is_a_new_segment_labelled_and_written_past_the_highest_step():
    segments, tracker, out = Segments(), MetricsTracker(1.0), InMemorySink()
    for step in (10, 20):
        segments.written(segments.sink_step(tracker.observe(_state(step)).step))
    assert not segments.restarted(tracker.last, _state(30))
    assert segments.restarted(tracker.last, _state(5))  # an older checkpoint
    assert (segments.number, segments.restarts) == (1, [(20, 5)])
    at = segments.sink_step(5)
    assert at > 20  # nothing already written is overwritten
    metrics = {m.SCALE: 1.0, m.SKIPPED_IN_INTERVAL: 0, m.SKIP_RATE: 0.0}
    segments.label(metrics, interval_known=False)
    assert metrics == {m.SCALE: 1.0, m.SEGMENT: 1}
    segments.write_note(SinkGroup([out]))
    segments.write_note(SinkGroup([out]))
    assert [tag for tag, _ in out.texts] == [m.RESTART_TAG]
    assert "restarted 1 time(s) (optimizer steps from 20 back to 5)" in segments.sentence()
    assert Segments().sentence() == ""


# ---------------------------------------------------------------------------------------- ranks


def test_rank_agreement_says_a_disagreement_once_per_stretch_and_counts_the_reads():
    agree = RankStates.from_rows([[8.0, 0, 0, 10], [8.0, 0, 0, 10]])
    differ = RankStates.from_rows([[8.0, 0, 0, 20], [4.0, 0, 1, 20]])
    agreement, out, health = RankAgreement(RanksDisagree()), InMemorySink(), HealthMonitor.from_spec("warn")
    assert agreement.judge(None, 5, SinkGroup([out]), health) == [] and agreement.reads == 0
    assert agreement.sentence() == "" and agreement.last_metrics() == {}
    assert agreement.judge(agree, 10, SinkGroup([out]), health) == []
    first = agreement.judge(differ, 20, SinkGroup([out]), health)
    assert [v.rule for v in first] == ["ranks_disagree"] and first[0] in health.verdicts
    assert agreement.judge(differ, 30, SinkGroup([out]), health) == []
    assert agreement.judge(agree, 40, SinkGroup([out]), health) == []
    assert [v.rule for v in agreement.judge(differ, 50, SinkGroup([out]), health)] == ["ranks_disagree"]
    assert agreement.reads == 5 and [s for s, _ in agreement.disagreements] == [20, 50]
    assert [tag for tag, _ in out.texts] == [m.RANKS_TAG] * 2
    assert agreement.metrics(differ) == agreement.last_metrics() == {m.RANKS_DISAGREE: 1}
    assert "disagreed 2 time(s) in 5 compared read(s), first at step 20" in agreement.sentence()


def test_without_the_rule_or_the_health_rules_a_disagreement_is_words_only():
    differ = RankStates.from_rows([[8.0, 0, 0, 20], [4.0, 0, 1, 20]])
    for rule, health in ((None, HealthMonitor.from_spec("warn")), (RanksDisagree(), None)):
        out = InMemorySink()
        assert RankAgreement(rule).judge(differ, 20, SinkGroup([out]), health) == []
        assert [tag for tag, _ in out.texts] == [m.RANKS_TAG]


# ---------------------------------------------------------------------------------------- verdicts


def test_the_forensics_verdicts_act_as_the_first_rule_and_come_once_a_run():
    health = judge_by(None, "stop", MetricsTracker(1.0), None)
    assert rules_action(health) == "stop" and rules_action(None) == "warn"
    assert rules_action(judge_by(None, [], MetricsTracker(1.0), None)) == "warn"
    diagnosis, out = Diagnosis(), InMemorySink()
    trace = ActivationTrace(layers=("fc1", "fc2"), steps=(10,), maxima=[[1.0, float("inf")]],
                            producer="fc2", producer_step=10, traced=1)
    loss = IntervalForensics(step=10, scale=64.0, causes={"loss_nonfinite": 2}, activations=trace)
    diagnosis.add(loss, 10, SinkGroup([out]))
    rule = Verdict("consecutive_skips", "stop", 10, "Skipped.")
    verdicts = diagnosis.verdicts([rule], loss, 10, health, 1.0, SinkGroup([out]))
    assert [(v.rule, v.action) for v in verdicts] == [
        ("consecutive_skips", "stop"), ("NonFiniteLoss", "stop"), ("ForwardOverflow", "stop")]
    assert diagnosis.verdicts([], loss, 20, health, 1.0, SinkGroup([out])) == []  # once a run each
    assert diagnosis.verdicts([rule], None, 20, health, 1.0, SinkGroup([out])) == [rule]
    assert {tag for tag, _ in out.texts} >= {FORENSICS_TAG, m.ACTIVATIONS_TAG}


def test_the_origin_is_added_to_the_rules_words_and_a_sampled_histogram_is_written():
    diagnosis, out = Diagnosis(), InMemorySink()
    interval = IntervalForensics(step=20, scale=2.0**15, causes={"grad_inf": 3}, layer_skips={"head": 3},
                                 layer_origins={"head": 3}, layer_order=("body", "head"),
                                 histogram=[0] * 60)
    diagnosis.add(interval, 20, SinkGroup([out]))
    assert [s for s, tag, *_ in out.histograms] == [20] and out.histograms[0][1] == HISTOGRAM_TAG
    assert out.series(m.CAUSE_METRICS["grad_inf"]) == [(20, 3.0)]  # the counts, not written with metrics
    rule = Verdict("skip_rate", "warn", 20, "Too many skips.")
    (said,) = diagnosis.verdicts([rule], interval, 20, HealthMonitor.from_spec("warn"), 1.0, SinkGroup([out]))
    assert said.message.startswith("Too many skips. ") and "`head`" in said.message


def test_a_new_policy_replaces_the_rules_and_keeps_what_they_found():
    tracker = MetricsTracker(1.0)
    health = judge_by(DynamicPolicy(min_scale=4.0, growth_interval=100), "warn", tracker, None)
    assert tracker.min_scale == 4.0
    health.verdicts.append(Verdict("skip_rate", "warn", 1, "x"))
    again = judge_by(FixedPolicy(8.0), "warn", tracker, health)
    assert again is health and len(again.verdicts) == 1 and tracker.min_scale is None
    assert judge_by(None, None, tracker, health) is None and tracker.min_scale == 1.0


# ---------------------------------------------------------------------------------------- the summary


def test_the_summary_puts_the_rooms_sentences_the_assessment_and_the_note_in_order():
    policy = DynamicPolicy(initial_scale=8.0, growth_interval=4)
    tracker = MetricsTracker.for_policy(policy)
    tracker.observe(_state(10, 1, 8.0))
    health, diagnosis, out = HealthMonitor.from_spec("warn"), Diagnosis(), InMemorySink()
    text = run_summary(tracker, policy.min_scale, [" Ranks.", "", " Restarts."], health, diagnosis,
                       SinkGroup([out]), note="The note.")
    first, *rest = text.splitlines()
    assert first.startswith("Loss scaling: 10 optimizer steps") and first.endswith(" Ranks. Restarts.")
    assert rest[-1] == "The note." and "Forensics" not in text and out.texts == []
    diagnosis.add(IntervalForensics(step=10, scale=8.0, causes={"grad_nan": 1}), 10, SinkGroup())
    assert "\nForensics:\n" in run_summary(tracker, None, [], None, diagnosis, SinkGroup([out]))
