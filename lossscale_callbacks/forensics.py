"""Overflow forensics: why steps were skipped, which layers overflowed, how much float16 headroom is left.

The framework-free half. A scaler with ``diagnose=True`` (torch's ``LossScaler``, Keras'
``LossScaleOptimizer``) accumulates, on the device and without a host read in the step:

* the **cause** of every skipped step: the loss itself was non-finite (a forward-pass problem that no
  loss scale fixes), the gradients held Inf only with a finite loss (the scale was too high: normal,
  dynamic scaling corrects it), or NaN with a finite loss (an ``Inf - Inf`` or ``0 * Inf`` in the
  backward pass). Where a backend does not tell the kind apart, the step counts as ``grad_nonfinite``;
* per layer, in how many skipped steps (with a finite loss) its gradients were non-finite;
* every ``headroom_every`` steps, per layer, the largest ``|scaled gradient|`` against float16's maximum
  (``log2`` headroom before overflow) and the share of its gradient values below float16's smallest
  subnormal at the current scale (what would underflow to zero), plus a histogram of
  ``log2 |scaled gradient|``.

At the log interval the integration reads that once (one host read, next to the state's) into an
:class:`IntervalForensics`; :class:`~lossscale_callbacks.LoggingLoop` writes its metrics, a markdown
report and the histogram to the sinks, puts its plain words into the health verdicts and the
end-of-run summary, and keeps the run's :class:`ForensicsTotals`.

Example:
    >>> interval = IntervalForensics(
    ...     step=20, scale=2.0**15, causes={"grad_inf": 18, "loss_nonfinite": 2},
    ...     layer_skips={"encoder.0": 3, "decoder.5.attn": 18},
    ...     layer_order=("encoder.0", "decoder.5.attn", "head"))
    >>> interval.nearest_layer, interval.skipped
    ('decoder.5.attn', 20)
    >>> print(interval.sentences()[0])  # doctest: +NORMALIZE_WHITESPACE
    The loss itself was non-finite (Inf/NaN) in 2 steps: loss scaling cannot fix this,
    look at the forward pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

FP16_MAX = 65504.0
FP16_MIN_SUBNORMAL = 2.0**-24

CAUSES = ("loss_nonfinite", "grad_inf", "grad_nan", "grad_nonfinite")
CAUSE_METRICS = {cause: f"loss_scale/skips/{cause}" for cause in CAUSES}
LAYER_METRIC_PREFIX = "loss_scale/layer_skips/"
FORENSICS_TAG = "loss_scale/forensics"
HISTOGRAM_TAG = "loss_scale/log2_abs_scaled_grad"
# log2 |scaled gradient| bins: float16's subnormals start at -24, its normal range at -14, and it
# overflows from 16 on; the first and the last bin collect everything beyond.
HISTOGRAM_EXPONENTS = (-40, 20)  # the first edge and the last, as binary exponents
HISTOGRAM_EDGES: tuple[float, ...] = tuple(float(e) for e in range(HISTOGRAM_EXPONENTS[0],
                                                                   HISTOGRAM_EXPONENTS[1] + 1))
VALID_DIAGNOSE = (False, True, "every_step")

__all__ = [
    "CAUSES", "CAUSE_METRICS", "FORENSICS_TAG", "FP16_MAX", "FP16_MIN_SUBNORMAL", "HISTOGRAM_EDGES",
    "HISTOGRAM_EXPONENTS", "HISTOGRAM_TAG", "LAYER_METRIC_PREFIX", "ForensicsTotals", "IntervalForensics",
    "LayerHeadroom",
    "check_diagnose", "layer_of", "totals_from_series",
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


def layer_of(parameter_name: str, separator: str = ".") -> str:
    """The layer that owns a parameter: its name without the last component (``"0.weight"`` → ``"0"``)."""
    head, sep, _ = parameter_name.rpartition(separator)
    return head if sep else parameter_name


def _pow2(value: float) -> str:
    if value > 0 and math.isfinite(value):
        exponent = math.log2(value)
        if exponent == round(exponent):
            return f"2^{int(exponent)}"
        return f"2^{exponent:.1f}"
    return f"{value:g}"


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
    def log2_headroom(self) -> float:
        """``log2(65504 / max |scaled gradient|)``: how many doublings of the scale still fit (``inf`` for
        all-zero gradients, ``nan`` for non-finite ones)."""
        if not math.isfinite(self.max_abs_scaled):
            return math.nan
        if self.max_abs_scaled == 0:
            return math.inf
        return math.log2(FP16_MAX / self.max_abs_scaled)

    @property
    def underflow_share(self) -> float:
        return self.underflow / self.total if self.total else 0.0


@dataclasses.dataclass(frozen=True)
class IntervalForensics:
    """What the device accumulated over one log interval (host numbers).

    Attributes:
        step: the optimizer steps attempted at the end of the interval.
        scale: the loss scale at the end of the interval.
        causes: skipped steps per cause (keys from :data:`CAUSES`; missing means 0).
        layer_skips: per layer, the skipped steps (with a finite loss) in which its gradients were
            non-finite; layers never flagged may be left out.
        layer_order: every watched layer in forward order (the one nearest the loss is last).
        headroom: per layer, at the last sampled step of the interval (empty when none was sampled).
        histogram: the counts of ``log2 |scaled gradient|`` in :data:`HISTOGRAM_EDGES` bins at that
            step (``None`` when none was sampled).
        headroom_scale: the scale at that sampled step.
    """

    step: int
    scale: float
    causes: Mapping[str, int]
    layer_skips: Mapping[str, int] = dataclasses.field(default_factory=dict)
    layer_order: tuple[str, ...] = ()
    headroom: tuple[LayerHeadroom, ...] = ()
    histogram: tuple[int, ...] | None = None
    headroom_scale: float | None = None

    def __post_init__(self) -> None:
        unknown = set(self.causes) - set(CAUSES)
        if unknown:
            raise ValueError(f"causes: unknown cause(s) {sorted(unknown)}; allowed: {list(CAUSES)}")

    @property
    def skipped(self) -> int:
        return sum(int(v) for v in self.causes.values())

    @property
    def skipped_with_finite_loss(self) -> int:
        return self.skipped - int(self.causes.get("loss_nonfinite", 0))

    def top_layers(self, limit: int = 3) -> list[tuple[str, int]]:
        """The layers flagged most often, most first (ties: nearest the loss first)."""
        position = {name: i for i, name in enumerate(self.layer_order)}
        flagged = [(n, int(c)) for n, c in self.layer_skips.items() if c]
        flagged.sort(key=lambda item: (-item[1], -position.get(item[0], -1)))
        return flagged[:limit]

    @property
    def nearest_layer(self) -> str | None:
        """The flagged layer nearest the loss: the first in backward order (the last in forward order)."""
        position = {name: i for i, name in enumerate(self.layer_order)}
        flagged = [n for n, c in self.layer_skips.items() if c]
        if not flagged:
            return None
        return max(flagged, key=lambda name: position.get(name, -1))

    def metrics(self) -> dict[str, int | float]:
        """Skips per cause in this interval (``loss_scale/skips/<cause>``), per flagged layer
        (``loss_scale/layer_skips/<layer>``), and the smallest log2 headroom when sampled."""
        values: dict[str, int | float] = {CAUSE_METRICS[c]: int(self.causes.get(c, 0)) for c in CAUSES}
        for layer, count in self.layer_skips.items():
            if count:
                values[LAYER_METRIC_PREFIX + layer] = int(count)
        finite = [h.log2_headroom for h in self.headroom if math.isfinite(h.log2_headroom)]
        if finite:
            values["loss_scale/min_log2_headroom"] = float(min(finite))
        return values

    def sentences(self) -> list[str]:
        """This interval in plain words (nothing when nothing was skipped or sampled)."""
        return _sentences(self.causes, self.layer_skips, self.layer_order, self.headroom,
                          self.headroom_scale, self.skipped_with_finite_loss)

    def to_markdown(self) -> str:
        """A report: the sentences, the flagged layers and, when sampled, the headroom table."""
        lines = [f"### Overflow forensics at step {self.step} (scale {_pow2(self.scale)})", ""]
        lines += [f"- {s}" for s in self.sentences()] or ["- Nothing skipped in this interval."]
        if self.layer_skips:
            lines += ["", "| layer | skipped steps with non-finite gradients |", "|---|---|"]
            lines += [f"| `{n}` | {c} |" for n, c in self.top_layers(limit=20)]
        if self.headroom:
            lines += ["", f"Headroom at scale {_pow2(self.headroom_scale or self.scale)}:", "",
                      "| layer | max abs scaled gradient | log2 headroom | underflowing values |",
                      "|---|---|---|---|"]
            for h in self.headroom:
                lines.append(f"| `{h.layer}` | {h.max_abs_scaled:.4g} | {h.log2_headroom:.2f} | "
                             f"{h.underflow_share:.2%} |")
        return "\n".join(lines)


def _sentences(causes: Mapping[str, int], layer_skips: Mapping[str, int], layer_order: Sequence[str],
               headroom: Sequence[LayerHeadroom], headroom_scale: float | None,
               grad_skips: int) -> list[str]:
    out = []
    loss = int(causes.get("loss_nonfinite", 0))
    if loss:
        out.append(f"The loss itself was non-finite (Inf/NaN) in {loss} step{'s' if loss != 1 else ''}: "
                   "loss scaling cannot fix this, look at the forward pass.")
    position = {name: i for i, name in enumerate(layer_order)}
    flagged = sorted(((n, int(c)) for n, c in layer_skips.items() if c),
                     key=lambda item: (-item[1], -position.get(item[0], -1)))
    if flagged and grad_skips:
        name, count = flagged[0]
        text = f"Layer `{name}` had non-finite gradients in {count} of {grad_skips} skipped steps"
        if layer_order:  # the model's order is known: say which flagged layer the backward reaches first
            nearest = max((n for n, _ in flagged), key=lambda n: position.get(n, -1))
            text += "; of the flagged layers it is the nearest the loss." if nearest == name else \
                f"; the flagged layer nearest the loss is `{nearest}`."
        else:
            text += "."
        room = next((h for h in headroom if h.layer == name), None)
        if room is not None and math.isfinite(room.log2_headroom) and headroom_scale:
            text += (f" Its gradients sit 2^{-room.log2_headroom:.1f} below float16's maximum at scale "
                     f"{_pow2(headroom_scale)}.")
        out.append(text)
    inf, nan, unknown = (int(causes.get(c, 0)) for c in ("grad_inf", "grad_nan", "grad_nonfinite"))
    if inf:
        out.append(f"{inf} skipped step{'s' if inf != 1 else ''} had Inf gradients with a finite loss: the "
                   "scale was too high for them, which dynamic loss scaling expects and corrects.")
    if nan:
        out.append(f"{nan} skipped step{'s' if nan != 1 else ''} had NaN gradients with a finite loss: an "
                   "Inf - Inf or 0 * Inf in the backward pass; a lower scale may not help.")
    if unknown:
        plural = "s" if unknown != 1 else ""
        out.append(f"{unknown} skipped step{plural} had non-finite gradients with a finite "
                   "loss (Inf or NaN: the kind was not recorded).")
    worst = max((h for h in headroom if h.total), key=lambda h: h.underflow_share, default=None)
    if worst is not None and worst.underflow_share >= 0.01 and headroom_scale:
        out.append(f"{worst.underflow_share:.1%} of layer `{worst.layer}`'s gradient values fall below "
                   f"float16's smallest subnormal at scale {_pow2(headroom_scale)}: they underflow to zero.")
    return out


class ForensicsTotals:
    """The run's forensics: causes and layer counts summed over intervals, the latest headroom kept.

    Example:
        >>> totals = ForensicsTotals()
        >>> totals.add(IntervalForensics(step=10, scale=1024.0, causes={"grad_inf": 2},
        ...                              layer_skips={"fc2": 2}, layer_order=("fc1", "fc2")))
        >>> totals.causes["grad_inf"], totals.layer_skips["fc2"]
        (2, 2)
    """

    def __init__(self) -> None:
        self.causes: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.layer_skips: dict[str, int] = {}
        self.layer_order: tuple[str, ...] = ()
        self.last: IntervalForensics | None = None
        self.last_headroom: IntervalForensics | None = None

    def add(self, interval: IntervalForensics) -> None:
        for cause, count in interval.causes.items():
            self.causes[cause] += int(count)
        for layer, count in interval.layer_skips.items():
            self.layer_skips[layer] = self.layer_skips.get(layer, 0) + int(count)
        if interval.layer_order:
            self.layer_order = interval.layer_order
        self.last = interval
        if interval.headroom:
            self.last_headroom = interval

    @property
    def skipped(self) -> int:
        return sum(self.causes.values())

    def sentences(self) -> list[str]:
        """The whole run in plain words."""
        room = self.last_headroom
        return _sentences(self.causes, self.layer_skips, self.layer_order,
                          room.headroom if room else (), room.headroom_scale if room else None,
                          self.skipped - self.causes["loss_nonfinite"])


def totals_from_series(series: Mapping[str, Sequence[tuple[int, float]]]) -> ForensicsTotals | None:
    """The run's forensics from logged series (``loss_scale/skips/*``, ``loss_scale/layer_skips/*``), for
    reports read back from a dashboard; ``None`` when the run logged none. The layers' order is not
    logged, so the report does not say which is nearest the loss."""
    causes = {c: int(sum(v for _, v in series.get(CAUSE_METRICS[c], ()))) for c in CAUSES}
    if not any(CAUSE_METRICS[c] in series for c in CAUSES):
        return None
    layers = {tag[len(LAYER_METRIC_PREFIX):]: int(sum(v for _, v in points))
              for tag, points in series.items() if tag.startswith(LAYER_METRIC_PREFIX)}
    totals = ForensicsTotals()
    last_step = max((points[-1][0] for tag, points in series.items()
                     if tag in CAUSE_METRICS.values() and points), default=0)
    totals.add(IntervalForensics(step=last_step, scale=0.0, causes=causes, layer_skips=layers))
    return totals

