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
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict

from lossscale_callbacks._health import HealthMonitor, HealthSpec, Verdict
from lossscale_callbacks._metrics import (
    ACTIVATIONS_TAG,
    ADVICE_TAG,
    ALIGNMENT_TAG,
    INTERVAL_METRICS,
    RANKS_DISAGREE,
    RANKS_TAG,
    RESTART_TAG,
    SEGMENT,
    SUMMARY_TAG,
    MetricsTracker,
    Snapshot,
    counts_restarted,
    observed_state,
)
from lossscale_callbacks._policy import check_policy
from lossscale_callbacks._ranks import is_rank_zero
from lossscale_callbacks._sinks import (
    GuardedSink,
    Sink,
    SinkGroup,
    check_tensorboard,
    check_wandb,
    guarded_sinks,
    named_sinks,
    owned_sinks,
)
from lossscale_callbacks._stacklevel import user_stacklevel
from lossscale_callbacks._validation import INT64_MAX, check_bool, check_int, check_number
from lossscale_callbacks.forensics._gradients import (
    FORENSICS_TAG,
    HISTOGRAM_EDGES,
    HISTOGRAM_TAG,
    ForensicsTotals,
    IntervalForensics,
)
from lossscale_callbacks.forensics._words import summarize
from lossscale_callbacks.loop._rank_agreement import RankStates, split_health

__all__ = ["LoggingLoop", "check_log_every"]

_KEEP: Any = object()  # start(policy=...) not given: the policy stays


def check_log_every(log_every: Any, *, optional: bool = True) -> int | None:
    """``log_every`` checked, the one rule of every integration: an integer >= 1, or ``None`` where
    ``optional`` (an integration with another interval rule: a trainer's own, or ``every_seconds``).

    Raises:
        ValueError: ``log_every`` is not an integer >= 1 (or ``None`` where allowed), naming it.

    Example:
        >>> check_log_every(100), check_log_every(None)
        (100, None)
    """
    if log_every is None and optional:
        return None
    return check_int("log_every", log_every)
class LoggingArgs(TypedDict, total=False):
    """The logging arguments: declared here once, taken by every integration as ``**logging`` and handed
    to its :class:`LoggingLoop` unchanged, which checks them (see its Args)."""

    tensorboard: str | os.PathLike[str] | None
    wandb: bool | Mapping[str, Any] | None
    sinks: Iterable[Sink] | Mapping[str, Any]
    health: HealthSpec
    echo: Callable[[str], Any] | None


def logging_args(owner: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """An integration's ``**logging``, refused as Python refuses an unknown keyword when a name in it is
    not one of :class:`LoggingArgs`.

    Raises:
        TypeError: naming the unknown keyword and the logging arguments.
    """
    unknown = sorted(set(given) - set(LoggingArgs.__annotations__))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r} (its logging "
                        f"arguments are {sorted(LoggingArgs.__annotations__)})")
    return dict(given)


def _check_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be None or a callable, got {value!r}")


