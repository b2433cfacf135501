"""ScaleOnlyDecreases carries its last look forward: the same verdicts as a full scan, in linear time.

A run whose scale stops growing (held at max_scale for a million steps) made the report's replay of its
10,000 snapshots scan the whole history at every snapshot: 2.8 s per run.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks import _health as health
from lossscale_callbacks._health import HealthMonitor, ScaleOnlyDecreases, SkipRate, default_rules
from lossscale_callbacks._metrics import MetricsTracker

_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.sampled_from([0.5, 1.0, 2.0])),
    st.just(("clear", 0, 1.0)),
    st.just(("look", 0, 1.0)),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(_OPS, st.integers(1, 6), st.integers(1, 3))
def test_the_carried_verdict_is_the_full_scans(ops, maxlen, min_backoffs):
    rule = ScaleOnlyDecreases(min_backoffs=min_backoffs, min_steps=1, during_steps=1)
    history: deque = deque(maxlen=maxlen)
    tracker = MetricsTracker(1.0)
    step, scale = 0, 1024.0
    for op, advance, factor in ops:
        if op == "append":
            step, scale = step + advance, scale * factor
            history.append(tracker.observe({"steps": step, "scale": scale, "growth_counter": 0,
                                            "hysteresis_left": 0, "skipped_steps": 0}))
        elif op == "clear":
            history.clear()
        fresh = ScaleOnlyDecreases(min_backoffs=min_backoffs, min_steps=1, during_steps=1)
        assert rule(history) == fresh(list(history))
        assert rule.final(history) == fresh.final(list(history))


def test_a_replay_held_at_max_scale_scans_the_history_once(monkeypatch):
    scans = []
    full_scan = health._last_growth
    monkeypatch.setattr(health, "_last_growth",
                        lambda history: scans.append(len(history)) or full_scan(history))
    monitor = HealthMonitor(default_rules("warn", growth_interval=2000), max_history=500)
    tracker = MetricsTracker(1.0)
    for i in range(1, 2001):  # grows for 900 steps, then held at max_scale: never grows again
        scale = 2.0 ** min(15 + i // 100, 24)
        monitor.observe(tracker.observe({"steps": 100 * i, "scale": scale, "growth_counter": 0,
                                         "hysteresis_left": 0, "skipped_steps": 0}))
    monitor.final()
    assert len(scans) == 1 and monitor.verdicts == []


_SKIP_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 4), st.integers(0, 4)),
    st.just(("clear", 0, 0)),
    st.just(("look", 0, 0)),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(_SKIP_OPS, st.integers(1, 8), st.integers(1, 9), st.integers(0, 6))
def test_the_skip_rate_window_slides_to_the_full_walks_answer(ops, maxlen, window, warmup):
    rule = SkipRate(max_rate=0.2, window=window, warmup_steps=warmup)
    history: deque = deque(maxlen=maxlen)
    tracker = MetricsTracker(1.0)
    step = skipped = 0
    for op, advance, skips in ops:
        if op == "append":
            step, skipped = step + advance, skipped + min(skips, advance)
            history.append(tracker.observe({"steps": step, "scale": 1024.0, "growth_counter": 0,
                                            "hysteresis_left": 0, "skipped_steps": skipped}))
        elif op == "clear":
            history.clear()
        fresh = SkipRate(max_rate=0.2, window=window, warmup_steps=warmup)
        assert rule._measured(history, window) == fresh._measured(list(history), window)
        assert rule(history) == fresh(list(history))
        assert rule.final(history) == fresh.final(list(history))


def test_a_one_step_replay_does_not_walk_the_window_at_every_snapshot(monkeypatch):
    walks = []
    full_walk = SkipRate._walk
    monkeypatch.setattr(SkipRate, "_walk", lambda self, history, window: walks.append(len(history))
                        or full_walk(self, history, window))
    monitor = HealthMonitor(default_rules("warn"), max_history=10_000)
    tracker = MetricsTracker(1.0)
    for step in range(1, 20_001):  # a log point every step (Megatron at --log-interval 1)
        monitor.observe(tracker.observe({"steps": step, "scale": 1024.0, "growth_counter": 0,
                                         "hysteresis_left": 0, "skipped_steps": step // 97}))
    monitor.final()
    assert len(walks) <= 3  # the first snapshot, and the final look at a copy of the history
