import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks import (
    METRIC_NAMES,
    DynamicPolicy,
    LossScaleHealthError,
    LossScaleHealthWarning,
    initial_state,
    next_state,
)
from lossscale_callbacks._health import ConsecutiveSkips, HealthMonitor, SkipRate, StuckAtMinScale, evaluate
from lossscale_callbacks._metrics import MetricsTracker, Snapshot
from lossscale_callbacks.forensics._words import summarize


def run(policy, flags, tracker, every):
    """Step the core, observing the state every `every` steps; returns the snapshots."""
    state, snaps = initial_state(policy), []
    for t, finite in enumerate(flags, start=1):
        state = next_state(policy, state, finite)
        if t % every == 0:
            snaps.append(tracker.observe(state))
    return snaps


def test_metric_schema_names():
    assert METRIC_NAMES == ("loss_scale/scale", "loss_scale/log2_scale", "loss_scale/growth_counter",
                            "loss_scale/skipped_steps", "loss_scale/skipped_in_interval",
                            "loss_scale/skip_rate", "loss_scale/steps")


def test_tracker_intervals_and_rates():
    policy = DynamicPolicy(initial_scale=1024.0, growth_interval=1000)
    tracker = MetricsTracker(policy.min_scale)
    flags = [False, False] + [True] * 8 + [True, False, True, False, True, True, True, True, True, True]
    first, second = run(policy, flags, tracker, every=10)
    assert (first.step, first.skipped_in_interval, first.skip_rate) == (10, 2, 0.2)
    assert (second.step, second.skipped_steps) == (20, 4)
    assert (second.skipped_in_interval, second.skip_rate) == (2, 0.2)
    metrics = second.metrics()
    assert metrics == {
        "loss_scale/scale": 1024.0 / 16, "loss_scale/log2_scale": 6.0, "loss_scale/growth_counter": 6,
        "loss_scale/skipped_steps": 4, "loss_scale/skipped_in_interval": 2, "loss_scale/skip_rate": 0.2,
        "loss_scale/steps": 20,
    }
    # Counts are ints (dashboards show 4, not 4.0).
    counts = ("loss_scale/growth_counter", "loss_scale/skipped_steps", "loss_scale/skipped_in_interval")
    assert all(type(metrics[name]) is int for name in counts)


def test_tracker_restarts_when_counters_go_back():
    tracker = MetricsTracker(min_scale=1.0)
    host = {"scale": 8.0, "growth_counter": 0, "hysteresis_left": 1}
    tracker.observe({**host, "steps": 100, "skipped_steps": 10})
    snap = tracker.observe({**host, "steps": 20, "skipped_steps": 1})  # e.g. restored from a checkpoint
    assert (snap.interval_steps, snap.skipped_in_interval) == (20, 1)


def test_consecutive_skips_and_time_at_minimum_are_measured_per_interval():
    policy = DynamicPolicy(initial_scale=4.0, min_scale=1.0)
    tracker = MetricsTracker(policy.min_scale)
    snaps = run(policy, [False] * 30 + [True, False] * 5, tracker, every=10)
    assert [s.consecutive_skipped for s in snaps] == [10, 20, 30, 0]
    # at the minimum from step 3 on: intervals 2, 3 and 4 had it at both ends
    assert [s.steps_at_min_scale for s in snaps] == [0, 10, 20, 30]
    assert snaps[-1].total_steps_at_min_scale == 30


def test_rules_fire_on_problems_and_not_on_settling():
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=2000)
    settling = [False] * 12 + [True] * 2000
    snaps = run(policy, settling, MetricsTracker(policy.min_scale), every=100)
    assert evaluate([ConsecutiveSkips(), SkipRate(), StuckAtMinScale()], snaps) == []

    collapsing = [False] * 1200
    snaps = run(policy, collapsing, MetricsTracker(policy.min_scale), every=100)
    verdicts = {v.rule: v for v in evaluate([ConsecutiveSkips(), SkipRate(), StuckAtMinScale()], snaps)}
    assert set(verdicts) == {"consecutive_skips", "skip_rate", "stuck_at_min_scale"}
    assert "expected while the scale settles" in verdicts["consecutive_skips"].message
    assert all("bf16" in v.message for v in verdicts.values())


