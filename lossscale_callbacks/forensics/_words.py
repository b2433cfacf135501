"""The overflow forensics in words a user can act on: one text for summary, sinks and report.

One sentence per finding, in this order: the **cause** of the skipped steps (a non-finite loss; Inf
gradients, i.e. a scale too high, which dynamic scaling corrects; NaN in the backward pass), the layer
where the overflow **started** and how often each layer was that origin, the flagged layers **as a
table**, then the float16 **headroom** ("largest scaled gradient 2^x (float16's max is 2^15.99)", so
many times below or above it: never a negative "below"), and the share of values that underflow.

Why the origin: an overflow near the loss spreads to every earlier layer in the same backward pass,
so the layer flagged most often is not where it started. Per skipped step the origin is the flagged
layer nearest the loss; the integrations count it on the device.

:func:`findings` builds the words from counts alone, so the end-of-run summary, the interval reports
written to TensorBoard and W&B, and ``lossscale-callbacks report`` (which sums the logged series) say
the same thing about the same run.

Example:
    >>> words = findings(causes={"grad_inf": 13}, layer_skips={"dense": 13, "dense_1": 3},
    ...                  layer_origins={"dense": 10, "dense_1": 3}, layer_order=("dense", "dense_1"),
    ...                  largest_log2=13.0)
    >>> print(words.markdown())  # doctest: +NORMALIZE_WHITESPACE
    - 13 skipped steps had Inf gradients with a finite loss: the scale was too high for them, which
      dynamic loss scaling expects and corrects.
    - The overflow started in layer `dense` in 10 of the 13 skipped steps with non-finite gradients,
      in `dense_1` in 3 (each step's origin is its flagged layer nearest the loss: the backward pass
      carries an overflow from there into every earlier layer).
    <BLANKLINE>
    | layer | overflow started here | non-finite gradients |
    |---|---|---|
    | `dense` | 10 of 13 | 13 of 13 |
    | `dense_1` | 3 of 13 | 3 of 13 |
    <BLANKLINE>
    - Largest scaled gradient at the last headroom sample: 2^13.0 (float16's max is 2^15.99), 8.0×
      below it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from lossscale_callbacks._metrics import Snapshot

FP16_MAX = 65504.0
FP16_MAX_LOG2 = math.log2(FP16_MAX)  # 15.9989
# Cut, not rounded, to two places: "2^16.00" would read as if 65536 still fitted.
FP16_MAX_TEXT = f"2^{math.floor(FP16_MAX_LOG2 * 100) / 100:.2f}"

__all__ = ["FP16_MAX", "FP16_MAX_LOG2", "FP16_MAX_TEXT", "Findings", "findings", "headroom_words", "pow2",
           "relation", "times"]


def pow2(value: float) -> str:
    """``value`` as a power of two (``2^7``, ``2^-0.5``), or as it is when not a positive finite number."""
    if value > 0 and math.isfinite(value):
        exponent = math.log2(value)
        if exponent == round(exponent):
            return f"2^{int(exponent)}"
        return f"2^{exponent:.1f}"
    return f"{value:g}"


def times(ratio: float) -> str:
    """A factor of at least 1 in plain digits: ``1.9×``, ``150×``, ``65,536×``."""
    if ratio < 9.95:
        return f"{ratio:.1f}\u00d7"
    if ratio < 1e7:
        return f"{ratio:,.0f}\u00d7"
    return f"{ratio:.1e}\u00d7"


def relation(largest_log2: float) -> str:
    """Where a scaled gradient of ``2^largest_log2`` stands against float16's maximum: ``"8.0× below"``,
    ``"1.9× above"`` or ``"at"`` (a factor, never a negative exponent)."""
    gap = FP16_MAX_LOG2 - largest_log2
    if abs(gap) < 0.005:
        return "at"
    return f"{times(2.0 ** abs(gap))} {'below' if gap > 0 else 'above'}"


def headroom_words(largest_log2: float) -> str:
    """The largest scaled gradient against float16's maximum, never as a negative "below".

    Example:
        >>> headroom_words(16.9)
        "2^16.9 (float16's max is 2^15.99), 1.9× above it"
        >>> headroom_words(-3.0)
        "2^-3.0 (float16's max is 2^15.99), 524,032× below it"
    """
    return f"2^{largest_log2:.1f} (float16's max is {FP16_MAX_TEXT}), {relation(largest_log2)} it"


def _steps(count: int) -> str:
    return f"{count} step{'s' if count != 1 else ''}"


def _skipped(count: int) -> str:
    return f"{count} skipped step{'s' if count != 1 else ''}"


@dataclasses.dataclass(frozen=True)
class Findings:
    """The findings of an interval or a run, each one sentence, and the layers as a markdown table.

    Attributes:
        loss: the non-finite-loss finding (``None`` when every loss was finite).
        gradients: one sentence per kind of non-finite gradient (Inf, NaN, not told apart).
        origin: where the overflow started, with how often each layer was the origin.
        table: the flagged layers, markdown lines (empty when none).
        headroom: the largest scaled gradient against float16's maximum, at the last sample.
        underflow: the layer whose gradient values underflow most, when 1% or more do.
    """

    loss: str | None = None
    gradients: tuple[str, ...] = ()
    origin: str | None = None
    table: tuple[str, ...] = ()
    headroom: str | None = None
    underflow: str | None = None

    def sentences(self) -> list[str]:
        """Every finding, in order (the table left out)."""
        return [s for s in (self.loss, *self.gradients, self.origin, self.headroom, self.underflow) if s]

    def markdown(self) -> str:
        """The findings as bullets, the table after the origin (empty when there is nothing to say)."""
        head = [f"- {s}" for s in (self.loss, *self.gradients, self.origin) if s]
        tail = [f"- {s}" for s in (self.headroom, self.underflow) if s]
        blocks = [lines for lines in (head, list(self.table), tail) if lines]
        return "\n\n".join("\n".join(lines) for lines in blocks)


def _gradient_sentences(causes: Mapping[str, int]) -> tuple[str, ...]:
    inf, nan, unknown = (int(causes.get(c, 0)) for c in ("grad_inf", "grad_nan", "grad_nonfinite"))
    out = []
    if inf:
        out.append(f"{_skipped(inf)} had Inf gradients with a finite loss: the scale was too high for "
                   "them, which dynamic loss scaling expects and corrects.")
    if nan:
        out.append(f"{_skipped(nan)} had NaN gradients with a finite loss: an Inf - Inf or 0 * Inf in the "
                   "backward pass, which a lower scale may not fix.")
    if unknown:
        out.append(f"{_skipped(unknown)} had non-finite gradients with a finite loss (Inf or NaN: the kind "
                   "was not recorded).")
    return tuple(out)


def _ranked(counts: Mapping[str, int], order: Sequence[str]) -> list[tuple[str, int]]:
    """Layers with a count, most first; ties nearest the loss (latest in forward order) first."""
    position = {name: i for i, name in enumerate(order)}
    flagged = [(name, int(count)) for name, count in counts.items() if count]
    return sorted(flagged, key=lambda item: (-item[1], -position.get(item[0], -1)))


def _origin_sentence(layer_origins: Mapping[str, int], order: Sequence[str], grad_skips: int) -> str | None:
    ranked = _ranked(layer_origins, order)
    if not ranked or not grad_skips:
        return None
    (first, count), others = ranked[0], ranked[1:]
    text = f"The overflow started in layer `{first}` in "
    text += (f"all {_skipped(grad_skips)} with non-finite gradients" if count == grad_skips and not others
             else f"{count} of the {_skipped(grad_skips)} with non-finite gradients")
    text += "".join(f", in `{name}` in {n}" for name, n in others)
    return text + (" (each step's origin is its flagged layer nearest the loss: the backward pass carries an "
                   "overflow from there into every earlier layer).")


def _table(layer_skips: Mapping[str, int], layer_origins: Mapping[str, int], order: Sequence[str],
           grad_skips: int, limit: int = 20) -> tuple[str, ...]:
    position = {name: i for i, name in enumerate(order)}
    names = {n for n, c in layer_skips.items() if c} | {n for n, c in layer_origins.items() if c}
    if not names or not grad_skips:
        return ()
    rows = sorted(names, key=lambda n: (-int(layer_origins.get(n, 0)), -int(layer_skips.get(n, 0)),
                                        -position.get(n, -1)))
    columns = [("non-finite gradients", layer_skips)]
    if any(layer_origins.values()):  # runs logged before origins were counted have none
        columns.insert(0, ("overflow started here", layer_origins))
    lines = ["| layer | " + " | ".join(title for title, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    lines += [f"| `{n}` | " + " | ".join(f"{int(counts.get(n, 0))} of {grad_skips}" for _, counts in columns)
              + " |" for n in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"| ... and {len(rows) - limit} more layers |" + " |" * len(columns))
    return tuple(lines)


def findings(causes: Mapping[str, int], layer_skips: Mapping[str, int], layer_origins: Mapping[str, int],
             layer_order: Sequence[str] = (), largest_log2: float | None = None,
             underflow: tuple[str, float, float] | None = None) -> Findings:
    """The words for these counts (see the module docstring).

    Args:
        causes: skipped steps per cause (``loss_nonfinite``, ``grad_inf``, ``grad_nan``, ``grad_nonfinite``).
        layer_skips: per layer, the skipped steps (with a finite loss) in which it was flagged.
        layer_origins: per layer, the skipped steps in which it was the flagged layer nearest the loss.
        layer_order: the layers in forward order (breaks ties toward the loss); may be empty.
        largest_log2: ``log2`` of the largest finite scaled gradient at the last headroom sample.
        underflow: ``(layer, share, scale)`` of the layer whose values underflow most at that sample.
    """
    loss = int(causes.get("loss_nonfinite", 0))
    grad_skips = sum(int(causes.get(c, 0)) for c in ("grad_inf", "grad_nan", "grad_nonfinite"))
    room = under = None
    if largest_log2 is not None and math.isfinite(largest_log2):
        room = f"Largest scaled gradient at the last headroom sample: {headroom_words(largest_log2)}."
    if underflow is not None and underflow[1] >= 0.01:
        layer, share, scale = underflow
        under = (f"{share:.1%} of layer `{layer}`'s gradient values fall below float16's smallest subnormal "
                 f"at scale {pow2(scale)}: they underflow to zero.")
    return Findings(
        loss=(f"The loss itself was non-finite (Inf/NaN) in {_steps(loss)}: loss scaling cannot fix this, "
              "look at the forward pass." if loss else None),
        gradients=_gradient_sentences(causes),
        origin=_origin_sentence(layer_origins, layer_order, grad_skips),
        table=_table(layer_skips, layer_origins, layer_order, grad_skips),
        headroom=room, underflow=under)

# ----------------------------------------
# The one-paragraph end-of-run summary, in plain words.


def summarize(snapshot: Snapshot | None, min_scale: float | None = None) -> str:
    """Describe a run from its last snapshot: steps, skips, final scale, time at the minimum.

    Example:
        >>> from lossscale_callbacks._metrics import MetricsTracker
        >>> tracker = MetricsTracker(min_scale=1.0)
        >>> snap = tracker.observe({"steps": 1000, "skipped_steps": 7, "scale": 4096.0,
        ...                         "growth_counter": 12, "hysteresis_left": 1})
        >>> print(summarize(snap))  # doctest: +NORMALIZE_WHITESPACE
        Loss scaling: 1000 optimizer steps, 7 skipped (0.70%) for Inf/NaN gradients; final loss
        scale 4096 (2^12.0). The scale was never seen at its minimum.
    """
    if snapshot is None or snapshot.step == 0:
        return "Loss scaling: no optimizer step was taken."
    rate = snapshot.skipped_steps / snapshot.step
    scale = snapshot.scale
    exponent = f" (2^{math.log2(scale):.1f})" if math.isfinite(scale) and scale > 0 else (
        ": not a usable loss scale, every step with it is skipped or wrong")
    text = (
        f"Loss scaling: {snapshot.step} optimizer steps, {snapshot.skipped_steps} skipped ({rate:.2%}) "
        f"for Inf/NaN gradients; final loss scale {scale:g}{exponent}."
    )
    if snapshot.total_steps_at_min_scale or snapshot.at_min_scale:
        bound = f" ({min_scale:g})" if min_scale is not None else ""
        text += (f" About {snapshot.total_steps_at_min_scale} steps were spent at the minimum scale{bound}"
                 f"{', where it still is' if snapshot.at_min_scale else ''}.")
    else:
        text += " The scale was never seen at its minimum."
    return text
