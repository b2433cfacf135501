"""Overflow forensics: why steps were skipped, where the overflow started, how much float16 headroom is left.

The framework-free half. A scaler with ``diagnose=True`` (torch's ``LossScaler``, Keras'
``LossScaleOptimizer`` on every Keras backend) accumulates, on the device and without a host read in
the step:

* the **cause** of every skipped step: the loss itself was non-finite (a forward-pass problem that no
  loss scale fixes), the gradients held Inf only with a finite loss (the scale was too high: normal,
  dynamic scaling corrects it), or NaN with a finite loss (an ``Inf - Inf`` or ``0 * Inf`` in the
  backward pass). Where a backend does not tell the kind apart, the step counts as ``grad_nonfinite``;
* per layer, in how many skipped steps (with a finite loss) its gradients were non-finite, and in how
  many it was the **origin**: the flagged layer nearest the loss (an overflow near the loss spreads to
  every earlier layer in the same backward pass, so that is where it started). The layers are in
  forward order; per skipped step the last flagged one is counted, one-hot, on the device;
* every ``headroom_every`` steps, per layer, the largest ``|scaled gradient|`` against float16's maximum
  and the share of its gradient values below float16's smallest subnormal at the current scale (what
  would underflow to zero), plus a histogram of ``log2 |scaled gradient|``.

At the log interval the integration reads that once (one host read, next to the state's) into an
:class:`IntervalForensics`; :class:`~lossscale_callbacks.LoggingLoop` writes its metrics, a
markdown report and the histogram to the sinks, puts its words (:mod:`~lossscale_callbacks.forensics._words`)
into the health verdicts and the end-of-run summary, and keeps the run's :class:`ForensicsTotals`;
``lossscale-callbacks report`` rebuilds the same totals, and so the same words, from the logged series
(:func:`totals_from_series`).

Example:
    >>> interval = IntervalForensics(
    ...     step=20, scale=2.0**15, causes={"grad_inf": 18, "loss_nonfinite": 2},
    ...     layer_skips={"encoder.0": 18, "decoder.5.attn": 18}, layer_origins={"decoder.5.attn": 18},
    ...     layer_order=("encoder.0", "decoder.5.attn", "head"))
    >>> interval.skipped
    20
    >>> for sentence in interval.sentences():  # doctest: +NORMALIZE_WHITESPACE
    ...     print(sentence)
    The loss itself was non-finite (Inf/NaN) in 2 steps: loss scaling cannot fix this, look at the
    forward pass.
    18 skipped steps had Inf gradients with a finite loss: the scale was too high for them, which
    dynamic loss scaling expects and corrects.
    The overflow started in layer `decoder.5.attn` in all 18 skipped steps with non-finite gradients
    (each step's origin is its flagged layer nearest the loss: the backward pass carries an overflow
    from there into every earlier layer).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lossscale_callbacks._metrics import (
    ACTIVATION_PRODUCER_PREFIX,
    CAUSE_METRICS,
    CAUSES,
    FORENSICS_TAG,
    HEADROOM_METRIC,
    HISTOGRAM_TAG,
    LAYER_METRIC_PREFIX,
    ORIGIN_METRIC_PREFIX,
)
from lossscale_callbacks.forensics._activations import ActivationTrace
from lossscale_callbacks.forensics._advice import Advice, GradientRange, advise
from lossscale_callbacks.forensics._words import (
    FP16_MAX,
    FP16_MAX_LOG2,
    FP16_MAX_TEXT,
    Findings,
    findings,
    pow2,
    relation,
)

FP16_MIN_SUBNORMAL = 2.0**-24

# log2 |scaled gradient| bins: float16's subnormals start at -24, its normal range at -14, and it
# overflows from 16 on; the first and the last bin collect everything beyond.
HISTOGRAM_EXPONENTS = (-40, 20)  # the first edge and the last, as binary exponents
HISTOGRAM_EDGES: tuple[float, ...] = tuple(float(e) for e in range(HISTOGRAM_EXPONENTS[0],
                                                                   HISTOGRAM_EXPONENTS[1] + 1))
VALID_DIAGNOSE = (False, True, "every_step")

__all__ = [
    "CAUSES", "CAUSE_METRICS", "FORENSICS_TAG", "FP16_MAX", "FP16_MIN_SUBNORMAL", "HEADROOM_METRIC",
    "HISTOGRAM_EDGES", "HISTOGRAM_EXPONENTS", "HISTOGRAM_TAG", "LAYER_METRIC_PREFIX", "ORIGIN_METRIC_PREFIX",
    "ForensicsTotals", "IntervalForensics", "LayerHeadroom", "check_diagnose", "largest_log2", "layer_of",
    "totals_from_series",
]


def check_diagnose(diagnose: Any) -> bool | str:
    """``diagnose``: ``False`` (off), ``True`` (causes and layers every step, headroom sampled), or
    ``"every_step"`` (also the headroom and the Inf/NaN kind on every step).

    Only these three values: ``1.0``, ``0``, ``np.bool_(True)`` or a tensor compare equal to a bool but
    are refused, so a mistyped value never switches the forensics on or off silently.

    Example:
        >>> check_diagnose("every_step")
        'every_step'
        >>> check_diagnose(1.0)
        Traceback (most recent call last):
        ...
        ValueError: diagnose must be one of [False, True, 'every_step'], got 1.0 (float)
    """
    if diagnose is True or diagnose is False or (type(diagnose) is str and diagnose == "every_step"):
        return diagnose
    raise ValueError(f"diagnose must be one of {list(VALID_DIAGNOSE)}, got {diagnose!r} "
                     f"({type(diagnose).__name__})")


def sampled_within(first: int, steps: int, every: int) -> bool:
    """Whether one of ``steps`` steps counted from step ``first`` (0-based) is a multiple of ``every``: a
    sample taken every ``every`` steps, on the host's count, for an execution of one or several steps.

    Example:
        >>> sampled_within(0, 1, 100), sampled_within(99, 1, 100), sampled_within(98, 4, 100)
        (True, False, True)
    """
    return (-first) % every < steps


def layer_of(parameter_name: str, separator: str = ".") -> str:
    """The layer that owns a parameter: its name without the last component (``"0.weight"`` → ``"0"``)."""
    head, sep, _ = parameter_name.rpartition(separator)
    return head if sep else parameter_name


@dataclasses.dataclass(frozen=True)
class LayerHeadroom:
    """One layer's gradients at a sampled step, at the scale of that step.

    Attributes:
        layer: the layer's name.
        max_abs_scaled: the largest ``|gradient * scale|`` (``inf``/``nan`` when non-finite).
        underflow: gradient values that are not zero but whose ``|gradient * scale|`` is below
            float16's smallest subnormal (2^-24): they would flush to zero.
        total: the number of gradient values.
    """

    layer: str
    max_abs_scaled: float
    underflow: int
    total: int

    @property
    def underflow_share(self) -> float:
        return self.underflow / self.total if self.total else 0.0


def largest_log2(headroom: Sequence[LayerHeadroom]) -> float | None:
    """``log2`` of the largest finite, non-zero scaled gradient of a sample (``None`` when there is none)."""
    values = [h.max_abs_scaled for h in headroom if math.isfinite(h.max_abs_scaled) and h.max_abs_scaled > 0]
    return math.log2(max(values)) if values else None


def _underflow(headroom: Sequence[LayerHeadroom], scale: float | None) -> tuple[str, float, float] | None:
    worst = max((h for h in headroom if h.total), key=lambda h: h.underflow_share, default=None)
    if worst is None or not scale:
        return None
    return worst.layer, worst.underflow_share, scale


@dataclasses.dataclass(frozen=True)
class IntervalForensics:
    """What the device accumulated over one log interval (host numbers).

    Attributes:
        step: the optimizer steps attempted at the end of the interval.
        scale: the loss scale at the end of the interval.
        causes: skipped steps per cause (keys from :data:`CAUSES`; missing means 0).
        layer_skips: per layer, the skipped steps (with a finite loss) in which its gradients were
            non-finite; layers never flagged may be left out.
        layer_origins: per layer, the skipped steps (with a finite loss) in which it was the origin:
            the flagged layer nearest the loss (see :mod:`~lossscale_callbacks.forensics._words`).
        layer_order: every watched layer in forward order (the one nearest the loss is last).
        headroom: per layer, at the last sampled step of the interval (empty when none was sampled).
        histogram: the counts of ``log2 |scaled gradient|`` in :data:`HISTOGRAM_EDGES` bins at that
            step (``None`` when none was sampled).
        headroom_scale: the scale at that sampled step.
        activations: the forward trace of the interval (:mod:`lossscale_callbacks.forensics._activations`),
            when the integration traces the forward pass.
    """

    step: int
    scale: float
    causes: Mapping[str, int]
    layer_skips: Mapping[str, int] = dataclasses.field(default_factory=dict)
    layer_origins: Mapping[str, int] = dataclasses.field(default_factory=dict)
    layer_order: tuple[str, ...] = ()
    headroom: tuple[LayerHeadroom, ...] = ()
    histogram: tuple[int, ...] | None = None
    headroom_scale: float | None = None
    activations: ActivationTrace | None = None

    def __post_init__(self) -> None:
        unknown = set(self.causes) - set(CAUSES)
        if unknown:
            raise ValueError(f"causes: unknown cause(s) {sorted(unknown)}; allowed: {list(CAUSES)}")

    @property
    def skipped(self) -> int:
        return sum(int(v) for v in self.causes.values())

    def metrics(self) -> dict[str, int | float]:
        """Skips per cause in this interval (``loss_scale/skips/<cause>``), per flagged layer
        (``loss_scale/layer_skips/<layer>``) and per origin (``loss_scale/layer_origins/<layer>``), and
        the smallest log2 headroom when sampled (``loss_scale/min_log2_headroom``: float16's max over the
        largest finite scaled gradient; negative when that is above it)."""
        values: dict[str, int | float] = {CAUSE_METRICS[c]: int(self.causes.get(c, 0)) for c in CAUSES}
        for prefix, counts in ((LAYER_METRIC_PREFIX, self.layer_skips),
                               (ORIGIN_METRIC_PREFIX, self.layer_origins)):
            values.update({prefix + layer: int(count) for layer, count in counts.items() if count})
        largest = largest_log2(self.headroom)
        if largest is not None:
            values[HEADROOM_METRIC] = FP16_MAX_LOG2 - largest
        if self.activations is not None:
            values.update(self.activations.metrics())
        return values

    def findings(self) -> Findings:
        """This interval in words (see :mod:`~lossscale_callbacks.forensics._words`)."""
        return findings(self.causes, self.layer_skips, self.layer_origins, self.layer_order,
                        largest_log2(self.headroom), _underflow(self.headroom, self.headroom_scale))

    def sentences(self) -> list[str]:
        """This interval in words, one sentence per finding (none when nothing was skipped or sampled)."""
        return self.findings().sentences()

    def to_markdown(self) -> str:
        """A report: the findings with the flagged layers' table and, when sampled, each layer's headroom."""
        lines = [f"### Overflow forensics at step {self.step} (scale {pow2(self.scale)})", ""]
        lines.append(self.findings().markdown() or "- Nothing skipped in this interval.")
        if self.headroom:
            scale = pow2(self.headroom_scale or self.scale)
            lines += ["", f"Headroom at the sampled step (scale {scale}):", "",
                      f"| layer | largest scaled gradient | against float16's max ({FP16_MAX_TEXT}) | "
                      "underflowing values |", "|---|---|---|---|"]
            lines += [_headroom_row(h) for h in self.headroom]
        return "\n".join(lines)


def _headroom_row(room: LayerHeadroom) -> str:
    big = room.max_abs_scaled
    if not math.isfinite(big):
        largest, against = ("NaN" if math.isnan(big) else "Inf"), "overflowed"
    elif big == 0:
        largest, against = "0", "all zero"
    else:
        largest, against = f"2^{math.log2(big):.1f}", relation(math.log2(big))
    return f"| `{room.layer}` | {largest} | {against} | {room.underflow_share:.2%} |"


class ForensicsTotals:
    """The run's forensics: causes, layer and origin counts summed over intervals, the latest headroom kept.

    Example:
        >>> totals = ForensicsTotals()
        >>> totals.add(IntervalForensics(step=10, scale=1024.0, causes={"grad_inf": 2},
        ...                              layer_skips={"fc1": 2, "fc2": 2}, layer_origins={"fc2": 2},
        ...                              layer_order=("fc1", "fc2")))
        >>> totals.causes["grad_inf"], totals.layer_skips["fc1"], totals.layer_origins
        (2, 2, {'fc2': 2})
    """

    def __init__(self) -> None:
        self.causes: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.layer_skips: dict[str, int] = {}
        self.layer_origins: dict[str, int] = {}
        self.layer_order: tuple[str, ...] = ()
        self.largest_log2: float | None = None  # at the last headroom sample
        self.last: IntervalForensics | None = None
        self.last_headroom: IntervalForensics | None = None
        self.producers: dict[str, int] = {}  # per layer, traced steps it produced a non-finite activation
        self.activations: ActivationTrace | None = None  # the latest forward trace with traced steps

    def series(self, interval: IntervalForensics) -> tuple[dict[str, int], dict[str, int | float]]:
        """What the sinks get for ``interval`` (call it before :meth:`add`): ``(first, metrics)``.

        ``metrics`` are the interval's (:meth:`IntervalForensics.metrics`) plus a 0 for every layer series
        begun earlier in the run, so a layer's series has a point at every interval from its first count
        on (a chart with gaps would join counts many intervals apart as if they were one stretch).
        ``first`` holds a 0 for each series that begins in this interval, for the sinks to write at the
        previous interval's step: a series of one point is drawn as an empty chart (TensorBoard).
        """
        metrics = interval.metrics()
        first: dict[str, int] = {}
        for prefix, seen, counts in ((LAYER_METRIC_PREFIX, self.layer_skips, interval.layer_skips),
                                     (ORIGIN_METRIC_PREFIX, self.layer_origins, interval.layer_origins)):
            for layer in seen:
                metrics.setdefault(prefix + layer, 0)
            first.update({prefix + name: 0 for name, count in counts.items() if count and name not in seen})
        return first, metrics

    def add(self, interval: IntervalForensics) -> None:
        for cause, count in interval.causes.items():
            self.causes[cause] += int(count)
        for mine, counts in ((self.layer_skips, interval.layer_skips),
                             (self.layer_origins, interval.layer_origins)):
            for layer, count in counts.items():
                if count:
                    mine[layer] = mine.get(layer, 0) + int(count)
        if interval.layer_order:
            self.layer_order = interval.layer_order
        trace = interval.activations
        if trace is not None:
            for layer, count in trace.producer_counts.items():
                if count:
                    self.producers[layer] = self.producers.get(layer, 0) + int(count)
            if trace.steps and (trace.producer is not None or self.activations is None
                                or self.activations.producer is None):
                self.activations = trace  # the first producer's trace is kept over later clean ones
        self.last = interval
        if interval.headroom:
            self.last_headroom = interval
            self.largest_log2 = largest_log2(interval.headroom)

    @property
    def skipped(self) -> int:
        return sum(self.causes.values())

    def findings(self) -> Findings:
        """The whole run in words (see :mod:`~lossscale_callbacks.forensics._words`)."""
        room = self.last_headroom
        underflow = _underflow(room.headroom, room.headroom_scale) if room is not None else None
        return findings(self.causes, self.layer_skips, self.layer_origins, self.layer_order,
                        self.largest_log2, underflow)

    def sentences(self) -> list[str]:
        """The whole run in plain words, one sentence per finding."""
        return self.findings().sentences()

    def advice(self, at_min_scale: bool = False, min_scale: float = 1.0) -> Advice:
        """The run's precision advice (:func:`lossscale_callbacks.forensics._advice.advise`) from these
        counts: the forward producers, the causes, the backward origins and the last gradient
        histogram's spread."""
        room = self.last_headroom
        gradients = None
        if room is not None and room.histogram is not None and room.headroom_scale:
            gradients = GradientRange.from_histogram(HISTOGRAM_EDGES, room.histogram, room.headroom_scale)
        dtype = self.activations.dtype if self.activations is not None else "float16"
        # Where the scale settled is the starting point to advise, unless it collapsed: then the one that
        # fits the last sampled gradients (said only with another change: a healthy run gets no advice).
        last = self.last.scale if self.last is not None else 0.0
        settled = last if last > 0 and not at_min_scale else None
        return advise(producers=self.producers, gradients=gradients, causes=self.causes,
                      origins=self.layer_origins, at_min_scale=at_min_scale, settled_scale=settled,
                      min_scale=min_scale, dtype=dtype)