def test_skip_rate_window_ignores_warmup_and_threshold():
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=10_000)
    # 4% skipped after warm-up: under the 5% default, over a 3% limit
    flags = [False] * 50 + [True] * 50 + ([False] + [True] * 24) * 40
    snaps = run(policy, flags, MetricsTracker(policy.min_scale), every=50)
    assert SkipRate()(snaps) is None
    verdict = SkipRate(max_rate=0.03)(snaps)
    assert verdict is not None and "4.00% of the last 1000" in verdict.message
    assert SkipRate(max_rate=0.03, window=5000)(snaps) is None  # not enough steps yet


def test_monitor_reports_each_problem_once_and_acts():
    policy = DynamicPolicy(initial_scale=4.0)
    tracker, monitor = MetricsTracker(policy.min_scale), HealthMonitor([ConsecutiveSkips(limit=20)])
    state, fired = initial_state(policy), []
    for t in range(1, 101):
        state = next_state(policy, state, t > 60)
        if t % 10 == 0:
            fired.append(len(monitor.observe(tracker.observe(state))))
    assert fired == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]

    with pytest.warns(LossScaleHealthWarning, match="stopping training"):
        stops = []
        stop_verdict = monitor.verdicts[0].__class__("r", "stop", 1, "m")
        assert monitor.apply([stop_verdict], stop=lambda: stops.append(1))
    assert stops == [1]
    with pytest.raises(LossScaleHealthError, match="boom"):
        monitor.apply([monitor.verdicts[0].__class__("r", "raise", 1, "boom")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert monitor.apply([]) is False


@pytest.mark.parametrize("spec", ["warn", "raise", "stop", True])
def test_health_spec_shorthands(spec):
    monitor = HealthMonitor.from_spec(spec)
    assert [type(r).__name__ for r in monitor.rules] == ["ConsecutiveSkips", "SkipRate", "StuckAtMinScale",
                                                         "ScaleOnlyDecreases"]
    assert {r.action for r in monitor.rules} == {"warn" if spec is True else spec}


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: HealthMonitor.from_spec("shout"), "health"),
        (lambda: HealthMonitor.from_spec(42), "health"),
        (lambda: ConsecutiveSkips(limit=0), "limit"),
        (lambda: ConsecutiveSkips(action="explode"), "action"),
        (lambda: SkipRate(max_rate=0.0), "max_rate"),
        (lambda: SkipRate(max_rate=True), "max_rate"),
        (lambda: SkipRate(window=0), "window"),
        (lambda: SkipRate(warmup_steps=-1), "warmup_steps"),
        (lambda: StuckAtMinScale(limit=1.5), "limit"),
        (lambda: MetricsTracker(1.0) and HealthMonitor([object()]), "health rules"),
    ],
)
def test_invalid_health_arguments(make, name):
    with pytest.raises(ValueError, match=name):
        make()
    assert HealthMonitor.from_spec(None) is None and HealthMonitor.from_spec(False) is None


def test_summary_in_plain_words():
    policy = DynamicPolicy(initial_scale=4.0)
    snaps = run(policy, [False] * 30 + [True] * 10, MetricsTracker(policy.min_scale), every=10)
    text = summarize(snaps[-1], policy.min_scale)
    assert "40 optimizer steps, 30 skipped (75.00%)" in text
    assert "final loss scale 1" in text and "at the minimum scale (1)" in text
    assert summarize(None) == "Loss scaling: no optimizer step was taken."


