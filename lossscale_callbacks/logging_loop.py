"""The one logging loop: when an interval ends, the sinks, and each host read made metrics, verdicts, summary.

Every integration runs this same object. The Keras callback, the Lightning, Fabric, Accelerate and
Trainer monitors and a plain training loop only tell it their step count and hand it the state they
read from the device (the one host read of an interval); everything else is decided here, once: when
an interval ends (:meth:`LoggingLoop.due`), which sinks are open (those it opened from
``tensorboard=``/``wandb=`` and the caller's ``sinks=``), the metric schema, the restarts, how the
health rules act, which process writes and what the end-of-run summary says.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
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
from lossscale_callbacks.metrics import (
    ACTIVATIONS_TAG,
    ADVICE_TAG,
    ALIGNMENT_TAG,
    INTERVAL_METRICS,
    RESTART_TAG,
    SEGMENT,
    SUMMARY_TAG,
    MetricsTracker,
    Snapshot,
    counts_restarted,
    observed_state,
)
from lossscale_callbacks.owned_sinks import check_tensorboard, check_wandb, owned_sinks
from lossscale_callbacks.policy import check_policy
from lossscale_callbacks.ranks import is_rank_zero
from lossscale_callbacks.sinks import GuardedSink, Sink, SinkGroup, guarded_sinks
from lossscale_callbacks.summary import summarize

__all__ = ["LoggingLoop"]

_KEEP: Any = object()  # start(policy=...) not given: the policy stays


def _check_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be None or a callable, got {value!r}")


class LoggingLoop:
    """When an interval ends → read state → metrics → sinks → health rules → summary, alike everywhere.

    Call :meth:`maybe_observe` after each optimizer step with the step count and a function that
    reads the state (it runs only when :meth:`due` says an interval ended, so the device is read
    only then), or :meth:`observe` with a state you read yourself (a
    :class:`~lossscale_callbacks.state.LossScaleState` or a mapping of host numbers); call
    :meth:`finish` at the end of training.

    Sinks: ``tensorboard=`` and ``wandb=`` are sinks the loop *owns*: it opens them for each run
    (:meth:`start`) and closes them when the run ends (:meth:`finish`), so each run is its own W&B
    run; a run that never finished (a crash) has its owned sinks closed when the next starts.
    ``sinks=`` are the caller's: written and flushed, closed only by :meth:`close`. Every argument
    is checked here, and the extras ``tensorboard=``/``wandb=`` need are required here
    (:class:`~lossscale_callbacks.extras.MissingExtraError`), never in the middle of training.

    Restarts: when the steps read go backwards (an old checkpoint loaded, a new scaler), or the
    skips grow more than the steps (which no continuous run does), a new *segment* begins: every
    later metrics write carries ``loss_scale/segment`` (1, 2, ...; never written in a run without a
    restart), a ``loss_scale/restart`` text says from which step to which, the first read of the
    segment writes no interval metrics (its interval is not known), the health rules judge the new
    segment from scratch and the summary names the restarts. Nothing is written over silently.

    Rank rules, the same in every integration: only the writer process (global rank 0 by default)
    writes to the sinks and prints; the health rules run on every rank (each rank holds the same
    state), so ``"raise"`` raises and ``"stop"`` stops on every rank alike, while warnings are
    printed by the writer only.

    Args:
        policy: the loss-scale policy (its ``min_scale`` says what "at the minimum" means, its
            ``growth_interval`` when a scale that only decreases is a problem, and it is written
            to the sinks once); ``None`` for a scaler without one (a stock ``GradScaler``: 1.0
            counts as its minimum). :meth:`set_policy` changes it later (a restored checkpoint).
        log_every: an interval ends each time the step count passes a multiple of this (>= 1).
        every_seconds: ... or once this many seconds passed since the last read.
        tensorboard: a log directory: the loop writes a
            :class:`~lossscale_callbacks.tensorboard.TensorBoardSink` there.
        wandb: ``True`` (the active run, or a new one) or a dict of ``wandb.init`` arguments: the
            loop writes a :class:`~lossscale_callbacks.wandb.WandbSink`.
        sinks: more sinks (the caller's); each runs guarded (a failure warns once).
        health: ``None``/``False`` (off), ``True``/``"warn"``/``"raise"``/``"stop"`` (the default
            rules with that action) or rule objects.
        writer: whether this process writes to the sinks and prints (default: global rank 0,
            looked up when first needed).
        clock: the time source for ``every_seconds`` (``time.monotonic``; tests pass a fake one).
        stop: called when a ``"stop"`` rule fires (a trainer's ``should_stop``); the loop's own
            :attr:`should_stop` turns true then too, for a hand-written loop to break on.
        echo: prints the end-of-run summary on the writer (default ``print``; ``None`` is silent).

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, InMemorySink, initial_state, next_state
        >>> policy = DynamicPolicy(initial_scale=1024.0, growth_interval=4)
        >>> memory = InMemorySink()
        >>> loop = LoggingLoop(policy, sinks=[memory], log_every=5, echo=None)
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
        log_every: int | None = None,
        every_seconds: float | None = None,
        tensorboard: Any = None,
        wandb: Any = None,
        sinks: Iterable[Sink] = (),
        health: HealthSpec = "warn",
        writer: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop: Callable[[], None] | None = None,
        echo: Callable[[str], Any] | None = print,
    ) -> None:
        check_policy("policy", policy)
        self.log_every = None if log_every is None else check_int("log_every", log_every)
        self.every_seconds = (None if every_seconds is None else
                              check_number("every_seconds", every_seconds, 0.0, float("inf"), low_open=True))
        self._writer = None if writer is None else check_bool("writer", writer)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        _check_callable("stop", stop)
        _check_callable("echo", echo)
        HealthMonitor.from_spec(health)  # checked now, with the caller's argument name in the message
        self._user_sinks = guarded_sinks(sinks)
        self._tensorboard, self._wandb = check_tensorboard(tensorboard), check_wandb(wandb)
        # Made once here to check them and their extras; each run makes its own at its first write,
        # so an unstarted loop holds no file or run (a Trainer pickles its callbacks for ddp_spawn).
        owned_sinks(self._tensorboard, self._wandb)
        self._owned: list[Sink] | None = None
        self._health_spec = health
        self.clock = clock
        self.stop = stop
        self.echo = echo
        self._policy = policy
        self._run_sinks: list[GuardedSink] = []
        self._begin_run()

    # ------------------------------------------------------------------------------ runs

    def start(self, *, policy: Any = _KEEP, writer: bool | None = None, sinks: Iterable[Sink] = ()
              ) -> LoggingLoop:
        """Begin a run (a new loop has begun one already): call it for each later run, e.g. every ``fit``.

        Owned sinks a previous run left open (it raised before :meth:`finish`) are closed first; the
        run's first write makes fresh ones (on the writer only), so every run is its own W&B run and
        TensorBoard file. ``sinks`` join for this run only (a trainer's loggers): written and flushed, never
        closed by the loop. The tracker, the health rules, the forensics totals, the segments and
        the summary start over.

        Args:
            policy: the run's policy, when it became known only now (default: unchanged).
            writer: whether this process writes (default: unchanged).
            sinks: sinks for this run only.

        Returns:
            The loop itself.
        """
        run_sinks = guarded_sinks(sinks)
        if policy is not _KEEP:
            check_policy("policy", policy)
            self._policy = policy
        if writer is not None:
            self._writer = check_bool("writer", writer)
        self._close_owned()
        self._owned = None
        self._run_sinks = run_sinks
        self._begin_run()
        return self

    def _begin_run(self) -> None:
        self._group: SinkGroup | None = None
        self.summary: str | None = None
        self.forensics = ForensicsTotals()
        self._last_at: int | None = None  # the sinks' step of the last metrics write (or the baseline's)
        self.segment = 0
        self.restarts: list[tuple[int, int]] = []
        self._restart_text: str | None = None
        self._loss_verdict_given = False
        self._advice_verdicts: set[str] = set()  # the advice verdicts given in this run (once each)
        self.should_stop = False  # a "stop" rule fired in this run
        self._config_written = False
        self._mark = 0
        self._last_read_time = self.clock()
        self.tracker = MetricsTracker(1.0)
        self.health: HealthMonitor | None = None
        self._judge_by(self._policy)

    @property
    def sinks(self) -> SinkGroup:
        """The sinks of the current run: the owned ones (made at the run's first write, on the writer
        only), the caller's and the run's."""
        if self._group is None:
            if self._owned is None:
                self._owned = owned_sinks(self._tensorboard, self._wandb) if self.writer else []
            self._group = SinkGroup([*self._owned, *self._user_sinks, *self._run_sinks])
        return self._group

    def _close_owned(self) -> None:
        for sink in self._owned or ():
            sink.close()  # a ManagedSink: guarded, and a disabled one still releases its file or run
        self._owned = []  # closed for this run; start() lets the next run make new ones

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
        """Judge against ``policy`` from now on: a restored checkpoint brought its own.

        The tracker's minimum and the health rules' thresholds follow it (the snapshots and the
        problems found so far are kept), and the sinks get the policy again with the next metrics.
        """
        check_policy("policy", policy)
        if policy == self._policy:
            return
        self._policy = policy
        self._config_written = False
        self._judge_by(policy)

    def _judge_by(self, policy: Any) -> None:
        self.tracker.min_scale = MetricsTracker.for_policy(policy).min_scale if policy is not None else 1.0
        growth_interval = policy.constants.growth_interval if policy is not None and policy.dynamic else None
        fresh = HealthMonitor.from_spec(self._health_spec, growth_interval,
                                        dynamic=policy is None or policy.dynamic)
        if self.health is None or fresh is None:
            self.health = fresh
        else:
            self.health.replace_rules(fresh.rules)

    @property
    def last(self) -> Snapshot | None:
        """The latest snapshot."""
        return self.tracker.last

    @property
    def verdicts(self) -> list[Verdict]:
        """Every problem the health rules reported so far."""
        return list(self.health.verdicts) if self.health is not None else []

    # ---------------------------------------------------------------------------- intervals

    def due(self, step: int) -> bool:
        """Whether an interval ends at ``step``: the one rule of every integration.

        True when ``step`` passed a multiple of ``log_every`` since the previous call (crossing, not
        landing on it: a call may come several steps later), or when ``every_seconds`` passed since
        the last read and ``step`` moved. ``step`` is the integration's count: optimizer steps, or
        Keras' batch index in the epoch (see :meth:`restart_interval`). A count that went back
        without :meth:`restart_interval` starts again just before ``step``.
        """
        if type(step) is not int or step < -1:  # called every step: the full check only when needed
            step = check_int("step", step, -1, 2**63 - 1)
        previous, self._mark = self._mark, step
        if step < previous:
            previous = step - 1
        if step == previous:
            return False
        if self.log_every is not None and step // self.log_every > previous // self.log_every:
            return True
        return self.every_seconds is not None and self.clock() - self._last_read_time >= self.every_seconds

    def restart_interval(self, at: int) -> None:
        """The integration's count starts again at ``at``: the next multiple of ``log_every`` it passes
        ends an interval (Keras: ``-1`` at each epoch, so that batch 0 logs, as ``WandbMetricsLogger``
        does; a monitor: the trainer's step count when training starts or resumes)."""
        self._mark = check_int("at", at, -1, 2**63 - 1)

    def maybe_observe(self, step: int, read: Callable[[], Any], sink_step: int | None = None,
                      read_forensics: Callable[[], IntervalForensics | None] | None = None,
                      ) -> Snapshot | None:
        """:meth:`observe` ``read()`` if an interval ends at ``step``; ``read`` (the host read) runs only
        then, and so does ``read_forensics`` (the scaler's ``read_forensics`` with ``diagnose=True``)."""
        if not self.due(step):
            return None
        return self.observe(read(), sink_step=sink_step,
                            forensics=read_forensics() if read_forensics is not None else None)

    # ---------------------------------------------------------------------------- reading

    def baseline(self, state: Any) -> Snapshot:
        """Record a state without writing it: the start of a resumed run, so the first interval
        covers only its own steps (a baseline whose steps went back starts a new segment).

        Raises:
            ValueError: a field of ``state`` is missing or wrong, naming it.
        """
        state = observed_state(state)
        self._last_read_time = self.clock()
        self._restart_if_needed(state)
        if self._last_at is None:
            self._last_at = int(state.steps)
        return self.tracker.observe(state)

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
            ValueError: a field of ``state`` is missing or wrong (negative, fractional or NaN counts,
                ``skipped_steps > steps``), naming it; nothing is recorded then.
            LossScaleHealthError: a ``"raise"`` rule fired.
        """
        state = observed_state(state)
        self._last_read_time = self.clock()
        last = self.tracker.last
        restarted = self._restart_if_needed(state)
        if not restarted and last is not None and state.steps == last.step:
            if forensics is not None:
                self._add_forensics(forensics, last.step if sink_step is None else int(sink_step))
            return last
        snapshot = self.tracker.observe(state)
        at = snapshot.step if sink_step is None else int(sink_step)
        if self.writer:
            self._write_metrics(at, snapshot, forensics, interval_known=not restarted)
        if forensics is not None:
            self._add_forensics(forensics, at, metrics_written=True)
        if self.health is not None:
            verdicts = self.health.observe(snapshot)
            self._act(self._with_forensics(verdicts, forensics, snapshot.step))
        return snapshot

    def _restart_if_needed(self, state: Any) -> bool:
        """A new segment when ``state`` cannot follow the last read in one continuous run."""
        last = self.tracker.last
        if last is None or not counts_restarted(last.step, last.skipped_steps, state.steps,
                                                state.skipped_steps):
            return False
        self.segment += 1
        self.restarts.append((last.step, state.steps))
        self.tracker.reset()
        if self.health is not None:
            self.health.restart()
        self._restart_text = (
            f"Restart: the optimizer steps went from {last.step} ({last.skipped_steps} skipped) back to "
            f"{state.steps} ({state.skipped_steps} skipped): an older checkpoint was loaded or the scaler "
            f"was replaced. The metrics written from here on belong to segment {self.segment} "
            f"({SEGMENT}); the earlier ones are kept, not overwritten.")
        return True

    def _write_metrics(self, at: int, snapshot: Snapshot, forensics: IntervalForensics | None,
                       interval_known: bool) -> None:
        metrics = snapshot.metrics()
        if not interval_known:  # the first read of a segment: where its interval began is not known
            for name in INTERVAL_METRICS:
                metrics.pop(name)
        if self.segment:
            metrics[SEGMENT] = self.segment
        if forensics is not None:
            first, values = self.forensics.series(forensics)
            if first and self._last_at is not None and self._last_at < at:
                self.sinks.write(self._last_at, first)  # a layer series begins: a 0 one interval back
            metrics.update(values)
        self.sinks.write(at, metrics)
        self._last_at = at
        self._write_config_once()  # after the metrics: a text lands at their step
        self._write_restart_text()

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
        if forensics.activations is not None and forensics.activations.traced:
            self.sinks.write_text(ACTIVATIONS_TAG, forensics.activations.to_markdown())

    def _with_forensics(self, verdicts: list[Verdict], forensics: IntervalForensics | None,
                        step: int) -> list[Verdict]:
        """The rules' verdicts with the interval's diagnosis in plain words, and a non-finite loss's own."""
        if forensics is None:
            return verdicts
        words = forensics.findings()
        if words.origin:
            verdicts = [dataclasses.replace(v, message=f"{v.message} {words.origin}") for v in verdicts]
        if words.loss and not self._loss_verdict_given and self.health is not None:
            self._loss_verdict_given = True
            action = self.health.rules[0].action if self.health.rules else "warn"
            verdicts = [*verdicts, Verdict("NonFiniteLoss", action, step, words.loss)]
        return self._with_advice(verdicts, forensics, step)

    def _with_advice(self, verdicts: list[Verdict], forensics: IntervalForensics, step: int) -> list[Verdict]:
        """The advice (:mod:`lossscale_callbacks._advice`) added to a collapse verdict, and its own verdicts
        once a run: a layer named as the producer of a non-finite activation, recurring NaN gradients."""
        at_min = any(v.rule == "stuck_at_min_scale" for v in verdicts)
        advice = self.forensics.advice(at_min_scale=at_min, min_scale=self.tracker.min_scale)
        words = " ".join(advice.sentences())
        if at_min and words:
            verdicts = [dataclasses.replace(v, message=f"{v.message} {words}")
                        if v.rule == "stuck_at_min_scale" else v for v in verdicts]
        trace, given = forensics.activations, self._advice_verdicts
        new, action = [], self._advice_action()
        if trace is not None and trace.producer is not None and "ForwardOverflow" not in given:
            new.append(Verdict("ForwardOverflow", action, step, str(trace.producer_sentence())))
        if "recurring_nan" in advice.kinds and "RecurringNaN" not in given:
            new.append(Verdict("RecurringNaN", action, step, words))
        given.update(v.rule for v in new)
        if (new or at_min) and words and self.writer:
            self.sinks.write_text(ADVICE_TAG, advice.markdown())
        return [*verdicts, *new]

    def _advice_action(self) -> str:
        return self.health.rules[0].action if self.health is not None and self.health.rules else "warn"

    def _act(self, verdicts: list[Verdict]) -> None:
        if not verdicts:
            return
        if self.writer:
            self.sinks.alert_verdicts(verdicts)
        assert self.health is not None
        if self.health.apply(verdicts, stop=self.stop, warn=self.writer):
            self.should_stop = True

    def _write_restart_text(self) -> None:
        """The pending restart note, once (at the step of the metrics just written)."""
        if self._restart_text is not None:
            self.sinks.write_text(RESTART_TAG, self._restart_text)
            self._restart_text = None

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
        """End of the run: a last read (if given), the run-level verdicts, the summary everywhere.

        The summary (steps, skips, final scale, time at the minimum, the restarts, then the health
        assessment, which never calls a rule's check passed when the run was too short for it,
        then ``note``) is written to the sinks under ``loss_scale/summary``, flushed, printed by
        ``echo`` and returned, on the writer; other ranks only return it. The owned sinks are
        closed (the next :meth:`start` opens new ones); the caller's are flushed.
        """
        if state is not None:
            self.observe(state)
        if self.health is not None:
            self._act(self.health.final())
        text = self._summary_text(note)
        self.summary = text
        if self.writer:
            self._write_restart_text()  # a restart seen by a baseline, never followed by a read
            self.sinks.write_text(SUMMARY_TAG, text)
            self.sinks.flush()
            if self.echo is not None:
                self.echo(text)
        self._close_owned()
        return text

    def _summary_text(self, note: str) -> str:
        min_scale = self._policy.min_scale if self._policy is not None else None
        text = summarize(self.tracker.last, min_scale)
        if self.restarts:
            moves = ", ".join(f"from {before} back to {after}" for before, after in self.restarts)
            text += (f" The run restarted {len(self.restarts)} time(s) (optimizer steps {moves}); these "
                     f"numbers and the health assessment are those of its last segment.")
        if self.health is not None:
            text += "\n" + self.health.assessment()
        diagnosis = self.forensics.findings().markdown()
        if diagnosis:
            text += "\nForensics:\n" + diagnosis
        advice = self._run_advice()
        if advice is not None:
            text += "\nPrecision advice:\n" + advice
        if note:
            text += "\n" + note
        return text

    def _run_advice(self) -> str | None:
        """The run's advice in markdown, also written to the sinks (``loss_scale/advice``); ``None``: none."""
        last = self.tracker.last
        at_min = last is not None and (last.at_min_scale or last.total_steps_at_min_scale > 0)
        if last is not None and at_min and not self.forensics.skipped:
            at_min = False  # a scale that only started at its minimum skipped nothing: no collapse
        advice = self.forensics.advice(at_min_scale=at_min, min_scale=self.tracker.min_scale)
        if not advice.sentences():
            return None
        if self.writer:
            self.sinks.write_text(ADVICE_TAG, advice.markdown())
        return advice.markdown()

    def flush(self) -> None:
        if self.writer:
            self.sinks.flush()

    def close(self) -> None:
        """Close every sink: the owned ones and the caller's (releasing files and runs; a disabled sink
        is closed too). A loop that must leave the caller's sinks open ends its runs with :meth:`finish`."""
        self._close_owned()
        for sink in [*self._user_sinks, *self._run_sinks]:
            sink.close()
