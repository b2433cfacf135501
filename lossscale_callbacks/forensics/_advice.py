"""The precision advice, framework-free: what to keep in float32, whether any loss scale fits, where to start.

One set of rules and one set of words for the offline audit (torch modules, Keras models, a saved
``.keras`` file) and for a live run (the summary, the health verdicts, TensorBoard's text, the W&B
table and ``report``). The integrations capture numbers; this module decides.

API for an integration:

* :class:`GradientRange` (the largest and the smallest significant ``|gradient|``, unscaled; from an
  audit's backward passes, or from the gradient forensics' histogram: :meth:`GradientRange.from_histogram`).
* :func:`fitting_scale`: the largest power-of-two loss scale at which a gradient of that size still fits.
* :func:`smallest_keep_set`: the greedy, verified keep-in-float32 set. ``run(keep)`` runs the model in
  the compute dtype with ``keep`` in float32 and returns the layer that produced the first non-finite
  value (``None`` when all was finite); the producer is added until the run is finite.
* :func:`advise` turns what was seen (producers, layers over the dtype's range, gradient causes and
  origins from :class:`~lossscale_callbacks.forensics._gradients.ForensicsTotals`, the gradient range, whether
  the scale sits at its minimum, where it settled) into an :class:`Advice`: ``fits``, ``keep_float32``,
  ``use_bfloat16``, ``initial_scale``, ``growth_interval``, and its words (``findings``, ``actions``,
  :meth:`Advice.markdown`, :meth:`Advice.to_dict`). ``code`` turns the keep list into the user's code.

Example:
    >>> advice = advise(producers={"ff.wo": 3}, gradients=GradientRange(largest=2.0**-3, smallest=2.0**-30),
    ...                 code=lambda names: f"keep_in_float32(model, {list(names)!r})")
    >>> advice.fits, advice.keep_float32, advice.use_bfloat16, advice.initial_scale
    (False, ('ff.wo',), False, 262144.0)
    >>> print(advice.actions[0])
    Keep these layers in float32: `ff.wo` (`keep_in_float32(model, ['ff.wo'])`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from lossscale_callbacks.forensics._activations import DTYPE_MAX, DTYPE_TEXT, ActivationTrace, check_dtype
from lossscale_callbacks.forensics._words import pow2, times

FP16_MIN_SUBNORMAL_LOG2 = -24.0
# Binades float16 holds from its smallest subnormal to its largest value: any scale places the
# gradients inside this window, or none does.
FP16_SPAN_LOG2 = math.log2(DTYPE_MAX["float16"]) - FP16_MIN_SUBNORMAL_LOG2
MAX_SCALE = 2.0**24
DEFAULT_GROWTH_INTERVAL = 1000
NAN_RECURRING = 2  # NaN-gradient skips with a finite loss from which they count as recurring
# What an Advice can have found: layers over the dtype's range, a producer of non-finite activations, a
# non-finite loss whose producer no traced step saw, recurring NaN gradients, a gradient spread no scale
# holds, gradients that overflow at the minimum scale, a collapse of the scale to its minimum.
KINDS = ("over_range", "producer", "unnamed_loss", "recurring_nan", "spread", "overflow_at_min", "collapse")

__all__ = ["FP16_SPAN_LOG2", "KINDS", "Advice", "AuditResult", "GradientRange", "advise", "fitting_scale",
           "largest_finite_scale", "smallest_keep_set"]


@dataclasses.dataclass(frozen=True)
class GradientRange:
    """The unscaled gradients' extent: ``largest`` (finite) and ``smallest`` significant non-zero ``|g|``."""

    largest: float
    smallest: float

    @property
    def span_log2(self) -> float:
        return math.log2(self.largest / self.smallest) if self.largest > 0 and self.smallest > 0 else 0.0

    @classmethod
    def from_histogram(cls, edges: Sequence[float], counts: Sequence[int], scale: float,
                       quantile: float = 1e-2) -> GradientRange | None:
        """From a histogram of ``log2 |scaled gradient|`` (the forensics' bins) at ``scale``: the top of the
        highest bin and the bottom of the bin holding the ``quantile`` smallest (``None``: all empty)."""
        total = sum(counts)
        if not total or scale <= 0:
            return None
        top = max(i for i, c in enumerate(counts) if c)
        running, low = 0, 0
        for i, count in enumerate(counts):
            running += count
            if running >= quantile * total:
                low = i
                break
        return cls(largest=2.0 ** edges[top + 1] / scale, smallest=2.0 ** edges[low] / scale)


