"""The one logging loop: a host read of the state, turned into metrics, sinks, health rules and a summary.

Every integration runs this same object. The Keras callback, the Lightning monitor and a plain
training loop only say *when* an interval ends and hand over the state they read from the device
(the one host read of the interval); everything after that, the metric schema, what the sinks
receive, how the health rules act, which process writes and what the end-of-run summary says, is
decided here, once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lossscale_callbacks._validation import check_bool, check_int, check_number
from lossscale_callbacks.forensics import (
    FORENSICS_TAG,
    HISTOGRAM_EDGES,
    HISTOGRAM_TAG,
    ForensicsTotals,
    IntervalForensics,
)
from lossscale_callbacks.health import HealthMonitor, HealthSpec, Verdict
from lossscale_callbacks.metrics import ALIGNMENT_TAG, SUMMARY_TAG, MetricsTracker, Snapshot
from lossscale_callbacks.policy import check_policy
from lossscale_callbacks.ranks import is_rank_zero
from lossscale_callbacks.sinks import Sink, SinkGroup
from lossscale_callbacks.summary import summarize

__all__ = ["LoggingLoop"]


class LoggingLoop:
    """Read state → metrics → sinks → health rules → summary, the same way for every framework.

    Call :meth:`observe` with the state you read at the end of a log interval (a
    :class:`~lossscale_callbacks.state.LossScaleState` or a mapping of host numbers); call
    :meth:`finish` at the end of training. :meth:`due` and :meth:`maybe_observe` decide the
    interval for loops that have no trigger of their own (every ``every_steps`` optimizer steps
    and/or every ``every_seconds`` seconds by ``clock``), so the device is read only then.

    Rank rules, the same in every integration: only the writer process (global rank 0 by default)
    writes to the sinks and prints; the health rules run on every rank (each rank holds the same
    state), so ``"raise"`` raises and ``"stop"`` stops on every rank alike, while warnings are
    printed by the writer only.

    Args:
        policy: the loss-scale policy (its ``min_scale`` says what "at the minimum" means, its
            ``growth_interval`` when a scale that only decreases is a problem, and it is written
            to the sinks once); ``None`` for a scaler without one (a stock ``GradScaler``: 1.0
            counts as its minimum). :meth:`set_policy` changes it later (a restored checkpoint).
        sinks: where metrics and reports go; each runs guarded (a failure warns once).
        health: ``None``/``False`` (off), ``True``/``"warn"``/``"raise"``/``"stop"`` (the default
            rules with that action) or rule objects.
        writer: whether this process writes to the sinks and prints (default: global rank 0).
        every_steps: :meth:`due` is true once the step count crosses a multiple of this.
        every_seconds: :meth:`due` is true once this many seconds passed since the last read.
        clock: the time source for ``every_seconds`` (``time.monotonic``; tests pass a fake one).
        stop: called when a ``"stop"`` rule fires (a trainer's ``should_stop``).
        echo: prints the end-of-run summary on the writer (default ``print``; ``None`` is silent).

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, InMemorySink, initial_state, next_state
        >>> policy = DynamicPolicy(initial_scale=1024.0, growth_interval=4)
        >>> memory = InMemorySink()
        >>> loop = LoggingLoop(policy, sinks=[memory], every_steps=5, echo=None)
        >>> state = initial_state(policy)
        >>> for step in range(1, 11):
        ...     state = next_state(policy, state, finite=step != 3)
        ...     _ = loop.maybe_observe(int(state.steps), lambda: state)  # reads only every 5 steps
        >>> memory.series("loss_scale/scale")
        [(5, 512.0), (10, 1024.0)]
        >>> print(loop.finish(state).splitlines()[0])  # doctest: +ELLIPSIS
        Loss scaling: 10 optimizer steps, 1 skipped (10.00%) for Inf/NaN gradients; final loss scale 1024 ...
    """

    def __init__(
        self,
        policy: Any = None,
        *,
        sinks: Iterable[Sink] = (),
        health: HealthSpec = "warn",
        writer: bool | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop: Callable[[], None] | None = None,
        echo: Callable[[str], Any] | None = print,
    ) -> None:
        check_policy("policy", policy)
        if every_steps is not None:
            check_int("every_steps", every_steps)
        if every_seconds is not None:
            check_number("every_seconds", every_seconds, 0.0, float("inf"), low_open=True)
        if writer is not None:
            check_bool("writer", writer)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self._health_spec = health
        HealthMonitor.from_spec(health)  # validate now, with the caller's argument name in the message
        self.sinks = sinks if isinstance(sinks, SinkGroup) else SinkGroup(sinks)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.clock = clock
        self.stop = stop
        self.echo = echo
        self._writer = writer
        self.summary: str | None = None
        self.forensics = ForensicsTotals()
        self._loss_verdict_given = False
        self._config_written = False
        self._policy: Any = None
        self.set_policy(policy)

    # ------------------------------------------------------------------------------ setup

    @property
    def writer(self) -> bool:
        """Whether this process writes to the sinks and prints (looked up when first needed)."""
        if self._writer is None:
            self._writer = is_rank_zero()
        return self._writer

    @property
    def policy(self) -> Any:
        return self._policy

    def set_policy(self, policy: Any) -> None:
        """Use ``policy`` from now on (rebuilds the tracker and the rules; keeps the sinks).

        Call it before the first :meth:`observe` of a run whose policy became known late (a
        checkpoint restored after the loop was made). Starts a new run of snapshots.
        """
        check_policy("policy", policy)
        self._policy = policy
        self.tracker = MetricsTracker.for_policy(policy) if policy is not None else MetricsTracker(1.0)
        growth_interval = policy.constants.growth_interval if policy is not None and policy.dynamic else None
        self.health = HealthMonitor.from_spec(self._health_spec, growth_interval,
                                              dynamic=policy is None or policy.dynamic)
        self._last_read_time: float | None = self.clock()

    @property
    def last(self) -> Snapshot | None:
        """The latest snapshot."""
        return self.tracker.last

    @property
    def verdicts(self) -> list[Verdict]:
        """Every problem the health rules reported so far."""
        return list(self.health.verdicts) if self.health is not None else []

    # ---------------------------------------------------------------------------- reading

    def baseline(self, state: Any) -> Snapshot:
        """Record a state without writing it: the start of a resumed run, so the first interval
        covers only its own steps."""
        self._last_read_time = self.clock()
        return self.tracker.observe(state)

    def due(self, step: int) -> bool:
        """Whether an interval ends at optimizer step ``step`` (by ``every_steps``/``every_seconds``)."""
        last = self.tracker.last
        last_step = last.step if last is not None else 0
        if step <= last_step:
            return False
        if self.every_steps is not None and step // self.every_steps > last_step // self.every_steps:
            return True
        if self.every_seconds is not None:
            if self._last_read_time is None:
                self._last_read_time = self.clock()
            return self.clock() - self._last_read_time >= self.every_seconds
        return False

    def maybe_observe(self, step: int, read: Callable[[], Any], sink_step: int | None = None,
                      read_forensics: Callable[[], IntervalForensics | None] | None = None,
                      ) -> Snapshot | None:
        """:meth:`observe` ``read()`` if an interval ends at ``step``; ``read`` (the host read) runs only
        then, and so does ``read_forensics`` (the scaler's ``read_forensics`` with ``diagnose=True``)."""
        if not self.due(step):
            return None
        return self.observe(read(), sink_step=sink_step,
                            forensics=read_forensics() if read_forensics is not None else None)

    def observe(self, state: Any, sink_step: int | None = None,
                forensics: IntervalForensics | None = None) -> Snapshot:
        """One host read of the state: a new snapshot goes to the sinks and through the health rules.

        A read at the step of the previous one (a second read at train end) adds nothing and
        writes nothing. ``sink_step`` is the step the sinks write the metrics at (default: the
        snapshot's, the optimizer steps attempted); Lightning passes its own logging step so its
        loggers line the rows up with the rest of the run.

        ``forensics`` (what a ``diagnose=True`` scaler accumulated over the interval) adds the skip
        causes to the metrics, a report (``loss_scale/forensics``) and a gradient histogram to the
        sinks when the interval skipped steps or sampled the headroom, and its plain words to the
        health verdicts; a non-finite loss is a verdict of its own (``NonFiniteLoss``, once a run).

        Raises:
            LossScaleHealthError: a ``"raise"`` rule fired.
        """
        self._last_read_time = self.clock()
        last = self.tracker.last
        step = int(state["steps"] if isinstance(state, Mapping) else state.steps)
        if last is not None and step == last.step:
            if forensics is not None:
                self._add_forensics(forensics, last.step if sink_step is None else int(sink_step))
            return last
        snapshot = self.tracker.observe(state)
        at = snapshot.step if sink_step is None else int(sink_step)
        if self.writer:
            metrics = snapshot.metrics()
            if forensics is not None:
                metrics.update(forensics.metrics())
            self.sinks.write(at, metrics)
            self._write_config_once()  # after the first metrics: a text lands at their step
        if forensics is not None:
            self._add_forensics(forensics, at, metrics_written=True)
        if self.health is not None:
            verdicts = self.health.observe(snapshot)
            self._act(self._with_forensics(verdicts, forensics, snapshot.step))
        return snapshot

    def _add_forensics(self, forensics: IntervalForensics, at: int, metrics_written: bool = False) -> None:
        self.forensics.add(forensics)
        if not self.writer:
            return
        if not metrics_written and forensics.skipped:
            self.sinks.write(at, forensics.metrics())
        if forensics.skipped or forensics.headroom:
            self.sinks.write_text(FORENSICS_TAG, forensics.to_markdown())
        if forensics.histogram is not None:
            self.sinks.write_histogram(at, HISTOGRAM_TAG, HISTOGRAM_EDGES, forensics.histogram)

    def _with_forensics(self, verdicts: list[Verdict], forensics: IntervalForensics | None,
                        step: int) -> list[Verdict]:
        """The rules' verdicts with the interval's diagnosis in plain words, and a non-finite loss's own."""
        if forensics is None:
            return verdicts
        words = forensics.sentences()
        layer_words = [s for s in words if s.startswith("Layer ")]
        if layer_words:
            verdicts = [dataclasses.replace(v, message=f"{v.message} {layer_words[0]}") for v in verdicts]
        loss_bad = bool(forensics.causes.get("loss_nonfinite"))
        if loss_bad and not self._loss_verdict_given and self.health is not None:
            self._loss_verdict_given = True
            action = self.health.rules[0].action if self.health.rules else "warn"
            verdicts = [*verdicts, Verdict("NonFiniteLoss", action, step, words[0])]
        return verdicts

    def _act(self, verdicts: list[Verdict]) -> None:
        if not verdicts:
            return
        if self.writer:
            self.sinks.alert_verdicts(verdicts)
        assert self.health is not None
        self.health.apply(verdicts, stop=self.stop, warn=self.writer)

    def _write_config_once(self) -> None:
        if self._config_written or self._policy is None:
            return
        self._config_written = True
        self.sinks.write_config(self._policy.to_config())

    # ----------------------------------------------------------------------------- reports

    def write_text(self, tag: str, markdown: str) -> None:
        """A markdown report to every sink (TensorBoard's Text tab, a W&B Table), from the writer only."""
        if self.writer:
            self.sinks.write_text(tag, markdown)

    def report_alignment(self, markdown: str) -> None:
        """The Tensor Core alignment report: printed and written to the sinks, by the writer."""
        if self.writer:
            if self.echo is not None:
                self.echo(markdown)
            self.sinks.write_text(ALIGNMENT_TAG, markdown)

    def finish(self, state: Any = None, note: str = "") -> str:
        """End of training: a last read (if given), the run-level verdicts, the summary everywhere.

        The summary (steps, skips, final scale, time at the minimum, then the health assessment,
        which never calls a rule's check passed when the run was too short for it, then ``note``)
        is written to the sinks under ``loss_scale/summary``, flushed, printed by ``echo`` and
        returned, on the writer; other ranks only return it.
        """
        if state is not None:
            self.observe(state)
        if self.health is not None:
            self._act(self.health.final())
        min_scale = self._policy.min_scale if self._policy is not None else None
        text = summarize(self.tracker.last, min_scale)
        if self.health is not None:
            text += "\n" + self.health.assessment()
        diagnosis = self.forensics.sentences()
        if diagnosis:
            text += "\nForensics: " + " ".join(diagnosis)
        if note:
            text += "\n" + note
        self.summary = text
        if self.writer:
            self.sinks.write_text(SUMMARY_TAG, text)
            self.sinks.flush()
            if self.echo is not None:
                self.echo(text)
        return text

    def flush(self) -> None:
        if self.writer:
            self.sinks.flush()

    def close(self) -> None:
        """Close the sinks (releasing files and runs; a disabled sink is closed too)."""
        self.sinks.close()
