"""The health rules of a run and what the forensics and the advice add to their verdicts.

:func:`judge_by` makes a run's health rules from the ``health=`` argument and the policy (a policy that
changes keeps the problems found so far). :class:`Diagnosis` keeps a run's forensics totals
(:mod:`lossscale_callbacks.forensics`): each interval's report, histogram and forward trace to the sinks,
its plain words added to the rules' verdicts, a verdict of its own for a non-finite loss, a forward
overflow and recurring NaN gradients (each once a run), the advice added to a collapse verdict, and the
run's advice for the summary. A verdict the forensics make acts as the first rule does (:func:`rules_action`).

Example:
    >>> from lossscale_callbacks._metrics import MetricsTracker
    >>> from lossscale_callbacks.forensics._gradients import IntervalForensics
    >>> from lossscale_callbacks._sinks import SinkGroup
    >>> health = judge_by(None, "raise", MetricsTracker(1.0), None)
    >>> rules_action(health), rules_action(None)
    ('raise', 'warn')
    >>> diagnosis = Diagnosis()
    >>> interval = IntervalForensics(step=10, scale=64.0, causes={"loss_nonfinite": 2})
    >>> [v.rule for v in diagnosis.verdicts([], interval, 10, health, 1.0, SinkGroup())]
    ['NonFiniteLoss']
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lossscale_callbacks._health import HealthMonitor, HealthSpec, Verdict
from lossscale_callbacks._metrics import ACTIVATIONS_TAG, ADVICE_TAG, MetricsTracker, Snapshot
from lossscale_callbacks._sinks import SinkGroup
from lossscale_callbacks.forensics._gradients import (
    FORENSICS_TAG,
    HISTOGRAM_EDGES,
    HISTOGRAM_TAG,
    ForensicsTotals,
    IntervalForensics,
)

__all__ = ["Diagnosis", "judge_by", "rules_action"]


def judge_by(policy: Any, spec: HealthSpec, tracker: MetricsTracker,
             health: HealthMonitor | None) -> HealthMonitor | None:
    """A run judged by ``policy`` from now on: ``tracker``'s minimum follows it, and the health rules of
    ``spec`` take its growth interval and whether it is dynamic; returns ``health`` (the run's monitor)
    with its rules replaced (its snapshots and verdicts kept), or a new one."""
    tracker.min_scale = MetricsTracker.for_policy(policy).min_scale if policy is not None else 1.0
    growth_interval = policy.constants.growth_interval if policy is not None and policy.dynamic else None
    fresh = HealthMonitor.from_spec(spec, growth_interval, dynamic=policy is None or policy.dynamic)
    if health is None or fresh is None:
        return fresh
    health.replace_rules(fresh.rules)
    return health


def rules_action(health: HealthMonitor | None) -> str:
    """The action of a verdict the forensics and the advice make: the first rule's (``"warn"`` without)."""
    return health.rules[0].action if health is not None and health.rules else "warn"


class Diagnosis:
    """A run's forensics and the verdicts they make (see the module)."""

    def __init__(self) -> None:
        self.totals = ForensicsTotals()
        self._loss_verdict_given = False
        self._given: set[str] = set()  # the advice verdicts given in this run (once each)

    def add(self, forensics: IntervalForensics, at: int, out: SinkGroup,
            metrics_written: bool = False) -> None:
        """One interval's forensics: into the totals, and its report, histogram and trace to ``out`` (its
        counts too, unless they went with the metrics)."""
        self.totals.add(forensics)
        if not metrics_written and forensics.skipped:
            out.write(at, forensics.metrics())
        if forensics.skipped or forensics.headroom:
            out.write_text(FORENSICS_TAG, forensics.to_markdown())
        if forensics.histogram is not None:
            out.write_histogram(at, HISTOGRAM_TAG, HISTOGRAM_EDGES, forensics.histogram)
        if forensics.activations is not None and forensics.activations.traced:
            out.write_text(ACTIVATIONS_TAG, forensics.activations.to_markdown())

    def metrics(self, forensics: IntervalForensics, metrics: dict[str, Any], last_at: int | None, at: int,
                out: SinkGroup) -> None:
        """The interval's forensics series into ``metrics`` (written at ``at``); a layer's series that
        begins gets a 0 one interval back (at ``last_at``), so a chart starts from nothing."""
        first, values = self.totals.series(forensics)
        if first and last_at is not None and last_at < at:
            out.write(last_at, first)
        metrics.update(values)

    def verdicts(self, verdicts: list[Verdict], forensics: IntervalForensics | None, step: int,
                 health: HealthMonitor | None, min_scale: float, out: SinkGroup) -> list[Verdict]:
        """The rules' ``verdicts`` with the interval's diagnosis in plain words, and the verdicts of the
        forensics and the advice (each once a run); the advice's text to ``out`` when it says something."""
        if forensics is None:
            return verdicts
        words = forensics.findings()
        if words.origin:
            verdicts = [dataclasses.replace(v, message=f"{v.message} {words.origin}") for v in verdicts]
        action = rules_action(health)
        if words.loss and not self._loss_verdict_given and health is not None:
            self._loss_verdict_given = True
            verdicts = [*verdicts, Verdict("NonFiniteLoss", action, step, words.loss)]
        at_min = any(v.rule == "stuck_at_min_scale" for v in verdicts)
        advice = self.totals.advice(at_min_scale=at_min, min_scale=min_scale)
        advice_words = " ".join(advice.sentences())
        if at_min and advice_words:
            verdicts = [dataclasses.replace(v, message=f"{v.message} {advice_words}")
                        if v.rule == "stuck_at_min_scale" else v for v in verdicts]
        trace, new = forensics.activations, []
        if trace is not None and trace.producer is not None and "ForwardOverflow" not in self._given:
            new.append(Verdict("ForwardOverflow", action, step, str(trace.producer_sentence())))
        if "recurring_nan" in advice.kinds and "RecurringNaN" not in self._given:
            new.append(Verdict("RecurringNaN", action, step, advice_words))
        self._given.update(v.rule for v in new)
        if (new or at_min) and advice_words:
            out.write_text(ADVICE_TAG, advice.markdown())
        return [*verdicts, *new]

    def run_advice(self, last: Snapshot | None, min_scale: float, out: SinkGroup) -> str | None:
        """The run's advice in markdown, also written to ``out`` (``loss_scale/advice``); ``None``: none."""
        at_min = last is not None and (last.at_min_scale or last.total_steps_at_min_scale > 0)
        if last is not None and at_min and not self.totals.skipped:
            at_min = False  # a scale that only started at its minimum skipped nothing: no collapse
        advice = self.totals.advice(at_min_scale=at_min, min_scale=min_scale)
        if not advice.sentences():
            return None
        out.write_text(ADVICE_TAG, advice.markdown())
        return advice.markdown()