class LoggingLoop:
    """When an interval ends → read state → metrics → sinks → health rules → summary, alike everywhere.

    Call :meth:`maybe_observe` after each optimizer step with the step count and a function that
    reads the state (it runs only when :meth:`due` says an interval ended, so the device is read
    only then), or :meth:`observe` with a state you read yourself (a
    :class:`~lossscale_callbacks._state.LossScaleState` or a mapping of host numbers); call
    :meth:`finish` at the end of training. How runs, restarts and ranks are handled is on the
    "Dashboards" page of the documentation.

    The arguments below from ``log_every`` to ``echo`` are the shared logging arguments: every
    integration (the Keras callback, the Lightning, Fabric and Accelerate monitors, the Trainer
    callback) takes them with this meaning and hands them to its loop. A state that carries every
    rank's (a ``RankedState``, as torch's ``ScalerReader.read`` gathers under ``torch.distributed``)
    is also compared across the ranks: ``loss_scale/ranks_disagree``, the ``ranks_disagree`` rule and
    a sentence in the summary.

    Args:
        policy: the loss-scale policy (its ``min_scale`` says what "at the minimum" means, its
            ``growth_interval`` when a scale that only decreases is a problem, and it is written
            to the sinks once); ``None`` for a scaler without one (a stock ``GradScaler``: 1.0
            counts as its minimum). :meth:`set_policy` changes it later (a restored checkpoint).
        log_every: an interval ends each time the step count passes a multiple of this (>= 1).
        every_seconds: ... or once this many seconds passed since the last read.
        tensorboard: a log directory: the loop opens a
            :class:`~lossscale_callbacks.tensorboard.TensorBoardSink` there at each run's start and
            closes it at its end (it *owns* it; a crashed run's is closed when the next starts).
        wandb: ``True`` (the active run, or a new one) or a dict of ``wandb.init`` arguments: the
            loop owns a :class:`~lossscale_callbacks.wandb.WandbSink` the same way (one W&B run per run).
        sinks: more sinks, the caller's: written and flushed, closed only by :meth:`close`; each runs
            guarded (a failure warns once and disables it; training goes on).
        health: ``None``/``False`` (off), ``True``/``"warn"``/``"raise"``/``"stop"`` (the default
            rules with that action) or rule objects.
        writer: whether this process writes to the sinks and prints (default: global rank 0,
            looked up when first needed; health rules run on every rank).
        clock: the time source for ``every_seconds`` (``time.monotonic``; tests pass a fake one).
        stop: called when a ``"stop"`` rule fires (a trainer's ``should_stop``); the loop's own
            :attr:`should_stop` turns true then too, for a hand-written loop to break on.
        echo: prints the end-of-run summary on the writer (default ``print``; ``None`` is silent).

    Raises:
        ValueError: an argument is invalid; the message names it.
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra (an ``ImportError`` naming
            the ``pip install`` command), raised here, never in the middle of training.

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
        sinks: Iterable[Sink] | Mapping[str, Any] = (),
        health: HealthSpec = "warn",
        writer: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        stop: Callable[[], None] | None = None,
        echo: Callable[[str], Any] | None = print,
    ) -> None:
        check_policy("policy", policy)
        self.log_every = check_log_every(log_every)
        self.every_seconds = (None if every_seconds is None else
                              check_number("every_seconds", every_seconds, 0.0, float("inf"), low_open=True))
        self._writer = None if writer is None else check_bool("writer", writer)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        _check_callable("stop", stop)
        _check_callable("echo", echo)
        # The rank-agreement rule is judged on the gathered ranks, not on one rank's snapshots.
        health, self._ranks_rule = split_health(health)
        HealthMonitor.from_spec(health)  # checked now, with the caller's argument name in the message
        self._user_sinks, self._named = named_sinks(sinks)
        self._tensorboard, self._wandb = check_tensorboard(tensorboard), check_wandb(wandb)
        # Made once here to check them and their extras; each run makes its own at its first write,
        # so an unstarted loop holds no file or run (a Trainer pickles its callbacks for ddp_spawn).
        owned_sinks(self._tensorboard, self._wandb, self._named)
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
        self._highest_at: int | None = None  # the highest sinks' step a metrics write used in this run
        self._sink_offset = 0  # added to the steps of the current segment (see _sink_step)
        self._segment_from: int | None = None  # a segment began: the step it starts after, if known
        self._repeat_warned = False
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
        self._ranks_differ = False  # inside a stretch of reads where the ranks disagree
        self.rank_reads = 0  # reads that gathered every rank's state (none with one process)
        self.rank_disagreements: list[tuple[int, str]] = []  # (step, the ranks' states in words)
        self._ranks_differing: int | None = None  # at the last gathered read
        self._judge_by(self._policy)

    @property
    def sinks(self) -> SinkGroup:
        """The sinks of the current run: the owned ones (made at the run's first write, on the writer
        only), the caller's and the run's."""
        if self._group is None:
            if self._owned is None:
                self._owned = owned_sinks(self._tensorboard, self._wandb, self._named) if self.writer else []
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
            step = check_int("step", step, -1, INT64_MAX)
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
        self._mark = check_int("at", at, -1, INT64_MAX)

    def resume_at(self, at: int, read: Callable[[], Any] | None = None) -> None:
        """Start or resume counting at step ``at`` (the one place a run begins at step N): the next
        multiple of ``log_every`` past ``at`` ends an interval, and when ``read`` is given and ``at`` is
        past the start (a resumed run, or Keras' first epoch), one read now (not a step) becomes the
        baseline, so that the first interval covers only its own steps.

        Raises:
            ValueError: ``at`` is not an integer >= -1, or the state read is wrong (naming the field).
        """
        self.restart_interval(at)
        if read is not None:
            self.baseline(read())

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
        ranks = getattr(state, "ranks", None)
        state = observed_state(state)
        self._last_read_time = self.clock()
        if self._repeated(state):
            return self.tracker.last
        if self._restart_if_needed(state):
            self._segment_from = int(state.steps)  # the segment's steps count from here
        if self._last_at is None:
            self._last_at = int(state.steps)
        snapshot = self.tracker.observe(state)
        self._act(self._judge_ranks(ranks, snapshot.step))  # a rank resumed from another checkpoint
        return snapshot

    def observe(self, state: Any, sink_step: int | None = None,
                forensics: IntervalForensics | None = None) -> Snapshot:
        """One host read of the state: a new snapshot goes to the sinks and through the health rules.

        A read at the step of the previous one (a second read at train end) adds nothing and
        writes nothing, whatever its counts: one step is one record (a read at that step with other
        counts cannot be placed, and is ignored with one ``RuntimeWarning`` a run). ``sink_step``
        is the step the sinks write the metrics at (default: the snapshot's, the optimizer steps
        attempted); Lightning passes its own logging step so its loggers line the rows up with the
        rest of the run. After a restart, the segment's sink steps are shifted past the highest
        already written (see the class).

        ``forensics`` (what a ``diagnose=True`` scaler accumulated over the interval) adds the skip
        causes to the metrics, a report (``loss_scale/forensics``) and a gradient histogram to the
        sinks when the interval skipped steps or sampled the headroom, and its plain words to the
        health verdicts; a non-finite loss is a verdict of its own (``NonFiniteLoss``, once a run).

        Raises:
            ValueError: a field of ``state`` is missing or wrong (negative, fractional or NaN counts,
                ``skipped_steps > steps``), naming it; nothing is recorded then.
            LossScaleHealthError: a ``"raise"`` rule fired.
        """
        ranks = getattr(state, "ranks", None)  # a RankedState: every rank's, gathered at this read
        state = observed_state(state)
        self._last_read_time = self.clock()
        last = self.tracker.last
        if last is not None and self._repeated(state):
            if forensics is not None:
                self._add_forensics(forensics, self._sink_offset + (last.step if sink_step is None
                                                                    else int(sink_step)))
            return last
        restarted = self._restart_if_needed(state)
        snapshot = self.tracker.observe(state)
        at = self._sink_step(snapshot.step if sink_step is None else int(sink_step))
        if self.writer:
            self._write_metrics(at, snapshot, forensics, interval_known=not restarted, ranks=ranks)
        if forensics is not None:
            self._add_forensics(forensics, at, metrics_written=True)
        verdicts: list[Verdict] = []
        if self.health is not None:  # health=None: no rule, so no verdict of the forensics either
            verdicts = self._with_forensics(self.health.observe(snapshot), forensics, snapshot.step)
        self._act(verdicts + self._judge_ranks(ranks, snapshot.step))
        return snapshot

    def _repeated(self, state: Any) -> bool:
        """Whether ``state`` is at the step of the last read (nothing to record); other counts there warn."""
        last = self.tracker.last
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

    def _sink_step(self, step: int) -> int:
        """The sinks' step for ``step``: the first write of a new segment that would land on or before
        the highest step written shifts the segment past it (after the step it began from when known)."""
        at = step + self._sink_offset
        if self._segment_from is not None:
            if self._highest_at is not None and at <= self._highest_at:
                begins = self._segment_from + self._sink_offset if self._segment_from < step else at - 1
                self._sink_offset += self._highest_at - min(begins, at - 1)
                at = step + self._sink_offset
            self._segment_from = None
        return at
    def _judge_ranks(self, ranks: RankStates | None, step: int) -> list[Verdict]:
        """The rank-agreement verdict of one gathered read: once per stretch of disagreement."""
        if ranks is None:
            return []
        self.rank_reads += 1
        self._ranks_differing = len(ranks.differing())
        differ = bool(self._ranks_differing)
        began, self._ranks_differ = differ and not self._ranks_differ, differ
        if not began:
            return []
        self.rank_disagreements.append((step, ranks.describe()))
        verdict = self._ranks_rule.judge(ranks, step) if self._ranks_rule is not None else None
        if self.writer:
            words = verdict.message if verdict else f"Step {step}: {ranks.describe()}"
            self.sinks.write_text(RANKS_TAG, words)
        if verdict is None or self.health is None:
            return []
        self.health.verdicts.append(verdict)
        return [verdict]

    def _restart_if_needed(self, state: Any) -> bool:
        """A new segment when ``state`` cannot follow the last read in one continuous run."""
        last = self.tracker.last
        if last is None or not counts_restarted(last.step, last.skipped_steps, state.steps,
                                                state.skipped_steps):
            return False
        self.segment += 1
        self._segment_from = int(state.steps) - 1  # a read's own step is its segment's first known one
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
                       interval_known: bool, ranks: RankStates | None = None) -> None:
        metrics = snapshot.metrics()
        if ranks is not None:
            metrics[RANKS_DISAGREE] = len(ranks.differing())
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
        self._highest_at = at if self._highest_at is None else max(self._highest_at, at)
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
        """The advice (:mod:`lossscale_callbacks.forensics._advice`) added to a collapse verdict, and its own
        verdicts once a run: a layer named as the producer of a non-finite activation, recurring NaN
        gradients."""
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
        if self.rank_reads:
            text += " " + self._ranks_sentence()
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

    def rank_metrics(self) -> dict[str, int]:
        """``{"loss_scale/ranks_disagree": n}`` of the last read that gathered every rank's state, else ``{}``
        (one process): for a trainer's own metrics (Lightning's ``callback_metrics``, the Trainer's logs)."""
        return {} if self._ranks_differing is None else {RANKS_DISAGREE: self._ranks_differing}

    def _ranks_sentence(self) -> str:
        if not self.rank_disagreements:
            return (f"The ranks' loss-scale states were compared at {self.rank_reads} read(s) and "
                    "always agreed.")
        step, words = self.rank_disagreements[0]
        return (f"The ranks' loss-scale states disagreed {len(self.rank_disagreements)} time(s) in "
                f"{self.rank_reads} compared read(s), first at step {step} ({words}).")
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