def fitting_scale(largest: float, dtype: str = "float16", min_scale: float = 1.0,
                  max_scale: float = MAX_SCALE) -> float:
    """The largest power of two ``s`` with ``s * largest`` below ``dtype``'s max, within the bounds.

    Example:
        >>> fitting_scale(3.0)  # 3 * 2**14 = 49152 fits, 3 * 2**15 does not
        16384.0
    """
    if not largest > 0 or not math.isfinite(largest):
        return max_scale
    exponent = math.floor(math.log2(DTYPE_MAX[check_dtype(dtype)] / largest))
    return float(min(max(2.0**exponent, min_scale), max_scale))


def largest_finite_scale(finite_at: Callable[[float], bool], low: int = 0, high: int = 24) -> float:
    """The largest power of two from ``2**low`` to ``2**high`` at which ``finite_at(scale)`` holds, found by
    bisection (an audit's sample gradients stay finite up to a scale and overflow above it); ``2**low``
    when none does.

    Example:
        >>> largest_finite_scale(lambda scale: scale * 3.0 < 65504)  # 3 * 2**14 fits, 3 * 2**15 does not
        16384.0
    """
    if not finite_at(2.0**low):
        return 2.0**low
    while low < high:
        mid = (low + high + 1) // 2
        if finite_at(2.0**mid):
            low = mid
        else:
            high = mid - 1
    return 2.0**low


def smallest_keep_set(run: Callable[[tuple[str, ...]], str | None], max_rounds: int = 8
                      ) -> tuple[tuple[str, ...], bool]:
    """The layers to keep in float32, found by running: add each run's producer until a run is finite.

    Args:
        run: runs the model in the compute dtype with the given layers kept in float32; returns the
            layer that produced the first non-finite value, or ``None`` when every value was finite.
        max_rounds: the most runs (a producer seen twice ends the search: keeping it did not help).

    Returns:
        ``(keep, finite)``: the layers in the order found, and whether the last run was finite.

    Example:
        >>> smallest_keep_set(lambda keep: None if "wo" in keep else "wo")
        (('wo',), True)
    """
    keep: list[str] = []
    for _ in range(max_rounds):
        producer = run(tuple(keep))
        if producer is None:
            return tuple(keep), True
        if producer in keep:
            return tuple(keep), False
        keep.append(producer)
    return tuple(keep), False


@dataclasses.dataclass(frozen=True)
class Advice:
    """What to change, and why, in words and as data.

    Attributes:
        fits: float16 works as configured: nothing to keep in float32, no bfloat16.
        keep_float32: the layers to keep in float32, in the order found.
        use_bfloat16: no loss scale fits (the gradients' spread, or overflow at the minimum scale).
        initial_scale: a starting loss scale (``None``: nothing to base it on).
        growth_interval: a growth interval to go with it.
        findings: what was seen, one sentence each.
        actions: what to change, one sentence each (empty when nothing).
        kinds: which findings were made (:data:`KINDS`), for code that acts on one of them.
    """

    fits: bool
    keep_float32: tuple[str, ...] = ()
    use_bfloat16: bool = False
    initial_scale: float | None = None
    growth_interval: int | None = None
    findings: tuple[str, ...] = ()
    actions: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def sentences(self) -> list[str]:
        return [*self.findings, *self.actions]

    def markdown(self) -> str:
        """The findings, then the actions under "Advice:" (empty when there is nothing to say)."""
        lines = [f"- {s}" for s in self.findings]
        if self.actions:
            lines += ["", "Advice:", *[f"- {s}" for s in self.actions]]
        return "\n".join(lines).strip()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _names(layers: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in layers)


