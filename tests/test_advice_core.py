"""The precision advisor's framework-free core: the forward trace's numbers and words, the advice rules,
and the words reaching the logging loop's summary, verdicts and sinks (under a second in all)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop
from lossscale_callbacks._metrics import (
    ACTIVATION_HEADROOM_PREFIX,
    ACTIVATION_PRODUCER_PREFIX,
    ACTIVATIONS_TAG,
    ADVICE_TAG,
    MIN_ACTIVATION_HEADROOM,
)
from lossscale_callbacks.forensics._activations import ActivationTrace, margin_log2
from lossscale_callbacks.forensics._advice import (
    FP16_SPAN_LOG2,
    GradientRange,
    advise,
    fitting_scale,
    smallest_keep_set,
)
from lossscale_callbacks.forensics._gradients import HISTOGRAM_EDGES, IntervalForensics, totals_from_series


def _t5_trace(step: int = 10) -> ActivationTrace:
    return ActivationTrace(layers=("ff.wi", "ff.wo", "ff", "norm"), steps=(step - 1, step),
                           maxima=np.array([[10.0, 6e4, 6e4, 3.0], [11.0, np.inf, np.inf, np.nan]]),
                           producer="ff.wo", producer_step=step, passed_on=("ff", "norm"),
                           producer_counts={"ff.wo": 1}, traced=2)


def test_margins_against_each_dtype() -> None:
    assert margin_log2(65504.0) == 0.0
    assert margin_log2(448.0 / 4, "float8_e4m3fn") == 2.0
    assert margin_log2(57344.0 * 2, "float8_e5m2") == -1.0
    assert margin_log2(0.0) == math.inf and math.isnan(margin_log2(math.nan))
    with pytest.raises(ValueError, match="dtype must be one of"):
        margin_log2(1.0, "float64")


def test_trace_metrics_words_and_table() -> None:
    trace = _t5_trace()
    metrics = trace.metrics()
    assert metrics[ACTIVATION_HEADROOM_PREFIX + "ff.wi"] == pytest.approx(math.log2(65504 / 11))
    assert ACTIVATION_HEADROOM_PREFIX + "ff.wo" not in metrics  # non-finite: no margin to draw
    assert metrics[MIN_ACTIVATION_HEADROOM] == pytest.approx(math.log2(65504 / 11))
    assert metrics[ACTIVATION_PRODUCER_PREFIX + "ff.wo"] == 1
    sentence = trace.producer_sentence()
    assert sentence is not None and sentence.startswith("Layer `ff.wo` produced the first non-finite")
    assert "(`ff`, `norm` passed it on)" in sentence and "Keep `ff.wo` in float32." in sentence
    table = trace.to_markdown()
    assert "| `ff.wo` | 6e+04 | Inf | overflowed |" in table
    assert table.index("`ff.wo`") < table.index("`ff.wi`")  # the non-finite layers first


def test_fitting_trace_says_headroom_only() -> None:
    trace = ActivationTrace(layers=("a",), steps=(5,), maxima=np.array([[448.0]]), traced=1)
    assert trace.producer_sentence() is None
    words = trace.headroom_sentence()
    assert words is not None and "146× below float16's max 65504" in words
    assert "fp8 e4m3 +0.00" in words and "fp8 e5m2 +7.00" in words


def test_fitting_scale_and_keep_set() -> None:
    assert fitting_scale(1.0) == 32768.0
    assert fitting_scale(1e-9) == 2.0**24  # capped at the largest scale
    assert fitting_scale(1e6) == 1.0  # floored at the minimum
    calls: list[tuple[str, ...]] = []

    def run(keep: tuple[str, ...]) -> str | None:
        calls.append(keep)
        return next((layer for layer in ("wo", "attn") if layer not in keep), None)

    assert smallest_keep_set(run) == (("wo", "attn"), True)
    assert calls == [(), ("wo",), ("wo", "attn")]
    assert smallest_keep_set(lambda keep: "wo") == (("wo",), False)  # keeping it did not help


def test_advice_cases() -> None:
    fits = advise(gradients=GradientRange(2.0**-4, 2.0**-20))
    assert fits.fits and not fits.keep_float32 and fits.initial_scale == 2.0**19
    spread = advise(gradients=GradientRange(2.0**6, 2.0**-40))
    assert spread.use_bfloat16 and spread.initial_scale is None and not spread.fits
    assert f"float16 holds {FP16_SPAN_LOG2:.1f}" in spread.findings[0]
    assert spread.kinds == ("spread",) and fits.kinds == ()
    nan = advise(causes={"grad_nan": 3}, origins={"dec.attn": 3, "dec.ff": 1})
    assert nan.kinds == ("recurring_nan",)
    assert nan.keep_float32 == ("dec.attn",) and "recurred in 3 skipped steps" in nan.findings[0]
    collapse = advise(causes={"grad_inf": 40}, at_min_scale=True)
    assert collapse.use_bfloat16 and "mostly Inf gradients at the minimum scale" in collapse.findings[0]
    forward = advise(causes={"loss_nonfinite": 40}, producers={"wo": 2}, at_min_scale=True)
    assert forward.keep_float32 == ("wo",) and not forward.use_bfloat16
    assert "mostly a forward overflow" in " ".join(forward.findings)
    unnamed = advise(causes={"loss_nonfinite": 4})
    assert "no traced step saw which layer" in unnamed.findings[0] and not unnamed.actions


def test_gradient_range_from_histogram() -> None:
    counts = [0] * (len(HISTOGRAM_EDGES) - 1)
    counts[HISTOGRAM_EDGES.index(-30.0)] = 1  # a lone tiny value below the 0.1% quantile is ignored
    counts[HISTOGRAM_EDGES.index(-10.0)] = 5000
    counts[HISTOGRAM_EDGES.index(3.0)] = 10
    room = GradientRange.from_histogram(HISTOGRAM_EDGES, counts, scale=2.0**10)
    assert room == GradientRange(largest=2.0**-6, smallest=2.0**-20)


def test_loop_words_everywhere() -> None:
    """Summary, verdicts and sinks say the producer and the advice; ``report`` rebuilds them from series."""
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(initial_scale=1024.0), sinks=[memory], echo=None)
    state = {"steps": 10, "skipped_steps": 4, "scale": 64.0, "growth_counter": 0, "hysteresis_left": 1}
    with pytest.warns(UserWarning, match="Layer `ff.wo` produced"):
        loop.observe(state, forensics=IntervalForensics(step=10, scale=64.0, causes={"loss_nonfinite": 4},
                                                        activations=_t5_trace()))
    summary = loop.finish()
    assert "Precision advice:" in summary and "Keep these layers in float32: `ff.wo`" in summary
    texts = dict(memory.texts)
    assert "Keep these layers in float32: `ff.wo`" in texts[ADVICE_TAG]
    assert "| `ff.wo` |" in texts[ACTIVATIONS_TAG]
    assert memory.series(ACTIVATION_PRODUCER_PREFIX + "ff.wo") == [(10, 1)]
    series = {tag: memory.series(tag) for tag in {t for _, metrics in memory.records for t in metrics}}
    totals = totals_from_series(series)
    assert totals is not None and totals.advice().keep_float32 == ("ff.wo",)


def test_loop_quiet_when_it_fits() -> None:
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(initial_scale=1024.0), sinks=[memory], echo=None)
    state = {"steps": 10, "skipped_steps": 0, "scale": 1024.0, "growth_counter": 10, "hysteresis_left": 1}
    trace = ActivationTrace(layers=("a",), steps=(10,), maxima=np.array([[3.0]]), traced=1)
    loop.observe(state, forensics=IntervalForensics(step=10, scale=1024.0, causes={}, activations=trace))
    assert "Precision advice" not in loop.finish()
    assert ADVICE_TAG not in dict(memory.texts) and not loop.verdicts
