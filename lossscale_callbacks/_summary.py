"""The one-paragraph end-of-run summary, in plain words."""

from __future__ import annotations

import math

from lossscale_callbacks._metrics import Snapshot


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