def _spread_words(gradients: GradientRange) -> str:
    return (f"The gradients span {pow2(gradients.smallest)} to {pow2(gradients.largest)} "
            f"({gradients.span_log2:.1f} binades); float16 holds {FP16_SPAN_LOG2:.1f} (2^-24 to 65504) at "
            "any scale, so no loss scale fits them all.")


def advise(*, producers: Mapping[str, int] | None = None, over_range: Mapping[str, float] | None = None,
           keep_float32: Sequence[str] = (), gradients: GradientRange | None = None,
           causes: Mapping[str, int] | None = None, origins: Mapping[str, int] | None = None,
           at_min_scale: bool = False, settled_scale: float | None = None, min_scale: float = 1.0,
           dtype: str = "float16", code: Callable[[Sequence[str]], str] | None = None,
           initial_scale: float | None = None) -> Advice:
    """The advice for what was seen (see the module docstring); every argument may be left out.

    Args:
        producers: per layer, the traced steps (or audit runs) in which it produced a non-finite value.
        over_range: per layer, the largest ``|value|`` (activation or weight) above ``dtype``'s max.
        keep_float32: a keep set already verified (:func:`smallest_keep_set`); producers are added to it.
        gradients: the unscaled gradients' extent.
        causes: skipped steps per cause (``loss_nonfinite``, ``grad_inf``, ``grad_nan``, ...).
        origins: per layer, the skipped steps whose overflow started there (backward pass).
        at_min_scale: the scale sits at its minimum (a collapse).
        settled_scale: where a live run's scale settled (the starting scale to advise).
        min_scale: the policy's minimum.
        dtype: the compute dtype.
        code: the user's code for a keep list (e.g. ``keep_in_float32(model, [...])``).
        initial_scale: a starting scale the integration measured (an audit's largest finite power of
            two); default: :func:`fitting_scale` of ``gradients.largest``.

    Raises:
        ValueError: ``dtype`` is not one of
            :data:`~lossscale_callbacks.forensics._activations.DTYPE_MAX`'s keys.
    """
    check_dtype(dtype)
    producers, over_range = dict(producers or {}), dict(over_range or {})
    causes, origins = dict(causes or {}), dict(origins or {})
    findings: list[str] = []
    kinds: list[str] = ["over_range"] * bool(over_range) + ["producer"] * bool(producers)
    keep = list(keep_float32)
    limit = DTYPE_MAX[dtype]
    for layer, value in over_range.items():
        findings.append(f"Layer `{layer}` reaches |{value:.4g}|, {times(value / limit)} above "
                        f"{DTYPE_TEXT[dtype]}'s max {limit:g}.")
    for layer, count in sorted(producers.items(), key=lambda item: -item[1]):
        findings.append(f"Layer `{layer}` produced a non-finite activation from finite inputs "
                        f"({count} time{'s' if count != 1 else ''}).")
    keep += [layer for layer in producers if layer not in keep]
    loss_bad = int(causes.get("loss_nonfinite", 0))
    nan = int(causes.get("grad_nan", 0))
    inf = int(causes.get("grad_inf", 0)) + int(causes.get("grad_nonfinite", 0))
    origin = max(origins.items(), key=lambda item: item[1])[0] if origins else None
    if loss_bad and not producers:
        kinds.append("unnamed_loss")
        findings.append(f"The loss was non-finite in {loss_bad} steps, and no traced step saw which layer "
                        "produced it: trace every step (diagnose=\"every_step\") to name it.")
    if nan >= NAN_RECURRING and not loss_bad:
        kinds.append("recurring_nan")
        where = f", starting in layer `{origin}`" if origin else ""
        findings.append(f"NaN gradients with a finite loss recurred in {nan} skipped steps{where}: an "
                        "Inf - Inf or 0 * Inf in the backward pass, which no loss scale fixes.")
        if origin and origin not in keep:
            keep.append(origin)
    bf16 = _needs_bfloat16(findings, kinds, gradients, at_min_scale, loss_bad, nan, inf, min_scale)
    actions = []
    if keep:
        written = f" (`{code(keep)}`)" if code is not None else ""
        actions.append(f"Keep these layers in float32: {_names(keep)}{written}.")
    if bf16:
        actions.append("Use bfloat16 (float32's exponent range, no loss scaling needed) instead of float16.")
    scale = settled_scale if initial_scale is None else initial_scale
    if scale is None and gradients is not None and not bf16:
        scale = fitting_scale(gradients.largest, dtype, min_scale)
    interval = None
    if scale is not None and not bf16 and (actions or settled_scale is None or initial_scale is not None):
        interval = DEFAULT_GROWTH_INTERVAL
        actions.append(f"Start the loss scale at {pow2(scale)} with a growth interval of {interval} steps "
                       "(a growth that overflows skips one step in a thousand at most).")
    fits = not keep and not bf16 and not over_range
    return Advice(fits, tuple(keep), bf16, scale if interval else None, interval, tuple(findings),
                  tuple(actions), tuple(kinds))