def totals_from_series(series: Mapping[str, Sequence[tuple[int, float]]]) -> ForensicsTotals | None:
    """The run's forensics from logged series (``loss_scale/skips/*``, ``loss_scale/layer_skips/*``,
    ``loss_scale/layer_origins/*``, ``loss_scale/min_log2_headroom``), for reports read back from a
    dashboard; ``None`` when the run logged none. The words are those of the run's own summary, short
    of the underflow (not logged as a series).

    Example:
        >>> totals = totals_from_series({"loss_scale/skips/grad_inf": [(5, 1.0), (10, 2.0)],
        ...                              "loss_scale/layer_origins/fc2": [(5, 1.0), (10, 2.0)]})
        >>> totals.causes["grad_inf"], totals.layer_origins
        (3, {'fc2': 3})
    """
    if not any(CAUSE_METRICS[c] in series for c in CAUSES):
        return None
    causes = {c: int(sum(v for _, v in series.get(CAUSE_METRICS[c], ()))) for c in CAUSES}

    def summed(prefix: str) -> dict[str, int]:
        return {tag[len(prefix):]: int(sum(v for _, v in points))
                for tag, points in series.items() if tag.startswith(prefix)}

    totals = ForensicsTotals()
    last_step = max((points[-1][0] for tag, points in series.items()
                     if tag in CAUSE_METRICS.values() and points), default=0)
    totals.add(IntervalForensics(step=last_step, scale=0.0, causes=causes,
                                 layer_skips=summed(LAYER_METRIC_PREFIX),
                                 layer_origins=summed(ORIGIN_METRIC_PREFIX)))
    totals.producers = {layer: count for layer, count in summed(ACTIVATION_PRODUCER_PREFIX).items() if count}
    headroom = series.get(HEADROOM_METRIC)
    if headroom:
        totals.largest_log2 = FP16_MAX_LOG2 - float(headroom[-1][1])
    return totals
