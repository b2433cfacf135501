"""``report`` on an engine log of any length in bounded memory: the records the parsers keep (in memory up to
a bound, then in a temporary file), the series thinned for printing and drawing, and every log point replayed
to be judged, with the same numbers and verdicts as a report of the whole series. Runtime: about 20 s.
"""

from __future__ import annotations

import math
import tempfile
import tracemalloc

import pytest
from engine_log_writers import megatron_log, trajectory
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks import _metrics as m
from lossscale_callbacks.report import _records, _series_thinning
from lossscale_callbacks.report._engine_logs import read_run
from lossscale_callbacks.report._records import Records
from lossscale_callbacks.report._run_readers import GROWTH_INTERVAL, MIN_SCALE, ReplayedRun, RunReadError
from lossscale_callbacks.report._run_report import build_report
from lossscale_callbacks.report._series_thinning import ThinnedRun

# ---------------------------------------------------------------------------------------------- records


@pytest.mark.parametrize("in_memory", [1, 2, 3, 1000])
def test_records_come_back_in_order_as_often_as_asked(in_memory):
    records = Records(3, in_memory=in_memory)
    rows = [(float(i), i / 3, -float(i)) for i in range(17)]
    for row in rows:
        records.add(*row)
    assert len(records) == 17
    assert list(records) == rows and list(records) == rows  # twice: the file is read from its start
    records.add(1.0, 2.0, 3.0)  # adding after a read goes to the end
    assert list(records) == [*rows, (1.0, 2.0, 3.0)]
    spilled = records._file is not None
    assert spilled == (in_memory < 17)
    records.close()
    assert list(records) == [] and len(records) == 0


