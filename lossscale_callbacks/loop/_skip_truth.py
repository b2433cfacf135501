"""Skip truth in the loop: each read's step outcomes as metrics, the not-held check, a summary sentence.

A state read at the interval may carry (see :func:`~lossscale_callbacks.skips._outcomes.carry`) what
happened to the interval's steps (``outcomes``, an
:class:`~lossscale_callbacks.skips._outcomes.IntervalOutcomes`: torch's ``ScalerReader`` for our scaler lists
every non-ordinary step, for a stock one gives the counts) and every follower's own step count
(``followers``: LR schedulers, EMAs, a trainer's step counter). :class:`SkipTruth` turns them into:

* the metrics of :data:`~lossscale_callbacks._metrics.OUTCOME_METRICS`: the applied steps (cumulative and in
  the interval) and the skipped ones by cause, cumulative. A state without outcomes (Keras, a plain
  ``scaler.get_state``) gives them from the state: its skipped steps are all of the run's cause
  (``"overflow"`` where the policy scales, ``"nonfinite"`` at a fixed scale of 1), no spike, nothing applied
  non-finite;
* one ``not_held`` verdict per follower that advanced on skipped steps
  (:class:`~lossscale_callbacks.skips._followers.FollowerCheck`), acting as the first rule does;
* a sentence for the summary: the applied steps and the skips by cause.

``SKIPPED_STEPS`` (the state's count, what the health rules' skip rate and consecutive skips judge) counts
only the steps skipped for Inf/NaN gradients: a spike skip is not an overflow.

Example:
    >>> from lossscale_callbacks import DynamicPolicy, LossScaleState
    >>> from lossscale_callbacks._metrics import MetricsTracker
    >>> from lossscale_callbacks.skips._outcomes import IntervalOutcomes, StepOutcome
    >>> truth = SkipTruth()
    >>> state = LossScaleState(512.0, 0, 0, 3, 100)
    >>> interval = IntervalOutcomes(1, 100, (StepOutcome(3, "overflow", 1024.0),), {"overflow": 3}, missed=2)
    >>> snapshot = MetricsTracker(1.0).observe(state)
    >>> truth.metrics(snapshot, interval, DynamicPolicy())["loss_scale/applied_steps"]
    97
    >>> truth.sentence()
    ' Of the 100 optimizer steps, 97 were applied and 3 skipped (3 for an overflow).'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lossscale_callbacks._health import Verdict
from lossscale_callbacks._metrics import (
    APPLIED_IN_INTERVAL,
    APPLIED_NONFINITE,
    APPLIED_STEPS,
    SKIPPED_BY_CAUSE,
    Snapshot,
)
from lossscale_callbacks.skips._followers import RULE, FollowerCheck, FollowerCount
from lossscale_callbacks.skips._outcomes import (
    APPLIED_NONFINITE as APPLIED_NONFINITE_CAUSE,
)
from lossscale_callbacks.skips._outcomes import (
    OVERFLOW,
    SPIKE,
    IntervalOutcomes,
    nonfinite_cause,
)

__all__ = ["SkipTruth"]

_WORDS = {"overflow": "for an overflow", "nonfinite": "for a non-finite gradient",
          "spike": "by the spike rule"}


class SkipTruth:
    """A run's step outcomes at the interval (see the module). Made afresh for each run and segment."""

    def __init__(self) -> None:
        self._spikes = 0  # spike skips so far in this segment (the state counts the others)
        self._applied_nonfinite = 0
        self._cause = OVERFLOW
        self._last: Snapshot | None = None
        self.last_outcomes: IntervalOutcomes | None = None  # the latest read's (for a consumer: the ledger)
        self.last_metrics: dict[str, int] = {}
        self._check = FollowerCheck()

    def restart(self) -> None:
        """A new segment: the counts start again with it (the followers are compared afresh)."""
        self._spikes = self._applied_nonfinite = 0
        self._last = None
        self._check.restart()

    def metrics(self, snapshot: Snapshot, outcomes: IntervalOutcomes | None, policy: Any) -> dict[str, int]:
        """The read's outcome metrics (cumulative in this segment, and the interval's applied steps)."""
        self._cause = nonfinite_cause(policy)
        self.last_outcomes = outcomes
        spikes_now = 0
        if outcomes is not None:
            spikes_now = outcomes.counts[SPIKE]
            self._spikes += spikes_now
            self._applied_nonfinite += outcomes.counts[APPLIED_NONFINITE_CAUSE]
        self._last = snapshot
        in_interval = snapshot.interval_steps - snapshot.skipped_in_interval - spikes_now
        values = {APPLIED_STEPS: self.applied, APPLIED_NONFINITE: self._applied_nonfinite,
                  APPLIED_IN_INTERVAL: max(in_interval, 0)}
        for cause, name in SKIPPED_BY_CAUSE.items():
            values[name] = (self._spikes if cause == SPIKE else
                            snapshot.skipped_steps if cause == self._cause else 0)
        self.last_metrics = values
        return values

    @property
    def applied(self) -> int:
        """The applied steps of the segment so far (as of the last read)."""
        last = self._last
        return 0 if last is None else max(last.step - last.skipped_steps - self._spikes, 0)

    def verdicts(self, followers: Sequence[FollowerCount], action: str) -> list[Verdict]:
        """The ``not_held`` verdict of the followers that advanced on skipped steps (each named once)."""
        last = self._last
        if last is None or not followers:
            return []
        listed = self.last_outcomes.skipped_steps if self.last_outcomes is not None else ()
        words = self._check.observe(last.step, self.applied, listed, followers)
        return [] if words is None else [Verdict(RULE, action, last.step, words)]

    def sentence(self) -> str:
        """The summary's sentence: the applied steps and the skips by cause (empty before any read)."""
        last = self._last
        if last is None or last.step == 0:
            return ""
        skips = {self._cause: last.skipped_steps, SPIKE: self._spikes}
        named = [f"{count} {_WORDS[cause]}" for cause, count in skips.items() if count]
        skipped = sum(skips.values())
        text = (f" Of the {last.step} optimizer steps, {self.applied} were applied and {skipped} skipped"
                + (f" ({', '.join(named)})" if named else ""))
        if self._applied_nonfinite:
            text += (f"; {self._applied_nonfinite} of the applied ones had non-finite gradients (monitoring "
                     "only)")
        return text + "."
