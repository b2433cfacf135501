"""The end-of-run summary of the logging loop: one text for the sinks, the console and the caller.

First the run in one paragraph (steps, skips, final scale, time at the minimum), then what the loop's
rooms add to it, one sentence each (the ranks, the restarts), then the health assessment, the forensics
and the precision advice, then the caller's note.

Example:
    >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
    >>> from lossscale_callbacks._metrics import MetricsTracker
    >>> from lossscale_callbacks._sinks import SinkGroup
    >>> from lossscale_callbacks.loop._verdicts import Diagnosis
    >>> policy = DynamicPolicy(initial_scale=8.0, growth_interval=4)
    >>> tracker = MetricsTracker(1.0)
    >>> _ = tracker.observe(next_state(policy, initial_state(policy), finite=False))
    >>> print(run_summary(tracker, 1.0, [" Hello."], None, Diagnosis(), SinkGroup(), note="Bye."))
    ... # doctest: +ELLIPSIS
    Loss scaling: 1 optimizer steps, 1 skipped (100.00%) for Inf/NaN gradients; final loss scale 4 ... Hello.
    Bye.
"""

from __future__ import annotations

from collections.abc import Iterable

from lossscale_callbacks._health import HealthMonitor
from lossscale_callbacks._metrics import MetricsTracker
from lossscale_callbacks._sinks import SinkGroup
from lossscale_callbacks.forensics._words import summarize
from lossscale_callbacks.loop._verdicts import Diagnosis

__all__ = ["run_summary"]


def run_summary(tracker: MetricsTracker, min_scale: float | None, sentences: Iterable[str],
                health: HealthMonitor | None, diagnosis: Diagnosis, out: SinkGroup, note: str = "") -> str:
    """The summary of the run ``tracker`` followed.

    Args:
        tracker: the run's tracker (its last snapshot; the minimum it judges by, for the advice).
        min_scale: the policy's minimum (``None`` without a policy).
        sentences: what the loop's rooms add to the first paragraph, in order, each with its leading space
            (or a leading newline: lines of their own, as the ledger's bad steps).
        health: the run's health rules (``LoggingLoop.health``; ``None``: off), for their assessment.
        diagnosis: the run's forensics, for their words and the precision advice (written to ``out`` too).
        out: where the advice is written (``loss_scale/advice``).
        note: a last line from the caller.
    """
    text = summarize(tracker.last, min_scale) + "".join(sentences)
    if health is not None:
        text += "\n" + health.assessment()
    findings = diagnosis.totals.findings().markdown()
    if findings:
        text += "\nForensics:\n" + findings
    advice = diagnosis.run_advice(tracker.last, tracker.min_scale, out)
    if advice is not None:
        text += "\nPrecision advice:\n" + advice
    if note:
        text += "\n" + note
    return text
