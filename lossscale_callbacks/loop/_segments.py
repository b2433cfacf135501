"""Segments of a run and the sinks' steps: what a read means next to the reads before it.

A read at the step of the last one adds nothing (one step is one record; other counts there warn once a
run). A read whose counts cannot follow the last one (the steps went back: an older checkpoint, a new
scaler) starts a new *segment*: its metrics carry ``loss_scale/segment``, a restart note goes to the sinks
once, and the segment's sink steps are shifted past the highest step already written, so nothing written
is overwritten.

Example:
    >>> from lossscale_callbacks import LossScaleState
    >>> from lossscale_callbacks._metrics import MetricsTracker
    >>> segments = Segments()
    >>> last = MetricsTracker(1.0).observe(LossScaleState(8.0, 0, 1, 0, 100))
    >>> segments.restarted(last, LossScaleState(8.0, 0, 1, 0, 40))
    True
    >>> segments.number, segments.restarts
    (1, [(100, 40)])
"""

from __future__ import annotations

import warnings
from typing import Any

from lossscale_callbacks._metrics import INTERVAL_METRICS, RESTART_TAG, SEGMENT, counts_restarted
from lossscale_callbacks._sinks import SinkGroup
from lossscale_callbacks._stacklevel import user_stacklevel

__all__ = ["Segments"]


class Segments:
    """The run's segments, its restarts and where the sinks write each read (see the module)."""

    def __init__(self) -> None:
        self.number = 0  # the current segment (0: the run never restarted)
        self.restarts: list[tuple[int, int]] = []  # (the last step before, the first step after)
        self.last_at: int | None = None  # the sinks' step of the last metrics write (or the baseline's)
        self.highest_at: int | None = None  # the highest sinks' step a metrics write used in this run
        self.offset = 0  # added to the steps of the current segment (see sink_step)
        self.began_after: int | None = None  # a segment began: the step it starts after, if known
        self._note: str | None = None  # the restart note, until it is written
        self._repeat_warned = False

    def repeated(self, state: Any, last: Any) -> bool:
        """Whether ``state`` is at the step of the ``last`` read (nothing to record); other counts there
        warn, once a run."""
        if last is None or state.steps != last.step:
            return False
        if state.skipped_steps != last.skipped_steps and not self._repeat_warned:
            self._repeat_warned = True
            warnings.warn(
                f"[lossscale-callbacks] a second read at optimizer step {last.step} has other counts "
                f"({state.skipped_steps} skipped, the first read {last.skipped_steps}): ignored, one step is "
                "one record. Read one scaler per loop, after its step.", RuntimeWarning,
                stacklevel=user_stacklevel())
        return True

    def restarted(self, last: Any, state: Any) -> bool:
        """Whether ``state`` cannot follow the ``last`` read in one continuous run: then a new segment
        begins (the caller starts its tracker and health rules over)."""
        if last is None or not counts_restarted(last.step, last.skipped_steps, state.steps,
                                                state.skipped_steps):
            return False
        self.number += 1
        self.began_after = int(state.steps) - 1  # a read's own step is its segment's first known one
        self.restarts.append((last.step, state.steps))
        self._note = (
            f"Restart: the optimizer steps went from {last.step} ({last.skipped_steps} skipped) back to "
            f"{state.steps} ({state.skipped_steps} skipped): an older checkpoint was loaded or the scaler "
            f"was replaced. The metrics written from here on belong to segment {self.number} "
            f"({SEGMENT}); the earlier ones are kept, not overwritten.")
        return True

    def sink_step(self, step: int) -> int:
        """The sinks' step for ``step``: the first write of a new segment that would land on or before
        the highest step written shifts the segment past it (after the step it began from when known)."""
        at = step + self.offset
        if self.began_after is not None:
            if self.highest_at is not None and at <= self.highest_at:
                begins = self.began_after + self.offset if self.began_after < step else at - 1
                self.offset += self.highest_at - min(begins, at - 1)
                at = step + self.offset
            self.began_after = None
        return at

    def label(self, metrics: dict[str, Any], interval_known: bool) -> None:
        """A read's metrics as its segment writes them: without the interval's rates on a segment's
        first read (where its interval began is not known), with the segment's number after a restart."""
        if not interval_known:
            for name in INTERVAL_METRICS:
                metrics.pop(name, None)
        if self.number:
            metrics[SEGMENT] = self.number

    def written(self, at: int) -> None:
        """Metrics were written at the sinks' step ``at``."""
        self.last_at = at
        self.highest_at = at if self.highest_at is None else max(self.highest_at, at)

    def write_note(self, out: SinkGroup) -> None:
        """The pending restart note, once (at the step of the metrics just written)."""
        if self._note is not None:
            out.write_text(RESTART_TAG, self._note)
            self._note = None

    def sentence(self) -> str:
        """The restarts in the run's summary ("" when it never restarted)."""
        if not self.restarts:
            return ""
        moves = ", ".join(f"from {before} back to {after}" for before, after in self.restarts)
        return (f" The run restarted {len(self.restarts)} time(s) (optimizer steps {moves}); these "
                f"numbers and the health assessment are those of its last segment.")