def _needs_bfloat16(findings: list[str], kinds: list[str], gradients: GradientRange | None,
                    at_min_scale: bool, loss_bad: int, nan: int, inf: int, min_scale: float) -> bool:
    """Whether no loss scale fits; the reason goes into ``findings`` (and its kind into ``kinds``)."""
    if gradients is not None and gradients.span_log2 > FP16_SPAN_LOG2:
        kinds.append("spread")
        findings.append(_spread_words(gradients))
        return True
    if gradients is not None and gradients.largest * min_scale > DTYPE_MAX["float16"]:
        kinds.append("overflow_at_min")
        findings.append(f"The largest gradient, {gradients.largest:.4g}, overflows float16 even at the "
                        f"minimum scale {min_scale:g}.")
        return True
    if not at_min_scale:
        return False
    kinds.append("collapse")
    cause = max((("a forward overflow (a non-finite loss)", loss_bad), ("NaN from the backward pass", nan),
                 ("Inf gradients at the minimum scale", inf)), key=lambda item: item[1])
    findings.append(f"The loss scale collapsed to its minimum ({min_scale:g}); the skipped steps were "
                    f"mostly {cause[0]}.")
    return cause[1] > 0 and cause[0].startswith("Inf")


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """An offline audit's answer: the advice, and the numbers it rests on.

    Attributes:
        advice: what to change (:class:`Advice`); ``advice.fits`` says whether float16 fits as it is.
        trace: the per-layer largest ``|output|`` over the sample batches in the reference precision.
        gradients: the unscaled gradients' extent over the sample batches.
        batches: how many sample batches were run.
        reference: the precision of the reference passes (``"float32"``, or the model's own dtype).
        verified: the float16 runs with ``advice.keep_float32`` kept in float32 were finite.
    """

    advice: Advice
    trace: ActivationTrace | None
    gradients: GradientRange | None
    batches: int
    reference: str = "float32"
    verified: bool = True

    def markdown(self) -> str:
        """The verdict, the advice, and the layers nearest float16's limit."""
        verdict = ("float16 fits: no layer needs float32." if self.advice.fits else
                   "float16 does not fit as it is." if self.verified else
                   "float16 does not fit, and keeping the layers found in float32 did not make it finite.")
        lines = [f"### Precision audit ({self.batches} sample batches, reference {self.reference})", "",
                 verdict, "", self.advice.markdown()]
        if self.trace is not None and self.trace.steps:
            lines += ["", self.trace.to_markdown(limit=10, title=f"Activations in {self.reference}")]
        return "\n".join(lines).replace("\n\n\n", "\n\n")

    def to_dict(self) -> dict[str, Any]:
        trace = self.trace.latest() if self.trace is not None else {}
        return {"fits": self.advice.fits, "advice": self.advice.to_dict(), "batches": self.batches,
                "reference": self.reference, "verified": self.verified,
                "gradients": None if self.gradients is None else dataclasses.asdict(self.gradients),
                "activation_max": {layer: value for layer, value in trace.items()}}