def test_records_stay_in_memory_where_no_temporary_file_can_be_made(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    records = Records(2, in_memory=2)
    for i in range(9):
        records.add(i, i * 2)
    assert list(records) == [(float(i), float(i * 2)) for i in range(9)] and records._file is None


def test_two_readings_of_spilled_records_at_once_each_see_them_all():
    records = Records(1, in_memory=2)
    for i in range(7):
        records.add(i)
    first = iter(records)
    assert [next(first), next(first)] == [(0.0,), (1.0,)]
    assert [r for (r,) in records] == list(range(7))  # a whole reading between
    assert [r for (r,) in first] == [2, 3, 4, 5, 6]
    assert [(a, b) for (a,), (b,) in zip(records, records, strict=True)] == [(i, i) for i in range(7)]


class _FillsUp:
    """A temporary file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, room):
        self.data, self.room, self.at = bytearray(), room, 0

    def seek(self, offset, whence=0):
        self.at = offset
        return offset

    def write(self, data):
        data = bytes(data)
        if self.at + len(data) > self.room:
            self.data[self.at:] = data[: self.room - self.at]  # a partial write, then the error
            raise OSError(28, "No space left on device")
        self.data[self.at:self.at + len(data)] = data
        self.at += len(data)
        return len(data)

    def read(self, size):
        out = bytes(self.data[self.at:self.at + size])
        self.at += len(out)
        return out

    def close(self):
        pass


def test_records_keep_what_a_full_temporary_folder_refuses_in_memory(monkeypatch):
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda **kwargs: _FillsUp(room=5 * 16 + 3))
    records = Records(2, in_memory=2)
    for i in range(11):
        records.add(i, -i)
    assert list(records) == [(float(i), float(-i)) for i in range(11)]  # none lost, none garbled


@pytest.mark.parametrize(("name", "value"),
                         [("width", 0), ("width", 1.5), ("in_memory", 0), ("in_memory", True)])
def test_records_refuse_a_width_or_bound_that_is_no_count(name, value):
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        Records(**{"width": 2, name: value})


def test_a_record_of_the_wrong_width_is_refused_when_written_out():
    records = Records(2, in_memory=2)
    records.add(1.0, 2.0)
    with pytest.raises(ValueError, match="a record of 2 numbers"):
        records.add(1.0, 2.0, 3.0)


# ---------------------------------------------------------------------------------------------- thinning

# Log points (step, scale, cumulative skipped) of runs with restarts: steps go up within a segment.
_scales = st.sampled_from([1.0, 2.0, 64.0, 2.0**16, 2.0**24])
_points = st.tuples(st.integers(1, 50), _scales, st.integers(0, 1))
_segments = st.lists(st.lists(_points, min_size=1, max_size=120), min_size=1, max_size=4)


def _run(segments):
    points = []
    for segment in segments:
        step, skipped = 0, 0
        for gap, scale, skip in segment:
            step, skipped = step + gap, skipped + skip
            points.append((step, scale, skipped))
    return points


def _cut(points):
    out = []
    for point in points:
        if not out or point[0] <= out[-1][-1][0]:
            out.append([])
        out[-1].append(point)
    return out


@settings(max_examples=200, deadline=None)
@given(_segments, st.integers(2, 40))
def test_thinning_keeps_each_segments_lowest_and_last_points_and_at_most_twice_its_limit(segments, limit):
    points = _run(segments)
    thinned = ThinnedRun(limit=limit)
    for point in points:
        thinned.add(*point)
    series = thinned.series()
    kept = [(step, scale, int(skipped)) for (step, scale), (_, skipped) in
            zip(series[m.SCALE], series[m.SKIPPED_STEPS], strict=True)]
    assert thinned.count == len(points) and thinned.kept == len(kept)
    if len(points) <= limit:
        assert kept == points and thinned.words() is None
    else:
        assert len(kept) <= 2 * limit + 3 * len(_cut(points))
    # A subsequence of the run, cut into the same segments; each segment's lowest scale and last point kept.
    assert len(_cut(kept)) == len(_cut(points))
    for whole, part in zip(_cut(points), _cut(kept), strict=True):
        assert all(p in whole for p in part) and part[-1] == whole[-1]
        assert min(scale for _, scale, _ in part) == min(scale for _, scale, _ in whole)


def test_thinning_a_log_that_restarts_at_every_other_line_stays_linear():
    """Each line printed twice (two log handlers): a restart at each repeat, more segments than the limit. The
    stretches beyond one a segment decide the merges, so none is tried in vain (it was quadratic)."""
    thinned = ThinnedRun(limit=4)
    for i in range(40_000):
        thinned.add(i // 2, 8.0, 0)
    for step in range(100_000, 100_100):  # a long segment after them is still thinned as one
        thinned.add(step, 4.0, 0)
    kept = thinned.series()[m.SCALE]
    assert thinned._width <= 64 and len(kept) < 40_100
    assert "of 40100 log points kept" in thinned.words()
    assert len(_cut([(s, v, 0) for s, v in kept])) == 20_001


def test_a_run_of_many_restarts_names_a_few_of_them_in_its_text():
    points = [(step, 8.0, 0) for _ in range(300) for step in (1, 2)]  # 300 segments
    report = build_report("run", _replayed(points, 8))
    assert len(report.segments) == 300
    line = next(line for line in report.text().splitlines() if line.startswith("Restarts"))
    assert "went back 299 time(s)" in line and "... 294 more ..." in line and len(line) < 1200
    assert _said(report) == _said(build_report("run", _whole(points)))


def test_thinning_is_said_and_refuses_a_limit_below_two():
    thinned = ThinnedRun(limit=4)
    for step in range(1, 101):
        thinned.add(step, 8.0, 0)
    assert "thinned: " in thinned.words() and "of 100 log points kept" in thinned.words()
    with pytest.raises(ValueError, match="limit must be an integer >= 2"):
        ThinnedRun(limit=1)


# ------------------------------------------------------------------------------- replayed vs whole series


def _replayed(points, limit, growth_interval=None, min_scale=None):
    thinned = ThinnedRun(limit=limit)
    for point in points:
        thinned.add(*point)
    series = thinned.series()
    if growth_interval:
        series[GROWTH_INTERVAL] = [(points[0][0], float(growth_interval))]
    if min_scale:
        series[MIN_SCALE] = [(points[0][0], float(min_scale))]
    return ReplayedRun(series, lambda: iter(points))


def _whole(points, growth_interval=None, min_scale=None):
    series = {m.SCALE: [(s, v) for s, v, _ in points], m.SKIPPED_STEPS: [(s, float(k)) for s, _, k in points]}
    if growth_interval:
        series[GROWTH_INTERVAL] = [(points[0][0], float(growth_interval))]
    if min_scale:
        series[MIN_SCALE] = [(points[0][0], float(min_scale))]
    return series


def _said(report):
    return (report.steps, report.skipped_steps, report.skip_rate, report.final_scale, report.min_scale_seen,
            report.max_scale_seen, report.min_scale, report.steps_at_min_scale, report.log_points,
            [(v.rule, v.step, v.message) for v in report.verdicts], report.health, report.segments)


# Runs that trip the rules: long stretches at the minimum, bursts of skips, a scale that only goes down.
_burst_runs = st.lists(st.tuples(st.integers(1, 300), st.sampled_from([1.0, 1.0, 2.0, 2.0**10, 2.0**16]),
                                 st.integers(0, 1), st.integers(0, 60)), min_size=1, max_size=60)


def _bursty(spans, restart_at):
    points, step, skipped = [], 0, 0
    for n, (gap, scale, skip, repeat) in enumerate(spans):
        if n == restart_at:
            step, skipped = max(0, step // 2 - 1), 0
        for _ in range(repeat + 1):
            step, skipped = step + gap, skipped + skip * gap
            points.append((step, scale, skipped))
    return points


@settings(max_examples=150, deadline=None)
@given(_burst_runs, st.integers(0, 80), st.sampled_from([None, 10, 2000]), st.sampled_from([None, 1.0, 2.0]),
       st.integers(2, 50))
def test_a_replayed_run_is_judged_as_its_whole_series_is(spans, restart_at, growth_interval, min_scale,
                                                         limit):
    points = _bursty(spans, restart_at)
    whole = build_report("run", _whole(points, growth_interval, min_scale))
    replayed = build_report("run", _replayed(points, limit, growth_interval, min_scale))
    assert _said(replayed) == _said(whole)


def test_the_rules_fire_on_a_replayed_run_as_on_its_series():
    # 3000 steps stuck at the minimum after a burst of 60 skips: three rules fire
    points = [(step, 1.0, min(step, 60)) for step in range(1, 3001)]
    whole, replayed = build_report("run", _whole(points)), build_report("run", _replayed(points, 8))
    assert {v.rule for v in whole.verdicts} >= {"consecutive_skips", "stuck_at_min_scale"}
    assert _said(replayed) == _said(whole)


@pytest.mark.parametrize("scale", [math.inf, math.nan, 0.0, -2.0])
def test_a_replayed_scale_that_is_no_loss_scale_is_refused_as_in_a_series(scale):
    points = [(1, 8.0, 0), (2, scale, 0), (3, 8.0, 0)]
    for run in (_whole(points), _replayed(points, 8)):
        with pytest.raises(RunReadError, match=f"holds {scale!r} at step 2: not a loss scale"):
            build_report("run", run)


# ---------------------------------------------------------------------------------------- whole engine logs


def _megatron(tmp_path, steps, name="train.log"):
    states = trajectory(set(range(5, steps, 97)) | set(range(steps // 2, steps // 2 + 60)), steps,
                        initial=2.0**16, growth_interval=50)
    path = tmp_path / name
    path.write_text(megatron_log(states, 1)[0])
    return str(path)


def test_a_long_log_spilled_and_thinned_reports_what_a_short_bound_would_not_change(tmp_path, monkeypatch):
    """The same log with the default bounds (held whole) and with tiny ones (records in a temporary file,
    series thinned): the same report, and the thinning said."""
    path = _megatron(tmp_path, 3000)
    whole = build_report(path, read_run(path))
    monkeypatch.setattr(_records, "IN_MEMORY", 64)
    monkeypatch.setattr(_series_thinning, "LIMIT", 100)
    run = read_run(path)
    bounded = build_report(path, run)
    assert _said(bounded) == _said(whole) and bounded.verdicts
    assert len(bounded.series[m.SCALE]) <= 200 < len(whole.series[m.SCALE]) == 3000
    assert any("the series printed and drawn are thinned: " in note for note in run.notes)
    assert bounded.to_json()["series"][m.SCALE] == bounded.series[m.SCALE]  # --json prints the kept points
    assert len(bounded.snapshots) == len(bounded.series[m.SCALE])  # the picture draws the kept points


def _peak(path):
    tracemalloc.start()
    try:
        build_report(path, read_run(path))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_log_points(tmp_path, monkeypatch):
    """Four times the log points, the same peak (with bounds small enough for a short test to pass them):
    nothing the reader or the report keeps grows with the log."""
    monkeypatch.setattr(_records, "IN_MEMORY", 256)
    monkeypatch.setattr(_series_thinning, "LIMIT", 256)
    # the health monitor keeps its last 10,000 snapshots: both runs are longer
    small, large = _megatron(tmp_path, 12_000, "small.log"), _megatron(tmp_path, 48_000, "large.log")
    _peak(small)  # warm: imports and caches
    low, high = _peak(small), _peak(large)
    assert high < low * 1.3 + 256 * 1024, (low, high)


def test_the_skip_rate_panel_draws_at_most_a_thousand_exact_steps():
    from lossscale_callbacks._metrics import MetricsTracker
    from lossscale_callbacks._state import LossScaleState
    from lossscale_callbacks.report._report_cli import _skip_rates

    tracker = MetricsTracker(min_scale=1.0)
    snaps = [tracker.observe(LossScaleState(8.0, 0, 0, step // 7, step)) for step in range(3, 30_000, 3)]
    rates, edges, size = _skip_rates(snaps)
    assert len(rates) <= 1000 and len(edges) == len(rates) + 1 and size == 10
    assert edges == sorted(edges) and edges[0] == 0 and edges[-1] == snaps[-1].step
    # each step's rate is its skipped steps over its steps attempted: together, the run's
    assert sum(r * (b - a) for r, a, b in zip(rates, edges, edges[1:], strict=False)) == pytest.approx(
        snaps[-1].skipped_steps)
    few = snaps[:50]
    assert _skip_rates(few) == ([s.skip_rate for s in few], [0, *(s.step for s in few)], 1)
