"""The fp8 room of the core: formats, the delayed-scaling rebuild against a simulation of Keras' and
TransformerEngine's rules, the metric schema's round trip through logged series, the rules and their words.
Framework-free and fast."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks.fp8._delayed import DelayedHistory
from lossscale_callbacks.fp8._formats import E4M3, E5M2, fp8_format
from lossscale_callbacks.fp8._reads import FIELDS, Fp8Read, TensorRead, reads_from_series, tag
from lossscale_callbacks.fp8._rules import (
    Fp8CoarseScale,
    Fp8Health,
    Fp8Saturation,
    Fp8StaleHistory,
    Fp8ZeroAmax,
    default_fp8_rules,
)


def test_formats_against_the_numbers_of_the_formats():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for fmt, dtype in ((E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)):
        info = ml_dtypes.finfo(dtype)
        assert fmt.max == float(info.max)
        assert fmt.min_normal == float(info.smallest_normal)
        assert fmt.min_subnormal == float(info.smallest_subnormal)
        # Under the saturation threshold a value rounds to max (or below); from it on, only clipping keeps it.
        assert float(np.float32(fmt.saturation - fmt.top_step / 4).astype(dtype)) == fmt.max
        assert not fmt.saturates(fmt.saturation - 1e-3) and fmt.saturates(fmt.saturation)
        assert fmt.underflows(fmt.min_normal / 2) and not fmt.underflows(fmt.min_normal)
        assert not fmt.underflows(0.0)
    assert fp8_format("float8_e4m3fn") is E4M3 and fp8_format("E5M2") is E5M2
    with pytest.raises(ValueError, match="fp8 format must be one of"):
        fp8_format("e3m4")


def simulate(amaxes: list[float], length: int, lag: int, fmt=E4M3, first: float = 1.0):
    """A delayed-scaling run, step by step, as the frameworks do it: (multiplier used at each step, and the
    history + next multiplier after each step, oldest first)."""
    used, after = [], []
    scale = first
    history: list[float] = [0.0] * length
    pending: list[float] = []  # TransformerEngine: the step's amax joins before its own update
    for a in amaxes:
        used.append(scale)
        if lag == 2:  # Keras: the new scale from the history before this step's amax joins
            window = max(history)
            history = [*history[1:], a]
        else:  # TransformerEngine: from the history with this step's amax in it
            history = [*history[1:], a]
            window = max(history)
        if math.isfinite(window) and window > 0:
            scale = fmt.max / window
        after.append((list(history), scale))
    del pending
    return used, after


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1e4, allow_subnormal=False), min_size=30, max_size=80),
       st.integers(4, 24), st.integers(1, 12), st.sampled_from([1, 2]))
def test_two_reads_rebuild_every_steps_amax_and_scale(amaxes, length, every, lag):
    every = min(every, length - lag)
    used, after = simulate(amaxes, length, lag)
    history = DelayedHistory(length, lag, E4M3)
    history.observe(0, [0.0] * length, next_scale=1.0)
    rebuilt: dict[int, tuple[float, float]] = {}
    for step in range(every, len(amaxes) + 1, every):
        amax_list, next_scale = after[step - 1]
        view = history.observe(step, amax_list, next_scale)
        assert view.replaced_after is None
        rebuilt.update({s: (a, m) for s, a, m in view.rows})
    for step, (amax, scale) in rebuilt.items():
        assert amax == amaxes[step - 1]
        assert scale == pytest.approx(used[step - 1], rel=1e-12)
    assert len(rebuilt) == (len(amaxes) // every) * every


def test_an_outlier_is_found_its_end_foretold_and_a_short_history_forgets_it():
    for length, read_at, coarse in ((1024, 40, True), (8, 35, True), (8, 40, False)):
        amaxes = [3.0] * 40
        amaxes[29] = 150.0  # step 30
        _, after = simulate(amaxes, length, 2)
        history = DelayedHistory(length, 2, E4M3)
        history.observe(0, [0.0] * length, 1.0)
        for step in range(5, read_at + 1, 5):  # a read every 5 steps (at most the history's length)
            view = history.observe(step, *after[step - 1])
        if coarse:
            assert view.outlier_step == 30 and view.coarse_until == 30 + 2 + length - 1
            assert view.history_ratio == pytest.approx(50.0)
        else:
            assert view.history_ratio == pytest.approx(1.0)
        if read_at == 35:  # the scale catches up at step 32, two steps after the outlier
            scales = {s: m for s, _, m in view.rows}
            assert scales[31] == pytest.approx(448 / 3) and scales[32] == pytest.approx(448 / 150)


def test_a_replaced_history_is_found_and_its_staleness_measured():
    length = 16
    amaxes = [1.0] * 20 + [8.0] * 10  # the run's values grew 8x after step 20
    _, after = simulate(amaxes, length, 2)
    history = DelayedHistory(length, 2, E4M3)
    history.observe(0, [0.0] * length, 1.0)
    history.observe(30, *after[29])
    loaded, loaded_scale = after[19]  # the state saved at step 20, loaded after step 30
    view = history.observe(30, loaded, loaded_scale)
    assert view.replaced_after == 30 and view.stale_ratio == pytest.approx(8.0)
    assert view.rows == ()
    # Read again later without a load: the history goes on from the loaded one.
    _, after2 = simulate([*amaxes[:20], *([8.0] * 5)], length, 2)
    cont = history.observe(35, after2[24][0], after2[24][1])
    assert cont.replaced_after is None and cont.stale_ratio is None
    # A scale set from outside, the history unchanged: the rebuild does not match the scale read.
    outside = history.observe(36, [*after2[24][0][1:], 8.0], 123.0)
    assert outside.replaced_after == 35


def _tensor(**kw):
    base = dict(layer="enc/d2", role="input", format="e4m3", scaling="delayed", amax=3.0, scale=2.9,
                saturated=0, saturated_share=0.0, underflow_share=0.001, saturated_steps=0,
                history_length=1024, history_ratio=1.0)
    base.update(kw)
    return TensorRead(**base)


def test_the_schema_round_trips_through_logged_series():
    t = _tensor(saturated=936, saturated_share=0.457, saturated_steps=1, first_saturated_step=30,
                history_ratio=52.0, outlier_step=30, coarse_until=1055, stale_ratio=6.0,
                rows=((39, 3.1, 2.9), (40, 3.0, 2.9)))
    read = Fp8Read(40, (t, _tensor(layer="d1", role="grad_output", format="e5m2")), ranks_differing=1)
    assert set(read.step_metrics()) == {39}
    series: dict[str, list] = {}
    for step, values in [*read.step_metrics().items(), (40, read.metrics())]:
        for name, value in values.items():
            series.setdefault(name, []).append((step, value))
    assert {name.rsplit("/", 1)[1] for name in series if name.startswith("fp8/enc")} <= set(FIELDS)
    assert tag("enc/d2", "input", "amax") in series and series[tag("enc/d2", "input", "amax")][0] == (39, 3.1)
    (back,) = reads_from_series(series)
    by = {(x.layer, x.role): x for x in back.tensors}
    again = by["enc/d2", "input"]
    for field in ("saturated", "saturated_share", "history_ratio", "outlier_step", "coarse_until",
                  "stale_ratio", "history_length"):
        assert getattr(again, field) == getattr(t, field), field
    assert by["d1", "grad_output"].format == "e5m2" and back.ranks_differing is not None
    # The same rules find the same things on the read and on its rebuilt copy.
    rules = default_fp8_rules()
    assert [v.message for r in rules for v in r(read)] == [v.message for r in rules for v in r(back)]


def test_each_rule_fires_on_its_case_only():
    quiet = Fp8Read(10, (_tensor(),))
    for rule in default_fp8_rules():
        assert rule(quiet) == []
    cases = {
        Fp8Saturation(): _tensor(saturated=936, saturated_share=0.46, saturated_steps=1,
                                 first_saturated_step=30),
        Fp8ZeroAmax(): _tensor(role="weight", amax=0.0, scale=4.48e14),
        Fp8CoarseScale(): _tensor(history_ratio=52.0, outlier_step=30, coarse_until=1055),
        Fp8StaleHistory(): _tensor(stale_ratio=6.0, replaced_after=30),
    }
    for rule, tensor in cases.items():
        found = rule(Fp8Read(40, (tensor,)))
        assert [v.rule for v in found] == [rule.name]
        others = [r for r in default_fp8_rules() if type(r) is not type(rule)]
        assert all(r(Fp8Read(40, (tensor,))) == [] for r in others), rule
    coarse = Fp8CoarseScale()(Fp8Read(40, (cases[Fp8CoarseScale()],)))[0].message
    assert "`enc/d2`'s input" in coarse and "1024-step history" in coarse and "step 1055" in coarse
    assert "1015 more steps" in coarse and "amax_history_length" in coarse
    # A coarse scale from a change of range (no one outlier) is not this rule's.
    assert Fp8CoarseScale()(Fp8Read(40, (_tensor(history_ratio=52.0),))) == []
    # Uncounted steps: saturation seen from the history, by how much.
    uncounted = _tensor(saturated=None, saturated_share=None, saturated_steps=2, max_overshoot=19.0,
                        first_saturated_step=30)
    (verdict,) = Fp8Saturation()(Fp8Read(40, (uncounted,)))
    assert "19×" in verdict.message and "not counted" in verdict.message
    assert Fp8Saturation()(Fp8Read(40, (_tensor(saturated=None, saturated_share=None, saturated_steps=1,
                                                max_overshoot=1.03),))) == []
    assert Fp8ZeroAmax()(Fp8Read(40, (_tensor(scale=math.inf),)))
    with pytest.raises(ValueError, match="action"):
        Fp8Saturation(action="shout")
    with pytest.raises(ValueError, match="max_share"):
        Fp8Saturation(max_share=1.5)


def test_health_reports_a_finding_once_per_stretch_and_sums_up_the_run():
    health = Fp8Health(default_fp8_rules())
    coarse = _tensor(history_ratio=52.0, outlier_step=30, coarse_until=1055, underflow_share=0.2)
    other = _tensor(role="weight", history_ratio=52.0, outlier_step=30, coarse_until=1055)
    assert len(health.observe(Fp8Read(40, (coarse, other)))) == 2  # two tensors, two findings
    assert health.observe(Fp8Read(50, (coarse, other))) == []  # still firing: not again
    assert health.observe(Fp8Read(60, (_tensor(),))) == []
    assert len(health.observe(Fp8Read(70, (coarse,)))) == 1  # cleared, then again
    summary = health.summary()
    assert "2 tensors of 1 layers" in summary and "20% (`enc/d2`'s input)" in summary
    assert "3 fp8 finding(s)" in summary
    assert Fp8Health(default_fp8_rules()).summary() == "FP8: no fp8 layer was read."


def test_the_docs_table_names_every_field_as_the_schema_says():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "fp8.md").read_text()
    cells = [re.split(r"(?<!\\)\|", line) for line in page.splitlines() if line.startswith("| `")]
    rows = {cell[1].strip().strip("`"): cell[2].strip() for cell in cells}
    assert list(rows) == list(FIELDS)
    for field, words in FIELDS.items():
        assert rows[field] == words.replace("|", "\\|"), field


@settings(max_examples=200, deadline=None)
@given(first=st.one_of(st.floats(1e-3, 1e3), st.just(math.nan)), margin=st.sampled_from([0.0, 1.0]),
       maxima=st.lists(st.one_of(st.floats(0, 1e6), st.sampled_from([0.0, math.inf, math.nan])),
                       max_size=40))
def test_the_rebuilt_scales_are_next_scale_step_by_step(first, margin, maxima):
    """The vectorised rebuild is the rule applied one step at a time (a window that makes no scale keeps
    the previous one)."""
    history = DelayedHistory(length=8, lag=2, fmt=E4M3, margin=margin)
    expected = [first]
    for window_max in maxima:
        expected.append(history.next_scale(window_max, expected[-1]))
    got = history._scales(first, np.asarray(maxima, dtype=np.float64)).tolist()
    assert np.array_equal(got, expected, equal_nan=True)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.floats(-1e6, 1e6), st.just(math.inf)), min_size=1, max_size=60),
       width=st.integers(1, 20))
def test_the_sliding_maximum_is_every_windows_maximum(values, width):
    from lossscale_callbacks.fp8._delayed import sliding_max

    array = np.asarray(values, dtype=np.float64)
    expected = ([max(values[i:i + width]) for i in range(len(values) - width + 1)]
                if len(values) >= width else [])
    assert sliding_max(array, width).tolist() == expected


def _same_view(a, b) -> bool:
    """Two views equal field by field, NaN equal to NaN."""
    def same(x, y):
        if isinstance(x, float) and isinstance(y, float):
            return x == y or (math.isnan(x) and math.isnan(y))
        return x == y
    return (tuple(a.rows) == tuple(b.rows) or all(
                s1 == s2 and same(a1, a2) and same(m1, m2) for (s1, a1, m1), (s2, a2, m2)
                in zip(a.rows, b.rows, strict=True))) and len(a.rows) == len(b.rows) and all(
        same(getattr(a, f), getattr(b, f)) for f in ("saturated_steps", "history_ratio", "outlier_step",
                                                    "coarse_until", "replaced_after", "stale_ratio",
                                                    "history_max"))


_amax = st.one_of(st.floats(0.0, 1e4, allow_subnormal=False),
                  st.sampled_from([0.0, 50.0, math.inf, math.nan]))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), length=st.integers(4, 24), lag=st.sampled_from([1, 2]), tensors=st.integers(1, 4),
       margin=st.sampled_from([0.0, 1.0]))
def test_histories_observed_together_give_what_each_observed_alone_gives(data, length, lag, tensors, margin):
    """``observe_together`` (one rebuild over every row) against ``observe`` a history at a time: the same
    views and the same state, through reads that continue, reads that skip ahead, a history loaded in one
    row (a replacement), a scale set from outside and a read at the same step again."""
    from lossscale_callbacks.fp8._delayed import observe_together

    formats = [E4M3 if i % 3 != 2 else E5M2 for i in range(tensors)]
    together = [DelayedHistory(length, lag, fmt, margin) for fmt in formats]
    alone = [DelayedHistory(length, lag, fmt, margin) for fmt in formats]
    streams = [[] for _ in range(tensors)]
    step = 0
    for _ in range(data.draw(st.integers(2, 7), label="reads")):
        step += data.draw(st.integers(0, length + 3), label="steps")
        for stream in streams:
            new = step - len(stream)
            stream.extend(data.draw(st.lists(_amax, min_size=new, max_size=new)))
        rows = np.array([([0.0] * length + s)[len(s): len(s) + length] for s in streams])
        if data.draw(st.integers(0, 4), label="load") == 0:  # one row's history replaced from outside
            rows[0] = data.draw(st.lists(_amax, min_size=length, max_size=length), label="loaded")
        scales = [data.draw(st.one_of(st.floats(1e-3, 1e6), st.just(math.nan)), label="scale")
                  for _ in range(tensors)]
        got = observe_together(together, step, rows, scales)
        want = [h.observe(step, row, scale) for h, row, scale in zip(alone, rows, scales, strict=True)]
        for g, w in zip(got, want, strict=True):
            assert _same_view(g, w), (g, w)
        for a, b in zip(together, alone, strict=True):
            assert (a._first, a._step) == (b._first, b._step)
            assert np.array_equal(a._known, b._known, equal_nan=True)
            assert a._next_scale == b._next_scale or (math.isnan(a._next_scale) and math.isnan(b._next_scale))
