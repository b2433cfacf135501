"""The forward trace, framework-free: per-layer activation maxima against a compute dtype's range.

An integration captures, on the device and without a host read in the step, per traced step and per
layer the largest ``|output|`` (and whether the layer's inputs were finite), keeps a ring of the last
few traced steps, and reads it once at the log interval into an :class:`ActivationTrace` (host
numbers: NumPy arrays). This module turns that into series, words and a table; the advice built on it
is in :mod:`lossscale_callbacks.forensics._advice`.

API for an integration (torch: ``lossscale_callbacks.torch._tracing``; Keras alike):

* ``ActivationTrace(layers, steps, maxima, producer=..., producer_step=..., passed_on=...,
  producer_counts=..., traced=..., dtype="float16", series_layers=...)``: ``layers`` in the order the
  forward pass finished them, named as the gradient forensics name them (a parameter's owner module);
  ``maxima`` of shape ``(len(steps), len(layers))``, ``inf``/``nan`` where the output was non-finite;
  ``producer`` the first layer in that order whose inputs were finite and whose output was not.
* Hand it to the logging loop inside :class:`~lossscale_callbacks.forensics._gradients.IntervalForensics`
  (``activations=``): its :meth:`ActivationTrace.metrics` go to the sinks (one series per layer,
  :data:`~lossscale_callbacks._metrics.ACTIVATION_HEADROOM_PREFIX`), its :meth:`ActivationTrace.to_markdown`
  to ``loss_scale/activations``, and the advice into the verdicts, the summary and ``report``.
* :func:`margin_log2` and :data:`DTYPE_MAX` are the one definition of "headroom" for every framework.

Headroom is a log2 margin: ``log2(dtype max / max |output|)``; 0 at the limit, negative above it.

Example:
    >>> import numpy as np
    >>> trace = ActivationTrace(layers=("wi", "wo", "norm"), steps=(9, 10),
    ...                         maxima=np.array([[3e3, 5e4, 2.0], [3e3, np.inf, np.nan]]),
    ...                         producer="wo", producer_step=10, passed_on=("norm",),
    ...                         producer_counts={"wo": 1}, traced=2)
    >>> print(trace.producer_sentence())  # doctest: +NORMALIZE_WHITESPACE
    Layer `wo` produced the first non-finite activation (Inf) at step 10: its inputs were finite, its
    output was not (`norm` passed it on). Keep `wo` in float32.
    >>> round(trace.metrics()["loss_scale/activation_headroom/wi"], 2)
    4.45
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from lossscale_callbacks._metrics import (
    ACTIVATION_HEADROOM_PREFIX,
    ACTIVATION_PRODUCER_PREFIX,
    MIN_ACTIVATION_HEADROOM,
)
from lossscale_callbacks.forensics._words import times

# The largest finite value of each compute dtype. float16 is the one loss scaling is for; bfloat16 and
# the two fp8 formats are reference lines (what the same activations would leave in them).
DTYPE_MAX: dict[str, float] = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
}
REFERENCE_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
DTYPE_TEXT = {"float16": "float16", "bfloat16": "bfloat16", "float8_e4m3fn": "fp8 e4m3",
              "float8_e5m2": "fp8 e5m2"}

__all__ = ["DTYPE_MAX", "REFERENCE_DTYPES", "ActivationTrace", "check_dtype", "margin_log2"]


def check_dtype(dtype: str) -> str:
    """A compute dtype's name, checked: one of :data:`DTYPE_MAX`'s keys.

    Raises:
        ValueError: ``dtype`` names another type.
    """
    if dtype not in DTYPE_MAX:
        raise ValueError(f"dtype must be one of {list(DTYPE_MAX)}, got {dtype!r}")
    return dtype


def margin_log2(max_abs: float, dtype: str = "float16") -> float:
    """``log2(dtype max / max_abs)``: doublings left before ``dtype`` overflows (negative: above it).

    ``inf`` for an all-zero output, ``nan`` for a non-finite one.

    Example:
        >>> margin_log2(65504.0 / 8)
        3.0
        >>> margin_log2(float("inf"))
        nan
    """
    if not math.isfinite(max_abs):
        return math.nan
    if max_abs == 0:
        return math.inf
    return math.log2(DTYPE_MAX[check_dtype(dtype)] / max_abs)


def _kind(value: float) -> str:
    return "NaN" if math.isnan(value) else "Inf"


@dataclasses.dataclass(frozen=True)
class ActivationTrace:
    """What the forward tracer captured over one log interval (host numbers).

    Attributes:
        layers: the traced layers, in the order the forward pass finished them.
        steps: the optimizer step of each traced row of ``maxima``, oldest first (the ring).
        maxima: ``(len(steps), len(layers))`` largest ``|output|``; ``inf``/``nan`` when non-finite.
        producer: the first layer whose inputs were finite and output was not (``None``: none seen).
        producer_step: the step at which ``producer`` was first seen in the interval.
        passed_on: the layers after the producer, at that step, whose outputs were non-finite too.
        producer_counts: per layer, the traced steps of the interval in which it was the producer.
        traced: the steps traced in the interval.
        dtype: the compute dtype the activations are judged against.
        series_layers: the layers that get a headroom series (default: all of ``layers``).
    """

    layers: tuple[str, ...]
    steps: tuple[int, ...]
    maxima: np.ndarray
    producer: str | None = None
    producer_step: int | None = None
    passed_on: tuple[str, ...] = ()
    producer_counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    traced: int = 0
    dtype: str = "float16"
    series_layers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        maxima = np.asarray(self.maxima, dtype=np.float64).reshape(len(self.steps), len(self.layers))
        object.__setattr__(self, "maxima", maxima)

    def latest(self) -> dict[str, float]:
        """Per layer, the largest ``|output|`` over the traced steps kept (non-finite wins)."""
        if not self.steps:
            return {}
        worst = np.where(np.isfinite(self.maxima), self.maxima, np.inf).max(axis=0)
        nan = np.isnan(self.maxima).any(axis=0)
        return {layer: (math.nan if nan[i] else float(worst[i])) for i, layer in enumerate(self.layers)}

    def metrics(self) -> dict[str, float]:
        """Per series layer ``loss_scale/activation_headroom/<layer>`` (log2 margin against ``dtype``, its
        finite values only), the smallest of them (``loss_scale/min_activation_headroom``) and per producer
        ``loss_scale/activation_producer/<layer>`` (traced steps in which it produced a non-finite value)."""
        values: dict[str, float] = {}
        wanted = set(self.layers if self.series_layers is None else self.series_layers)
        finite = {layer: m for layer, m in self.latest().items() if math.isfinite(m)}
        for layer, largest in finite.items():
            if layer in wanted:
                values[ACTIVATION_HEADROOM_PREFIX + layer] = margin_log2(largest, self.dtype)
        margins = [margin_log2(m, self.dtype) for m in finite.values() if m > 0]
        if margins:
            values[MIN_ACTIVATION_HEADROOM] = min(margins)
        values.update({ACTIVATION_PRODUCER_PREFIX + layer: int(count)
                       for layer, count in self.producer_counts.items() if count})
        return values

    def producer_sentence(self) -> str | None:
        """Which layer produced the first non-finite activation, and the advice (``None``: none seen)."""
        if self.producer is None:
            return None
        row = self.steps.index(self.producer_step) if self.producer_step in self.steps else -1
        value = self.maxima[row, self.layers.index(self.producer)] if self.steps else math.inf
        passed = ", ".join(f"`{name}`" for name in self.passed_on[:5])
        more = f" and {len(self.passed_on) - 5} more" if len(self.passed_on) > 5 else ""
        return (f"Layer `{self.producer}` produced the first non-finite activation ({_kind(value)}) at step "
                f"{self.producer_step}: its inputs were finite, its output was not"
                + (f" ({passed}{more} passed it on)" if passed else "")
                + f". Keep `{self.producer}` in float32.")

    def headroom_sentence(self) -> str | None:
        """The layer nearest the dtype's limit, with its margin and the reference dtypes' lines."""
        finite = {layer: m for layer, m in self.latest().items() if math.isfinite(m) and m > 0}
        if not finite:
            return None
        layer, largest = max(finite.items(), key=lambda item: item[1])
        return (f"Largest activation: layer `{layer}`, |output| up to {largest:.4g} "
                f"({_against(largest, self.dtype)}; {_references(largest)}).")

    def sentences(self) -> list[str]:
        """The trace in words: the producer (with the advice), then the headroom."""
        return [s for s in (self.producer_sentence(), self.headroom_sentence()) if s]

    def to_markdown(self, limit: int = 20, title: str | None = None) -> str:
        """The words, and a table of the ``limit`` layers nearest the limit over the traced steps kept."""
        last = self.steps[-1] if self.steps else "none"
        title = title or f"Forward trace ({self.traced} traced steps in the interval, last at step {last})"
        lines = [f"### {title}", ""]
        lines += [f"- {s}" for s in self.sentences()] or ["- Nothing traced in this interval."]
        if not self.steps:
            return "\n".join(lines)
        order = sorted(range(len(self.layers)), key=lambda i: _badness(self.maxima[:, i]))[:limit]
        steps = ", ".join(str(s) for s in self.steps)
        when = f" at the traced steps {steps}" if title is None else ""
        columns = [f"step {s}" for s in self.steps] if title is None else ["largest abs output"]
        lines += ["", f"Largest |output| per layer{when} (log2 margin against "
                  f"{DTYPE_TEXT[self.dtype]}'s max {DTYPE_MAX[self.dtype]:g} at the last):", "",
                  "| layer | " + " | ".join(columns) + " | margin |", "|---" * (len(self.steps) + 2) + "|"]
        for i in order:
            cells = " | ".join(_cell(v) for v in self.maxima[:, i])
            margin = margin_log2(float(self.maxima[-1, i]), self.dtype)
            lines.append(f"| `{self.layers[i]}` | {cells} | {_margin(margin)} |")
        return "\n".join(lines)


def _badness(column: np.ndarray) -> tuple[int, float]:
    """Non-finite layers first, then the largest maxima (sort key)."""
    if not np.isfinite(column).all():
        return (0, 0.0)
    return (1, -float(column.max(initial=0.0)))


def _cell(value: float) -> str:
    return _kind(value) if not math.isfinite(value) else f"{value:.4g}"


def _margin(margin: float) -> str:
    if math.isnan(margin):
        return "overflowed"
    return "all zero" if math.isinf(margin) else f"{margin:+.2f}"


def _against(largest: float, dtype: str) -> str:
    limit = DTYPE_MAX[dtype]
    gap = math.log2(limit / largest)
    if abs(gap) < 0.005:
        return f"at {DTYPE_TEXT[dtype]}'s max {limit:g}"
    side = "below" if gap > 0 else "above"
    return f"{times(2.0 ** abs(gap))} {side} {DTYPE_TEXT[dtype]}'s max {limit:g}, a log2 margin of {gap:+.2f}"


def _references(largest: float) -> str:
    parts = []
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        parts.append(f"{DTYPE_TEXT[dtype]} {margin_log2(largest, dtype):+.2f}")
    parts.append(f"bfloat16 {margin_log2(largest, 'bfloat16'):+.0f}")
    return "log2 margins for reference: " + ", ".join(parts)


def producers_from_series(series: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, int]:
    """Per layer, the traced steps in which it produced a non-finite activation, summed from a run's
    ``loss_scale/activation_producer/<layer>`` series (for ``report``)."""
    return {tag[len(ACTIVATION_PRODUCER_PREFIX):]: int(sum(v for _, v in points))
            for tag, points in series.items() if tag.startswith(ACTIVATION_PRODUCER_PREFIX)}
