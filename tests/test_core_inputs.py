"""What the logging core is given is checked, with errors naming the field (issue 24).

Each case here was accepted on main at 52cfc0a: a skip rate of 2.5 reached the health rules, negative and
fractional step counts were counted, a missing field was a ``KeyError``, ``max_history=0`` switched every
rule off, ``min_scale=nan`` never counted time at the minimum, and ``diagnose=1.0`` switched forensics on.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lossscale_callbacks._health import ConsecutiveSkips, HealthMonitor
from lossscale_callbacks._metrics import MetricsTracker, Snapshot, observed_state
from lossscale_callbacks._state import STATE_FIELDS
from lossscale_callbacks.forensics._gradients import check_diagnose


def _state(**changes):
    return {"scale": 1024.0, "growth_counter": 0, "hysteresis_left": 1, "skipped_steps": 2, "steps": 10,
            **changes}


@pytest.mark.parametrize("changes, field", [
    ({"skipped_steps": 25}, "skipped_steps"),
    ({"steps": -5}, "steps"),
    ({"steps": 301.5}, "steps"),
    ({"steps": True}, "steps"),
    ({"skipped_steps": math.nan}, "skipped_steps"),
    ({"growth_counter": math.inf}, "growth_counter"),
    ({"hysteresis_left": -1}, "hysteresis_left"),
    ({"scale": "1024"}, "scale"),
    ({"scale": None}, "scale"),
])
def test_a_bad_field_is_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        observed_state(_state(**changes))
    tracker = MetricsTracker(1.0)
    with pytest.raises(ValueError, match=field):
        tracker.observe(_state(**changes))
    assert tracker.last is None  # nothing recorded


@pytest.mark.parametrize("field", STATE_FIELDS)
def test_a_missing_field_is_a_value_error_naming_it(field):
    state = _state()
    del state[field]
    with pytest.raises(ValueError, match=f"'{field}' is missing"):
        MetricsTracker(1.0).observe(state)


def test_host_numbers_of_every_kind_are_accepted():
    state = observed_state(_state(steps=np.int64(10), skipped_steps=np.array(2), scale=np.float32(8.0),
                                  growth_counter=3.0))
    assert state == (8.0, 3, 1, 2, 10) and all(type(v) is int for v in state[1:])
    # A broken stock scaler's scale is data to show, not an input error.
    assert math.isnan(observed_state(_state(scale=math.nan)).scale)


@given(steps=st.integers(0, 10**6), skipped=st.integers(0, 10**6), first=st.integers(0, 10**6))
def test_the_tracker_never_derives_an_impossible_rate(steps, skipped, first):
    tracker = MetricsTracker(1.0)
    tracker.observe(_state(steps=first, skipped_steps=0))
    if skipped > steps:
        with pytest.raises(ValueError, match="skipped_steps"):
            tracker.observe(_state(steps=steps, skipped_steps=skipped))
        return
    snap = tracker.observe(_state(steps=steps, skipped_steps=skipped))
    assert 0.0 <= snap.skip_rate <= 1.0 and snap.skipped_in_interval <= snap.interval_steps


def test_a_snapshot_cannot_hold_more_skips_than_steps():
    good = MetricsTracker(1.0).observe(_state())
    fields = {f: getattr(good, f) for f in Snapshot.__dataclass_fields__}
    with pytest.raises(ValueError, match="more skipped steps than steps"):
        Snapshot(**{**fields, "skipped_in_interval": 21, "interval_steps": 10})
    with pytest.raises(ValueError, match="skip_rate"):
        Snapshot(**{**fields, "skip_rate": 2.5})
    with pytest.raises(ValueError, match="interval_steps"):
        Snapshot(**{**fields, "interval_steps": -1})


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0, "1"])
def test_tracker_min_scale_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match="min_scale"):
        MetricsTracker(min_scale=value)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, None])
def test_health_monitor_max_history_must_be_at_least_one(value):
    with pytest.raises(ValueError, match="max_history"):
        HealthMonitor([ConsecutiveSkips()], max_history=value)


def test_health_monitor_refuses_what_is_not_a_snapshot():
    monitor = HealthMonitor([ConsecutiveSkips(limit=1)])
    with pytest.raises(ValueError, match="snapshot must be"):
        monitor.observe(_state(skipped_steps=10))
    assert list(monitor.history) == []


def test_health_monitor_restart_reports_a_recurring_problem_again():
    monitor = HealthMonitor([ConsecutiveSkips(limit=5)])
    tracker = MetricsTracker(1.0)
    assert len(monitor.observe(tracker.observe(_state(steps=10, skipped_steps=10)))) == 1
    assert monitor.observe(tracker.observe(_state(steps=20, skipped_steps=20))) == []  # still firing: once
    monitor.restart()
    tracker.reset()
    assert len(monitor.observe(tracker.observe(_state(steps=10, skipped_steps=10)))) == 1
    assert len(monitor.verdicts) == 2


@pytest.mark.parametrize("value", [1.0, 0.0, 1, 0, np.bool_(True), np.bool_(False), "every step", "true",
                                   None])
def test_diagnose_accepts_only_true_false_and_every_step(value):
    with pytest.raises(ValueError, match="diagnose must be one of"):
        check_diagnose(value)


def test_diagnose_refuses_a_tensor():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="diagnose must be one of"):
        check_diagnose(torch.tensor(True))
    assert [check_diagnose(v) for v in (True, False, "every_step")] == [True, False, "every_step"]


GARBAGE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3))


@given(changes=st.dictionaries(st.sampled_from([*STATE_FIELDS, "extra"]), GARBAGE, max_size=3),
       removed=st.sets(st.sampled_from(STATE_FIELDS), max_size=2))
def test_the_logging_loop_records_a_valid_read_or_refuses_it_and_stays_as_it_was(changes, removed):
    from lossscale_callbacks._policy import DynamicPolicy
    from lossscale_callbacks._sinks import InMemorySink
    from lossscale_callbacks.loop._logging_loop import LoggingLoop

    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health="warn")
    loop.observe(_state())
    before = (loop.last, list(memory.records), loop.segment, list(loop.health.history))
    state = {k: v for k, v in {**_state(), **changes}.items() if k not in removed}
    try:
        snapshot = loop.observe(state)
    except ValueError as exc:
        assert any(name in str(exc) for name in STATE_FIELDS)  # names the field
        assert (loop.last, memory.records, loop.segment, list(loop.health.history)) == before
    else:
        assert 0 <= snapshot.skipped_in_interval <= snapshot.interval_steps
        assert snapshot.skipped_steps <= snapshot.step


def test_a_warning_raised_in_a_callback_points_past_the_framework_at_the_users_line():
    """Issue 30: WandbOfflineWarning was attributed to Keras' callback_list.py, not the user's fit()."""
    import warnings as _warnings

    from lossscale_callbacks._stacklevel import user_stacklevel

    library: dict = {"__name__": "lossscale_callbacks.fake_sink", "user_stacklevel": user_stacklevel,
                     "warnings": _warnings}
    exec(compile("def warn_now():\n    warnings.warn('offline', UserWarning, stacklevel=user_stacklevel())",
                 "lossscale_callbacks/fake_sink.py", "exec"), library)
    framework: dict = {"__name__": "keras.src.callbacks.callback_list"}
    exec(compile("def on_train_begin(callback):\n    callback()", "keras/callback_list.py", "exec"),
         framework)
    with pytest.warns(UserWarning, match="offline") as caught:
        framework["on_train_begin"](library["warn_now"])  # the user's line
    assert caught[0].filename == __file__
