"""Delayed scaling rebuilt on the host: every step's amax and scale from two reads of a history.

Under delayed scaling (Keras' fp8 layers, TransformerEngine's ``DelayedScaling``) each tensor keeps a
history of the amaxes (largest ``|value|``) of its last ``length`` casts, and the scale a step casts with
is ``fmt.max / max(window) / 2**margin``, the window being the ``length`` amaxes that end ``lag`` steps
before it (Keras: 2, its scale and history are overwritten by the step's own gradients; TransformerEngine:
1, it updates after each step). An amax of zero or a non-finite one keeps the previous scale.

So one read of a history every ``K`` steps (``K <= length - lag``) gives every step's amax, and with the
read before it, every step's scale: :class:`DelayedHistory` keeps the amaxes by step, rebuilds the
interval's scales from the scale read last time, and checks its rebuild against the scale it reads now.
A history that does not continue the one read before, or a read whose step went back, was **replaced** (a
checkpoint was loaded, or the state was set from outside): then the scales of the interval are not
rebuilt, and the loaded history is compared with the tensor's latest amax (how stale it is).

Example:
    >>> from lossscale_callbacks.fp8._formats import E4M3
    >>> history = DelayedHistory(length=8, lag=2, fmt=E4M3)
    >>> _ = history.observe(0, [0.0] * 8, next_scale=1.0)  # the baseline, before the first step
    >>> view = history.observe(6, [0, 0, 1, 1, 1, 1, 1, 50], next_scale=448.0)  # steps -1 to 6
    >>> [scale for step, amax, scale in view.rows]  # steps 1 to 6: step 1's amax sets step 3's scale
    [1.0, 1.0, 448.0, 448.0, 448.0, 448.0]
    >>> view.saturated_steps  # step 6: an amax 50 times what its scale could hold
    ((6, 50.0),)
    >>> later = history.observe(10, [1, 1, 1, 50, 1, 1, 1, 1], next_scale=448 / 50)
    >>> round(later.history_ratio), later.outlier_step, later.coarse_until
    (50, 6, 15)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from lossscale_callbacks.fp8._formats import Fp8Format

__all__ = ["DelayedHistory", "DelayedView"]

# A window whose largest amax is matched (within a factor 2) by at most this many steps is dominated by
# one value: an outlier, not a change of range.
DOMINANT_STEPS = 3


@dataclasses.dataclass(frozen=True)
class DelayedView:
    """What one read of a delayed-scaling history tells (see :class:`DelayedHistory`).

    Attributes:
        rows: ``(step, amax, scale)`` for each step of the interval that could be rebuilt.
        saturated_steps: ``(step, overshoot)`` where the step's amax went beyond the scale's range
            (``overshoot``: amax over the largest value the scale could keep, > 1).
        history_ratio: at the interval's last step, the amax its scale was made from over the step's own
            amax (1: the scale fits; 38: 38 times coarser than the values need); ``None`` when unknown.
        outlier_step: the step of the amax that set that scale, when one step dominates the window and the
            scale is at least twice too coarse.
        coarse_until: the last step whose scale still holds that amax.
        replaced_after: the history was replaced (a load) after this step; ``None`` when it continued.
        stale_ratio: after a replacement, how far the loaded history's largest amax is from the tensor's
            latest one (>= 1, either way).
        history_max: the largest amax of the history read now.
    """

    rows: tuple[tuple[int, float, float], ...] = ()
    saturated_steps: tuple[tuple[int, float], ...] = ()
    history_ratio: float | None = None
    outlier_step: int | None = None
    coarse_until: int | None = None
    replaced_after: int | None = None
    stale_ratio: float | None = None
    history_max: float | None = None


def _ratio(a: float, b: float) -> float | None:
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
        return None
    return max(a, b) / min(a, b)


class DelayedHistory:
    """The amax history of one tensor under delayed scaling, followed from read to read.

    Args:
        length: the history's length (Keras' ``amax_history_length``, TransformerEngine's
            ``amax_history_len``).
        lag: the steps between a step and the newest amax its scale is made from (Keras 2,
            TransformerEngine 1).
        fmt: the tensor's fp8 format.
        margin: TransformerEngine's ``margin`` (the scale is divided by ``2**margin``).
    """

    def __init__(self, length: int, lag: int, fmt: Fp8Format, margin: float = 0.0) -> None:
        self.length, self.lag, self.fmt, self.margin = int(length), int(lag), fmt, float(margin)
        self._amax: dict[int, float] = {}
        self._step: int | None = None
        self._next_scale: float | None = None

    def next_scale(self, window_max: float, previous: float) -> float:
        """The scale made from a window's largest amax (the previous one when it is zero or not finite)."""
        if not math.isfinite(window_max) or window_max <= 0:
            return previous
        return self.fmt.max / window_max / 2.0**self.margin

    def _window_max(self, step: int) -> tuple[float, int | None]:
        """The largest known amax of the window of ``step``'s scale, and its step (``None``: none known)."""
        best, at = 0.0, None
        for s in range(step - self.lag - self.length + 1, step - self.lag + 1):
            value = self._amax.get(s)
            if value is not None and (at is None or value > best or math.isnan(value)):
                best, at = value, s
        return best, at

    def observe(self, step: int, amaxes: Sequence[float], next_scale: float) -> DelayedView:
        """One read after ``step`` steps: the history's amaxes oldest first (the last one is ``step``'s)
        and the scale the next step will cast with.

        The first read (at the start of training) only sets the baseline.
        """
        step, next_scale = int(step), float(next_scale)
        values = [float(v) for v in amaxes]
        read = {step - len(values) + 1 + i: v for i, v in enumerate(values)}
        previous, prev_scale = self._step, self._next_scale
        # The step count went back (a checkpoint loaded with its optimizer), or the amaxes read for steps
        # read before differ (a history loaded without one): either way this history was loaded.
        replaced = previous is not None and (step < previous or self._replaced(read, previous))
        view = DelayedView(history_max=max(values, default=0.0))
        if previous is None or replaced:
            if replaced:
                view = self._stale(view, read, previous, step)
            self._amax = dict(read)
        else:
            self._amax.update(read)
            view = self._rebuild(view, previous, prev_scale, step)
            rebuilt = self.next_scale(self._window_max(step + 1)[0], view.rows[-1][2] if view.rows else
                                      prev_scale)
            if view.rows and not math.isclose(rebuilt, next_scale, rel_tol=1e-5):
                # The history went on, but the scale did not follow it: it was set from outside.
                view = dataclasses.replace(view, replaced_after=previous)
        self._step, self._next_scale = step, next_scale
        keep = step - self.length - self.lag - 1
        self._amax = {s: v for s, v in self._amax.items() if s >= keep}
        return view

    def _replaced(self, read: dict[int, float], previous: int) -> bool:
        """Whether the amaxes read now for steps read before differ from those (a history not continued)."""
        common = [s for s in read if s <= previous and s in self._amax]
        return any(not (read[s] == self._amax[s] or (math.isnan(read[s]) and math.isnan(self._amax[s])))
                   for s in common)

    def _stale(self, view: DelayedView, read: dict[int, float], previous: int, step: int) -> DelayedView:
        loaded = [v for s, v in read.items() if s <= previous]
        fresh = [v for s, v in sorted(read.items()) if s > previous]
        latest = fresh[-1] if fresh else self._amax.get(previous, math.nan)
        loaded_max = max(loaded, default=0.0)
        return dataclasses.replace(view, replaced_after=previous, stale_ratio=_ratio(loaded_max, latest))

    def _rebuild(self, view: DelayedView, previous: int, prev_scale: float | None, step: int) -> DelayedView:
        if prev_scale is None:
            return view
        rows: list[tuple[int, float, float]] = []
        scale = prev_scale
        for s in range(previous + 1, step + 1):
            if s > previous + 1:
                scale = self.next_scale(self._window_max(s)[0], scale)
            amax = self._amax.get(s)
            if amax is None:
                return view  # the reads are too far apart for this history: nothing rebuilt
            rows.append((s, amax, scale))
        if not rows:  # read again at the same step
            return view
        saturated = tuple((s, a * m / self.fmt.max) for s, a, m in rows
                          if math.isfinite(a) and a * m >= self.fmt.saturation)
        last_step, last_amax, last_scale = rows[-1]
        window_max, at = self._window_max(last_step)
        used = self.fmt.max / last_scale / 2.0**self.margin if last_scale > 0 else math.nan
        ratio = used / last_amax if last_amax > 0 and math.isfinite(used) else None
        outlier = until = None
        if at is not None and ratio is not None and ratio >= 2 and math.isfinite(window_max):
            lo = last_step - self.lag - self.length + 1
            near = sum(1 for s in range(lo, last_step - self.lag + 1)
                       if self._amax.get(s, 0.0) >= window_max / 2)
            if near <= DOMINANT_STEPS:
                outlier, until = at, at + self.lag + self.length - 1
        return dataclasses.replace(view, rows=tuple(rows), saturated_steps=saturated, history_ratio=ratio,
                                   outlier_step=outlier, coarse_until=until)
