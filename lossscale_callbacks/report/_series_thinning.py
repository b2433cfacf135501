"""A long run's scale and skipped-steps series thinned to a bounded size for its picture and JSON.

A report judges every log point as it reads it (see :mod:`._run_report`); what it keeps to print and
draw is this. Up to ``limit`` log points, every one is kept. Past that, consecutive log points are
taken in stretches and each stretch keeps two: the one with the lowest scale (a back-off stays in
the picture) and its last one (where the scale and the skipped count stood). When the stretches
number more than ``limit``, neighbours are merged, so a stretch doubles in length each time the run
does: at most ``2 * limit`` points are kept however long the run, and up to three a segment more.
A stretch never spans a restart (the step going back), and each segment keeps its first point, so
the kept series are cut into the same segments as the whole run; what grows is therefore one stretch
per restart.

The cumulative skipped count is exact at every kept point; the skip rate between two kept points is
the rate over the log points between them.

Example:
    >>> thinned = ThinnedRun(limit=2)
    >>> for step, scale in enumerate([8.0, 4.0, 8.0, 8.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0], start=1):
    ...     thinned.add(step, scale, 10 - step)
    >>> thinned.series()["loss_scale/scale"]
    [(1, 8.0), (2, 4.0), (4, 8.0), (5, 2.0), (8, 4.0), (9, 4.0), (10, 4.0)]
    >>> thinned.count, thinned.kept
    (10, 7)
"""

from __future__ import annotations

from lossscale_callbacks import _metrics as m

__all__ = ["LIMIT", "ThinnedRun"]

LIMIT = 1 << 15  # stretches kept before neighbours merge: runs up to 32,768 log points are kept whole

# A stretch: [segment, log points in it, lowest point, last point, the segment's first point or None];
# a point: (index, step, scale, skipped).
_SEGMENT, _SIZE, _LOW, _LAST, _FIRST = range(5)


class ThinnedRun:
    """Log points ``(step, scale, cumulative skipped)`` in; at most ``2 * limit`` kept, and three a segment.

    Args:
        limit: stretches kept before neighbours merge, an integer >= 2 (default :data:`LIMIT`).

    Raises:
        ValueError: ``limit`` is not an integer >= 2.
    """

    def __init__(self, limit: int | None = None) -> None:
        limit = LIMIT if limit is None else limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 2:
            raise ValueError(f"limit must be an integer >= 2, got {limit!r}")
        self.limit = limit
        self.count = 0
        self._stretches: list[list] = []
        self._width = 1  # log points per stretch
        self._segment = 0
        self._last_step: int | None = None

    def add(self, step: int, scale: float, skipped: float) -> None:
        """One log point, in the order logged (a step not above the last one starts a new segment)."""
        point = (self.count, step, scale, skipped)
        self.count += 1
        restarted = self._last_step is not None and step <= self._last_step
        self._last_step = step
        if restarted:
            self._segment += 1
        stretches = self._stretches
        if stretches and not restarted:
            open_ = stretches[-1]
            if open_[_SIZE] < self._width:
                open_[_SIZE] += 1
                if scale < open_[_LOW][2]:  # the first lowest kept (a NaN never replaces it)
                    open_[_LOW] = point
                open_[_LAST] = point
                return
        starts = not stretches or restarted  # the segment's first point: kept, so the restart shows
        stretches.append([self._segment, 1, point, point, point if starts else None])
        # Each segment has a stretch of its own whatever the limit (merges never cross a restart): only
        # the stretches beyond one a segment count, so a log of many restarts (each line printed twice)
        # keeps a stretch per segment instead of merging in vain at every point.
        if len(stretches) - self._segment - 1 > self.limit:
            self._merge()

    def _merge(self) -> None:
        """Neighbours of one segment merged in pairs: the stretches beyond one a segment halve, each twice as
        long (called when they number more than ``limit``, so at least one pair merges)."""
        merged: list[list] = []
        stretches = self._stretches
        i = 0
        while i < len(stretches):
            first = stretches[i]
            second = stretches[i + 1] if i + 1 < len(stretches) else None
            if second is None or second[_SEGMENT] != first[_SEGMENT]:
                merged.append(first)
                i += 1
                continue
            low = second[_LOW] if second[_LOW][2] < first[_LOW][2] else first[_LOW]
            merged.append([first[_SEGMENT], first[_SIZE] + second[_SIZE], low, second[_LAST], first[_FIRST]])
            i += 2
        self._stretches = merged
        self._width *= 2

    @property
    def kept(self) -> int:
        """How many points :meth:`series` holds."""
        return len(self._points())

    def _points(self) -> list[tuple[int, int, float, float]]:
        out = []
        for stretch in self._stretches:
            # in the order logged, each once: a point's index orders them
            out.extend(sorted({p[0]: p for p in stretch[_LOW:] if p is not None}.values()))
        return out

    def series(self) -> dict[str, list[tuple[int, float]]]:
        """The kept points as the report's series: ``loss_scale/scale`` and ``loss_scale/skipped_steps``."""
        points = self._points()
        return {m.SCALE: [(step, scale) for _, step, scale, _ in points],
                m.SKIPPED_STEPS: [(step, float(skipped)) for _, step, _, skipped in points]}

    def words(self) -> str | None:
        """What was thinned, in one sentence; None when every log point was kept."""
        kept = self.kept
        if kept == self.count:
            return None
        return (f"the series printed and drawn are thinned: {kept} of {self.count} log points kept (in each "
                f"stretch of {self._width} consecutive log points, the lowest scale and the last point); "
                "the counts and verdicts are from every log point")
