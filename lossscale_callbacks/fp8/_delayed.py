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
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lossscale_callbacks.fp8._formats import Fp8Format

__all__ = ["DelayedHistory", "DelayedView", "StepRows", "observe_together", "sliding_max"]

# A window whose largest amax is matched (within a factor 2) by at most this many steps is dominated by
# one value: an outlier, not a change of range.
DOMINANT_STEPS = 3


class StepRows(Sequence[tuple[int, float, float]]):
    """``(step, amax, scale)`` of consecutive rebuilt steps, kept as three arrays: a read rebuilds hundreds
    of steps per tensor, and a tuple per step cost a quarter of the rebuild; the dashboards take the
    arrays whole (:meth:`~lossscale_callbacks.fp8._reads.Fp8Read.step_metrics`). A sequence of tuples to
    everything else, equal to the tuple of its tuples.

    Example:
        >>> rows = StepRows(5, np.array([1.0, 2.0]), np.array([448.0, 224.0]))
        >>> list(rows), rows[-1], rows == ((5, 1.0, 448.0), (6, 2.0, 224.0))
        ([(5, 1.0, 448.0), (6, 2.0, 224.0)], (6, 2.0, 224.0), True)
    """

    __slots__ = ("amaxes", "first", "scales")

    def __init__(self, first: int, amaxes: np.ndarray, scales: np.ndarray) -> None:
        self.first, self.amaxes, self.scales = int(first), amaxes, scales

    @property
    def steps(self) -> np.ndarray:
        return np.arange(self.first, self.first + len(self.amaxes))

    def __len__(self) -> int:
        return len(self.amaxes)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]  # Sequence's two overloads
        if isinstance(index, slice):
            return tuple(self)[index]
        at = range(len(self))[index]
        return self.first + at, float(self.amaxes[at]), float(self.scales[at])

    def __iter__(self) -> Iterator[tuple[int, float, float]]:
        return zip(range(self.first, self.first + len(self)), self.amaxes.tolist(), self.scales.tolist(),
                   strict=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"StepRows({tuple(self)!r})"


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

    rows: Sequence[tuple[int, float, float]] = ()
    saturated_steps: tuple[tuple[int, float], ...] = ()
    history_ratio: float | None = None
    outlier_step: int | None = None
    coarse_until: int | None = None
    replaced_after: int | None = None
    stale_ratio: float | None = None
    history_max: float | None = None


def sliding_max(values: np.ndarray, width: int) -> np.ndarray:
    """The maximum of every ``width`` consecutive values along the last axis, in O(len(values)) (van Herk
    and Gil-Werman: within blocks of ``width``, the running maximum from each block's start and from its
    end; a window spans at most two blocks, so it is the larger of the second block's prefix and the first
    block's suffix). A read rebuilds ``K`` steps' windows of a 1,024-step history: ``K * 1024``
    comparisons the direct way. Rows (a 2-D ``values``) are independent: several histories at once.

    Example:
        >>> sliding_max(np.array([1.0, 3.0, 2.0, 0.0, 5.0]), 2).tolist()
        [3.0, 3.0, 2.0, 5.0]
    """
    values = np.asarray(values)
    lead, n = values.shape[:-1], values.shape[-1]
    count = n - width + 1
    if count <= 0:
        return np.zeros((*lead, 0))
    if count <= width:
        # Fewer windows than a window is long (a read: K steps of an L-step history, K < L): every window
        # holds the middle values[count - 1:width]; window i adds values[i:count - 1] before it and
        # values[width:width + i] after it, so a running maximum of each side, not of whole blocks.
        sides = np.full((2, *lead, count), -np.inf)  # [0]: the values before each window, [1]: after it
        if count > 1:
            np.maximum.accumulate(values[..., count - 2::-1], axis=-1, out=sides[0, ..., -2::-1])
            np.maximum.accumulate(values[..., width:], axis=-1, out=sides[1, ..., 1:])
        return np.maximum(sides.max(axis=0), values[..., count - 1:width].max(axis=-1, keepdims=True))
    padded = np.concatenate([values, np.full((*lead, -n % width), -np.inf)], axis=-1)
    blocks = padded.reshape(*lead, -1, width)
    prefix = np.maximum.accumulate(blocks, axis=-1).reshape(*lead, -1)
    suffix = np.maximum.accumulate(blocks[..., ::-1], axis=-1)[..., ::-1].reshape(*lead, -1)
    return np.maximum(suffix[..., :count], prefix[..., width - 1: width - 1 + count])


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
        # The amaxes known, of consecutive steps from ``_first`` on (a read's block, joined to the last).
        self._first = 0
        self._known = np.zeros(0)
        self._step: int | None = None
        self._next_scale: float | None = None
        # Set by observe_together: the 2-D array whose row ``_known`` is, and the row (its next call
        # takes the array as it is instead of stacking the rows again); None after a read of its own.
        self._rows: tuple[np.ndarray, int] | None = None

    def next_scale(self, window_max: float, previous: float) -> float:
        """The scale made from a window's largest amax (the previous one when it is zero or not finite)."""
        if not math.isfinite(window_max) or window_max <= 0:
            return previous
        return self.fmt.max / window_max / 2.0**self.margin

    def _span(self, lo: int, hi: int) -> np.ndarray:
        """The amaxes of steps ``lo`` to ``hi``: 0 where not known."""
        out = np.zeros(max(hi - lo + 1, 0))
        a, b = max(lo, self._first), min(hi, self._first + len(self._known) - 1)
        if a <= b:
            out[a - lo: b - lo + 1] = self._known[a - self._first: b - self._first + 1]
        return out

    def _known_from(self, first: int, last: int) -> bool:
        return self._first <= first and last <= self._first + len(self._known) - 1

    def observe(self, step: int, amaxes: Sequence[float], next_scale: float) -> DelayedView:
        """One read after ``step`` steps: the history's amaxes oldest first (the last one is ``step``'s)
        and the scale the next step will cast with.

        The first read (at the start of training) only sets the baseline.
        """
        step, next_scale = int(step), float(next_scale)
        values = np.asarray(amaxes, dtype=np.float64).ravel()
        self._rows = None
        first = step - len(values) + 1
        previous, prev_scale = self._step, self._next_scale
        # The step count went back (a checkpoint loaded with its optimizer), or the amaxes read for steps
        # read before differ (a history loaded without one): either way this history was loaded.
        replaced = previous is not None and (step < previous or self._replaced(first, values, previous))
        view = DelayedView(history_max=float(np.max(values)) if len(values) else 0.0)
        if previous is None or replaced:
            if replaced:
                view = self._stale(view, first, values, previous)
            self._first, self._known = first, values
        else:
            self._join(first, values)
            view, rebuilt = self._rebuild(view, previous, prev_scale, step)
            if view.rows and not math.isclose(rebuilt, next_scale, rel_tol=1e-5):
                # The history went on, but the scale did not follow it: it was set from outside.
                view = dataclasses.replace(view, replaced_after=previous)
        self._step, self._next_scale = step, next_scale
        keep = step - self.length - self.lag - 1  # older amaxes are in no window any more
        if keep > self._first:
            self._known, self._first = self._known[keep - self._first:], keep
        return view

    def _join(self, first: int, values: np.ndarray) -> None:
        """The read's block after the known one (overlapping or touching it), or in its place."""
        end = self._first + len(self._known)
        if len(self._known) and self._first <= first <= end:
            self._known = np.concatenate([self._known[: first - self._first], values])
        else:
            self._first, self._known = first, values

    def _replaced(self, first: int, values: np.ndarray, previous: int) -> bool:
        """Whether the amaxes read now for steps read before differ from those (a history not continued)."""
        lo, hi = max(first, self._first), min(previous, first + len(values) - 1,
                                              self._first + len(self._known) - 1)
        if lo > hi:
            return False
        now, before = values[lo - first: hi - first + 1], self._known[lo - self._first: hi - self._first + 1]
        return not ((now == before).all() or np.array_equal(now, before, equal_nan=True))  # NaN: rarely

    def _stale(self, view: DelayedView, first: int, values: np.ndarray, previous: int) -> DelayedView:
        split = max(0, min(len(values), previous - first + 1))  # the loaded amaxes are those up to previous
        loaded, fresh = values[:split], values[split:]
        if len(fresh):
            latest = float(fresh[-1])
        elif self._known_from(previous, previous):  # loaded after the last read: its latest amax
            latest = float(self._span(previous, previous)[0])
        else:
            latest = math.nan
        loaded_max = float(np.max(loaded)) if len(loaded) else 0.0
        return dataclasses.replace(view, replaced_after=previous, stale_ratio=_ratio(loaded_max, latest))

    def _scales(self, first: float, maxima: np.ndarray) -> np.ndarray:
        """The scales of consecutive steps: ``first``, then each made by :meth:`next_scale` from the window
        maximum before it (``maxima``, one a step), in one pass: a window that makes no scale (zero, not
        finite) keeps the one before, i.e. a forward fill."""
        made = np.empty(len(maxima) + 1)
        made[0] = first
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            made[1:] = np.where(np.isfinite(maxima) & (maxima > 0),
                                self.fmt.max / maxima / 2.0**self.margin, np.nan)
        source = np.where(np.isnan(made), 0, np.arange(len(made)))
        source[0] = 0  # the first scale stands, whatever it is (NaN included: next_scale keeps it too)
        return made[np.maximum.accumulate(source)]

    def _window_maxima(self, first: int, last: int) -> np.ndarray:
        """The window maxima of the scales of steps ``first`` to ``last``, at once (NaN counts as Inf: a
        non-finite window keeps the previous scale either way); an amax not known counts as 0."""
        known = self._span(first - self.lag - self.length + 1, last - self.lag)
        known[np.isnan(known)] = np.inf
        return sliding_max(known, self.length)

    def _rebuild(self, view: DelayedView, previous: int, prev_scale: float | None,
                 step: int) -> tuple[DelayedView, float]:
        """The interval's rows from the scale read last time; and the scale they lead to for ``step + 1``."""
        if prev_scale is None or step <= previous:  # nothing to rebuild from, or read again at the same step
            return view, math.nan
        if not self._known_from(previous + 1, step):
            return view, math.nan  # the reads are too far apart for this history: nothing rebuilt
        maxima = self._window_maxima(previous + 2, step + 1)  # one window per step from previous + 2 on
        amaxes = self._span(previous + 1, step)
        scales = self._scales(prev_scale, maxima[:-1])
        rebuilt = self.next_scale(float(maxima[-1]), float(scales[-1]))
        rows = StepRows(previous + 1, amaxes, scales)
        with np.errstate(invalid="ignore"):
            held = amaxes * scales  # what each step's scale made of its amax
            hit = np.flatnonzero(np.isfinite(amaxes) & (held >= self.fmt.saturation))
        overshoot = held[hit] / self.fmt.max
        saturated = tuple(zip((previous + 1 + hit).tolist(), overshoot.tolist(), strict=True))
        last_step, last_amax, last_scale = rows[-1]
        used = self.fmt.max / last_scale / 2.0**self.margin if last_scale > 0 else math.nan
        ratio = used / last_amax if last_amax > 0 and math.isfinite(used) else None
        outlier = until = None
        lo = last_step - self.lag - self.length + 1
        window = self._span(lo, last_step - self.lag)
        if ratio is not None and ratio >= 2 and len(window) and np.all(np.isfinite(window)):
            top = float(window.max())
            if top > 0 and np.count_nonzero(window >= top / 2) <= DOMINANT_STEPS:
                outlier = lo + int(np.argmax(window))
                until = outlier + self.lag + self.length - 1
        return dataclasses.replace(view, rows=rows, saturated_steps=saturated, history_ratio=ratio,
                                   outlier_step=outlier, coarse_until=until), rebuilt


def observe_together(histories: Sequence[DelayedHistory], step: int, amaxes: Sequence[Sequence[float]],
                     next_scales: Sequence[float]) -> list[DelayedView]:
    """:meth:`DelayedHistory.observe` of several histories read at the same step: ``amaxes`` holds one
    history's amaxes (oldest first) per history, ``next_scales`` one scale each. The same views, the same
    state after, as one call each (a property test holds them equal); but where the histories are alike
    (the same length, lag and margin, followed from the same steps, continued by this read), the rebuild
    runs once over all the rows: one read of a model's histories (three a layer) is then a handful of
    NumPy calls, not a few dozen a history.

    Example:
        >>> from lossscale_callbacks.fp8._formats import E4M3, E5M2
        >>> pair = [DelayedHistory(8, 2, E4M3), DelayedHistory(8, 2, E5M2)]
        >>> _ = observe_together(pair, 0, np.zeros((2, 8)), [1.0, 1.0])
        >>> views = observe_together(pair, 6, np.array([[0, 0, 1, 1, 1, 1, 1, 50]] * 2), [448.0, 57344.0])
        >>> [round(v.rows[-1][2]) for v in views], [v.saturated_steps for v in views]
        ([448, 57344], [((6, 50.0),), ((6, 50.0),)])
    """
    step = int(step)
    if isinstance(amaxes, np.ndarray) and amaxes.ndim == 2:
        values: np.ndarray | None = amaxes.astype(np.float64, copy=False)
        rows = list(values)
    else:
        rows = [np.asarray(a, dtype=np.float64).ravel() for a in amaxes]
        values = np.stack(rows) if rows and len({len(r) for r in rows}) == 1 else None
    scales_next = np.asarray(next_scales, dtype=np.float64).ravel()
    known = None if values is None or len(values) != len(histories) else _alike(histories, step, values)
    if known is None:
        return [h.observe(step, row, scale)
                for h, row, scale in zip(histories, rows, scales_next.tolist(), strict=True)]
    head = histories[0]
    length, lag = head.length, head.lag
    previous, first_known = head._step, head._first
    first = step - values.shape[1] + 1
    # The read continues every history (checked in _alike): join the block, rebuild the interval.
    end = first_known + known.shape[1]
    if first_known <= first <= end:
        known = np.concatenate([known[:, : first - first_known], values], axis=1)
    else:
        first_known, known = first, values

    def span(lo: int, hi: int) -> np.ndarray:
        out = np.zeros((len(histories), max(hi - lo + 1, 0)))
        a, b = max(lo, first_known), min(hi, first_known + known.shape[1] - 1)
        if a <= b:
            out[:, a - lo: b - lo + 1] = known[:, a - first_known: b - first_known + 1]
        return out

    interval, scales, rebuilt, held, hits = _rebuild_together(histories, span, previous, step)
    views = _views_together(histories, span, previous, step, interval, scales, rebuilt, held, hits,
                            scales_next, values)
    keep = step - length - lag - 1  # older amaxes are in no window any more
    if keep > first_known:
        known, first_known = known[:, keep - first_known:], keep
    for i, (h, scale) in enumerate(zip(histories, scales_next.tolist(), strict=True)):
        h._first, h._known, h._step, h._next_scale, h._rows = first_known, known[i], step, scale, (known, i)
    return views


def _views_together(histories: Sequence[DelayedHistory], span: Any, previous: int, step: int,
                    interval: np.ndarray, scales: np.ndarray, rebuilt: np.ndarray, held: np.ndarray,
                    hits: np.ndarray, scales_next: np.ndarray, values: np.ndarray) -> list[DelayedView]:
    """:func:`observe_together`'s views from its rebuild: what ``DelayedHistory._rebuild`` tells of each
    row, computed for every row at once (only a row that saturated or whose scale is coarse is looked at
    alone)."""
    head = histories[0]
    length, lag, margin = head.length, head.lag, head.margin
    fmt_max = np.array([h.fmt.max for h in histories])
    last_amax, last_scale = interval[:, -1], scales[:, -1]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        used = np.where(last_scale > 0, fmt_max / last_scale / 2.0**margin, math.nan)
        known_ratio = (last_amax > 0) & np.isfinite(used)
        ratio = np.where(known_ratio, used / last_amax, math.nan)
    # math.isclose(rebuilt, next, rel_tol=1e-5), row by row: equal (infinities too), or both finite and near
    near = np.abs(rebuilt - scales_next) <= 1e-5 * np.maximum(np.abs(rebuilt), np.abs(scales_next))
    replaced = ~((rebuilt == scales_next) | (np.isfinite(rebuilt) & np.isfinite(scales_next) & near))
    history_max = values.max(axis=1).tolist() if values.shape[1] else [0.0] * len(histories)
    saturated: list[tuple[tuple[int, float], ...]] = [()] * len(histories)
    if hits.any():
        for i in np.flatnonzero(hits.any(axis=1)).tolist():
            hit = np.flatnonzero(hits[i])
            overshoot = held[i, hit] / histories[i].fmt.max
            saturated[i] = tuple(zip((previous + 1 + hit).tolist(), overshoot.tolist(), strict=True))
    lo = step - lag - length + 1
    outliers: dict[int, tuple[int, int]] = {}
    coarse = np.flatnonzero(known_ratio & (ratio >= 2)).tolist()
    if coarse:
        window = span(lo, step - lag)
        for i in coarse:
            if window.shape[1] and np.all(np.isfinite(window[i])):
                top = float(window[i].max())
                if top > 0 and np.count_nonzero(window[i] >= top / 2) <= DOMINANT_STEPS:
                    outlier = lo + int(np.argmax(window[i]))
                    outliers[i] = (outlier, outlier + lag + length - 1)
    ratios = [r if k else None for r, k in zip(ratio.tolist(), known_ratio.tolist(), strict=True)]
    views = []
    for i, (r, gone) in enumerate(zip(ratios, replaced.tolist(), strict=True)):
        outlier, until = outliers.get(i, (None, None))
        views.append(DelayedView(rows=StepRows(previous + 1, interval[i], scales[i]),
                                 saturated_steps=saturated[i], history_ratio=r, outlier_step=outlier,
                                 coarse_until=until, replaced_after=previous if gone else None,
                                 history_max=history_max[i]))
    return views


def _rebuild_together(histories: Sequence[DelayedHistory], span: Any, previous: int, step: int
                      ) -> tuple[np.ndarray, ...]:
    """:func:`observe_together`'s rebuild (``DelayedHistory._rebuild``'s, a row a history): the amaxes and
    scales of steps ``previous + 1`` to ``step``, the scale each row leads to, what each scale held of its
    amax, and where that saturated. ``span(lo, hi)``: the known amaxes of those steps, a row a history."""
    head = histories[0]
    length, lag, margin = head.length, head.lag, head.margin
    fmt_max = np.array([h.fmt.max for h in histories])[:, None]
    saturation = np.array([h.fmt.saturation for h in histories])[:, None]
    windows = span(previous + 2 - lag - length + 1, step + 1 - lag)
    windows[np.isnan(windows)] = np.inf
    maxima = sliding_max(windows, length)  # one window per step from previous + 2 on
    interval = span(previous + 1, step)
    made = np.empty(interval.shape)
    made[:, 0] = [h._next_scale for h in histories]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        before = maxima[:, :-1]
        made[:, 1:] = np.where(np.isfinite(before) & (before > 0), fmt_max / before / 2.0**margin, np.nan)
        gaps = np.isnan(made[:, 1:])
        if gaps.any():  # a window that made no scale keeps the one before: a forward fill along the rows
            source = np.where(np.isnan(made), 0, np.arange(made.shape[1]))
            source[:, 0] = 0
            scales = np.take_along_axis(made, np.maximum.accumulate(source, axis=1), axis=1)
        else:
            scales = made
        last = maxima[:, -1]
        rebuilt = np.where(np.isfinite(last) & (last > 0), fmt_max[:, 0] / last / 2.0**margin, scales[:, -1])
        held = interval * scales
        hits = np.isfinite(interval) & (held >= saturation)
    return interval, scales, rebuilt, held, hits


def _alike(histories: Sequence[DelayedHistory], step: int, values: np.ndarray) -> np.ndarray | None:
    """Whether :func:`observe_together` may rebuild the histories at once: alike in length, lag, margin and
    what they know, each read before, at an earlier step, continued by this read (nothing replaced), and
    the interval rebuildable (:meth:`DelayedHistory._rebuild`'s conditions). Returns their known amaxes, a
    row each, where it may; else ``None``."""
    if not histories or values.shape[1] == 0:
        return None
    head = histories[0]
    if head._step is None or head._next_scale is None or step <= head._step:
        return None
    mark = (head.length, head.lag, head.margin, head._step, head._first, len(head._known))
    for h in histories:
        if (h.length, h.lag, h.margin, h._step, h._first, len(h._known)) != mark or h._next_scale is None:
            return None
    first = step - values.shape[1] + 1
    joined_first = head._first if head._first <= first <= head._first + len(head._known) else first
    if joined_first > head._step + 1:  # after the join the steps since the last read are not all known
        return None
    rows = head._rows
    if rows is not None and len(rows[0]) == len(histories) and all(
            h._rows is not None and h._rows[0] is rows[0] and h._rows[1] == i
            for i, h in enumerate(histories)):
        known = rows[0]  # as the last observe_together of these histories left them
    else:
        known = np.stack([h._known for h in histories])
    # DelayedHistory._replaced, every row at once: the amaxes read again for steps read before are those
    # read then (NaN matching NaN).
    lo, hi = max(first, head._first), min(head._step, first + values.shape[1] - 1,
                                          head._first + known.shape[1] - 1)
    if lo <= hi:
        now, before = values[:, lo - first: hi - first + 1], known[:, lo - head._first: hi - head._first + 1]
        if not (np.array_equal(now, before) or np.array_equal(now, before, equal_nan=True)):  # NaN: rarely
            return None
    return known