def test_a_fixed_scale_is_never_stuck_at_its_minimum():
    from lossscale_callbacks import FixedPolicy

    policy = FixedPolicy(1.0)
    snaps = run(policy, [True] * 2000, MetricsTracker.for_policy(policy), every=100)
    assert not snaps[-1].at_min_scale and snaps[-1].total_steps_at_min_scale == 0
    assert evaluate([StuckAtMinScale()], snaps) == []
    assert MetricsTracker.for_policy(DynamicPolicy(min_scale=2.0)).min_scale == 2.0


def test_a_second_read_at_the_same_step_keeps_the_runs():
    policy = DynamicPolicy(initial_scale=4.0)
    tracker = MetricsTracker.for_policy(policy)
    snaps = run(policy, [False] * 100, tracker, every=10)
    again = tracker.observe({"steps": 100, "skipped_steps": 100, "scale": 1.0, "growth_counter": 0,
                             "hysteresis_left": 0})
    assert (again.consecutive_skipped, again.steps_at_min_scale) == (snaps[-1].consecutive_skipped,
                                                                      snaps[-1].steps_at_min_scale)
    assert again.interval_steps == 0 and again.skip_rate == 0.0


def test_raise_comes_after_the_other_verdicts_are_warned():
    from lossscale_callbacks._health import Verdict

    monitor = HealthMonitor([])
    with pytest.warns(LossScaleHealthWarning, match="first"), \
            pytest.raises(LossScaleHealthError, match="second"):
        monitor.apply([Verdict("a", "raise", 1, "second"), Verdict("b", "warn", 1, "first")])


@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf")])
def test_summarize_describes_a_broken_scale_instead_of_crashing(scale):
    snap = MetricsTracker(1.0).observe({"steps": 10, "skipped_steps": 10, "scale": scale, "growth_counter": 0,
                                        "hysteresis_left": 0})
    text = summarize(snap, 1.0)
    assert "not a usable loss scale" in text and "10 skipped (100.00%)" in text
    assert snap.metrics()["loss_scale/log2_scale"] != snap.metrics()["loss_scale/log2_scale"]  # NaN


_SCALES = [1.0, 2.0, 1024.0, 65536.0, 0.5, float("nan"), float("inf"), 0.0]
_reads = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 5000),
                            st.sampled_from(_SCALES)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(reads=_reads, min_scale=st.sampled_from([None, 1.0, 2.0]))
def test_every_snapshot_the_tracker_makes_passes_snapshots_own_checks(reads, min_scale):
    """The tracker builds its snapshots without Snapshot's checks (a report replays a million): whatever
    the reads (counts going back, more skips than steps since the last read, a broken scale), each one
    must pass them, and equal the snapshot the checked constructor makes."""
    tracker = MetricsTracker(min_scale)
    for steps, skipped, growth, scale in reads:
        skipped = min(skipped, steps)
        snap = tracker.observe({"steps": steps, "skipped_steps": skipped, "scale": scale,
                                "growth_counter": growth, "hysteresis_left": 0})
        checked = Snapshot(**vars(snap))
        assert vars(checked).keys() == vars(snap).keys()
        assert repr(checked) == repr(snap)


@pytest.mark.parametrize(("flags", "fires"), [
    ([False] * 16, True),  # every step skipped: no update at all, named though the run is short
    ([True] + [False] * 15, False),  # one applied step: the thresholds judge it, not this rule
    ([False], False),  # a single step says too little
    ([False] * 60, False),  # long enough for the consecutive-skips rule itself, which fires instead
])
def test_a_short_run_whose_every_step_was_skipped_is_a_problem(flags, fires):
    policy = DynamicPolicy()
    monitor = HealthMonitor.from_spec("warn")
    for snap in run(policy, flags, MetricsTracker(policy.min_scale), every=min(8, len(flags))):
        monitor.observe(snap)
    final = monitor.final()
    assert ("every_step_skipped" in {v.rule for v in final}) is fires
    if fires:
        assert "Every one of the 16 optimizer steps of this run was skipped" in final[0].message
        assert "1 problem(s) found" in monitor.assessment()
    if len(flags) == 60:
        assert "consecutive_skips" in {v.rule for v in monitor.verdicts}
