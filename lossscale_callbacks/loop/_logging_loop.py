"""The one logging loop: when an interval ends, the sinks, and each host read made metrics, verdicts, summary.

Every integration runs this same object. The Keras callback, the Lightning, Fabric, Accelerate and
Trainer monitors and a plain training loop only tell it their step count and hand it the state they
read from the device (the one host read of an interval); everything else is decided here, once: when
an interval ends, which sinks are open, the metric schema, the restarts, how the health rules act,
which process writes and what the end-of-run summary says.

:class:`LoggingLoop` orchestrates; each of its jobs lives in a room of its own in this folder, made
fresh for each run (:meth:`LoggingLoop.start`) and tested alone:

* ``_clock``: when an interval ends (``due``, ``restart_interval``, ``resume_at``);
* ``_run_sinks``: which sinks are open, who owns them, which process writes (``out``);
* ``_segments``: repeated reads, restarts, segments and the sinks' step offsets;
* ``_rank_agreement``: every rank's state compared at a read;
* ``_verdicts``: the health rules of a policy, the forensics' and the advice's verdicts;
* ``_skip_truth``: each step's outcome as metrics, the not-held check, its sentence;
* ``_ledger``: the ledger of bad steps a read carries, its lines in the summary, its file closed;
* ``_fp8``: the fp8 scales of a run, read by an fp8 monitor (its metrics, rebuilt steps and findings);
* ``_summary``: the end-of-run text.

Where a new job plugs in (as the skip truth and the ledger of bad steps did; fp8 scale health): a room
here, made in ``_begin_run``; what it needs of a read comes with the state (``carry``: the outcomes, the
followers' counts, the ledger) and is taken before the state is checked; in :meth:`LoggingLoop.observe` its
metrics join the read's ``metrics`` before the one write, its verdicts join those handed to ``_act``
(warned, raised or stopped on, and alerted to the sinks), and what it writes besides goes to
``self._sinks.out`` (the writer's sinks, nothing on other ranks); its sentence for the summary joins the
``sentences`` that :meth:`LoggingLoop.finish` hands to :func:`~lossscale_callbacks.loop._summary.run_summary`,
and a file of its own is closed in :meth:`LoggingLoop.close`. Its metric names go to
:mod:`lossscale_callbacks._metrics`, its rules to :mod:`lossscale_callbacks._health` (or a room of their
own), its words beside the forensics'.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict

from lossscale_callbacks._health import HealthMonitor, HealthSpec, Verdict
from lossscale_callbacks._metrics import ALIGNMENT_TAG, SUMMARY_TAG, MetricsTracker, Snapshot, observed_state
from lossscale_callbacks._policy import check_policy
from lossscale_callbacks._sinks import Sink, guarded_sinks
from lossscale_callbacks.forensics._gradients import IntervalForensics
from lossscale_callbacks.fp8._reads import Fp8Read
from lossscale_callbacks.fp8._rules import split_fp8_health
from lossscale_callbacks.loop._clock import IntervalClock
from lossscale_callbacks.loop._fp8 import Fp8Scales
from lossscale_callbacks.loop._ledger import LedgerRoom
from lossscale_callbacks.loop._rank_agreement import RankAgreement, split_health
from lossscale_callbacks.loop._run_sinks import RunSinks
from lossscale_callbacks.loop._segments import Segments
from lossscale_callbacks.loop._skip_truth import SkipTruth
from lossscale_callbacks.loop._summary import run_summary
from lossscale_callbacks.loop._verdicts import Diagnosis, judge_by
from lossscale_callbacks.skips._followers import split_not_held

__all__ = ["LoggingArgs", "LoggingLoop", "logging_args"]

_KEEP: Any = object()  # start(policy=...) not given: the policy stays


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


def _held_by_a_room(path: str, doc: str) -> Any:
    """A read-only attribute of the loop that one of its rooms holds (``path``: ``"_room.name"``)."""
    return property(operator.attrgetter(path), doc=doc)


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

    log_every = _held_by_a_room("_interval.log_every", "Steps of the integration's count per interval.")
    every_seconds = _held_by_a_room("_interval.every_seconds", "Seconds between reads, or ``None``.")
    clock = _held_by_a_room("_interval.clock", "The time source of ``every_seconds``.")
    sinks = _held_by_a_room("_sinks.group", "The sinks of the current run: the owned ones (made at the "
                            "run's first write, on the writer only), the caller's and the run's.")
    writer = _held_by_a_room("_sinks.writer", "Whether this process writes to the sinks and prints "
                             "(looked up when first needed).")
    _named = _held_by_a_room("_sinks.named", "The registered sinks the loop opens, ``{name: value}``.")
    policy = _held_by_a_room("_policy", "The policy the run is judged by (see :meth:`set_policy`).")
    last = _held_by_a_room("tracker.last", "The latest snapshot.")
    forensics = _held_by_a_room("_diagnosis.totals", "The run's forensics totals.")
    segment = _held_by_a_room("_segments.number", "The current segment (0: the run never restarted).")
    restarts = _held_by_a_room("_segments.restarts", "The run's restarts: (the step before, the step after).")
    rank_reads = _held_by_a_room("_ranks.reads", "Reads that gathered every rank's state (0: one process).")
    rank_disagreements = _held_by_a_room("_ranks.disagreements",
                                         "Where the ranks began to disagree: (step, their states in words).")

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
        self._interval = IntervalClock(log_every, every_seconds, clock)
        _check_callable("stop", stop)
        _check_callable("echo", echo)
        # The rank-agreement rule is judged on the gathered ranks, not on one rank's snapshots; the fp8
        # rules on the fp8 reads.
        health, self._ranks_rule = split_health(health)
        health, self._not_held = split_not_held(health)  # judged on the followers' counts
        health, self._fp8_rules = split_fp8_health(health)
        HealthMonitor.from_spec(health)  # checked now, with the caller's argument name in the message
        self._sinks = RunSinks(tensorboard, wandb, sinks, writer)
        self._health_spec = health
        self.stop = stop
        self.echo = echo
        self._policy = policy
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
            self._sinks.writer = writer
        self._begin_run(run_sinks)
        return self

    def _begin_run(self, run_sinks: list[Any] | None = None) -> None:
        """Every room afresh for a run (``run_sinks``: the run's own sinks; ``None`` for the first run)."""
        self._sinks.start_run(run_sinks)
        self._interval.start()
        self._segments = Segments()
        self._ranks = RankAgreement(self._ranks_rule)
        self._diagnosis = Diagnosis()
        self._skips = SkipTruth()
        self._fp8 = Fp8Scales(self._fp8_rules, self._ranks_rule)
        self._ledger = LedgerRoom()
        self.summary: str | None = None
        self.should_stop = False  # a "stop" rule fired in this run
        self.tracker = MetricsTracker(1.0)
        self.health: HealthMonitor | None = judge_by(self._policy, self._health_spec, self.tracker, None)

    @property
    def may_stop(self) -> bool:
        """Whether one of the loop's rules stops training when it fires (action ``"stop"``). An
        integration that can read between steps without waiting for each step waits for every step
        only then, to stop at the step a read found the problem (Keras' ``Fp8ScaleCallback``)."""
        rules = [*(self.health.rules if self.health is not None else ()), *(self._fp8_rules or ()),
                 self._ranks_rule, self._not_held]
        return any(getattr(rule, "action", None) == "stop" for rule in rules)

    def set_policy(self, policy: Any) -> None:
        """Judge against ``policy`` from now on: a restored checkpoint brought its own.

        The tracker's minimum and the health rules' thresholds follow it (the snapshots and the
        problems found so far are kept), and the sinks get the policy again with the next metrics.
        """
        check_policy("policy", policy)
        if policy == self._policy:
            return
        self._policy = policy
        self._sinks.config_written = False
        self.health = judge_by(policy, self._health_spec, self.tracker, self.health)

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
        return self._interval.due(step)

    def restart_interval(self, at: int) -> None:
        """The integration's count starts again at ``at``: the next multiple of ``log_every`` it passes
        ends an interval (Keras: ``-1`` at each epoch, so that batch 0 logs, as ``WandbMetricsLogger``
        does; a monitor: the trainer's step count when training starts or resumes)."""
        self._interval.restart(at)

    def resume_at(self, at: int, read: Callable[[], Any] | None = None) -> None:
        """Start or resume counting at step ``at`` (the one place a run begins at step N): the next
        multiple of ``log_every`` past ``at`` ends an interval, and when ``read`` is given and ``at`` is
        past the start (a resumed run, or Keras' first epoch), one read now (not a step) becomes the
        baseline, so that the first interval covers only its own steps.

        Raises:
            ValueError: ``at`` is not an integer >= -1, or the state read is wrong (naming the field).
        """
        self._interval.restart(at)
        if read is not None:
            self.baseline(read())

    def maybe_observe(self, step: int, read: Callable[[], Any], sink_step: int | None = None,
                      read_forensics: Callable[[], IntervalForensics | None] | None = None,
                      read_fp8: Callable[[], Fp8Read | None] | None = None) -> Snapshot | None:
        """:meth:`observe` ``read()`` if an interval ends at ``step``; ``read`` (the host read) runs only
        then, and so do ``read_forensics`` (the scaler's ``read_forensics`` with ``diagnose=True``) and
        ``read_fp8`` (an fp8 monitor's read of the scales)."""
        if not self._interval.due(step):
            return None
        return self.observe(read(), sink_step=sink_step,
                            forensics=read_forensics() if read_forensics is not None else None,
                            fp8=read_fp8() if read_fp8 is not None else None)

    # ---------------------------------------------------------------------------- reading

    def baseline(self, state: Any) -> Snapshot:
        """Record a state without writing it: the start of a resumed run, so the first interval
        covers only its own steps (a baseline whose steps went back starts a new segment).

        Raises:
            ValueError: a field of ``state`` is missing or wrong, naming it.
        """
        ranks = getattr(state, "ranks", None)
        outcomes = getattr(state, "outcomes", None)
        self._ledger.seen(getattr(state, "ledger", None))
        state = observed_state(state)
        self._interval.read()
        if self._segments.repeated(state, self.tracker.last):
            return self.tracker.last
        if self._restarted(state):
            self._segments.began_after = int(state.steps)  # the segment's steps count from here
        if self._segments.last_at is None:
            self._segments.last_at = int(state.steps)
        snapshot = self.tracker.observe(state)
        self._skips.metrics(snapshot, outcomes, self._policy)
        # a rank resumed from another checkpoint
        self._act(self._ranks.judge(ranks, snapshot.step, self._sinks.out, self.health))
        return snapshot

    def observe(self, state: Any, sink_step: int | None = None,
                forensics: IntervalForensics | None = None, fp8: Fp8Read | None = None) -> Snapshot | None:
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

        ``fp8`` (an fp8 monitor's read of the scales, see ``loop/_fp8``) adds the ``fp8/...`` metrics, the
        rebuilt steps of delayed scaling and the fp8 rules' verdicts; with ``state=None`` (a run without
        loss scaling) it is all the read holds, written at its own step, and ``None`` is returned.

        Raises:
            ValueError: a field of ``state`` is missing or wrong (negative, fractional or NaN counts,
                ``skipped_steps > steps``), naming it; nothing is recorded then.
            LossScaleHealthError: a ``"raise"`` rule fired.
        """
        if state is None:  # a run without loss scaling: only the fp8 scales
            if fp8 is None:
                raise ValueError("observe() needs a loss-scale state, an fp8 read (fp8=...), or both")
            self._interval.read()
            at, out = fp8.step if sink_step is None else int(sink_step), self._sinks.out
            if self.writer:
                out.write(at, self._fp8.write(fp8, at, out))
            self._act(self._fp8.judge(fp8, out, self.health))
            return None
        ranks = getattr(state, "ranks", None)  # a RankedState: every rank's, gathered at this read
        # What the state carries for the skip truth (torch's ScalerReader): the interval's step outcomes
        # and what follows the optimizer (each scheduler's, EMA's, trainer's own step count).
        outcomes, followers = getattr(state, "outcomes", None), getattr(state, "followers", ())
        self._ledger.seen(getattr(state, "ledger", None))  # the ledger of bad steps: its words at the end
        state = observed_state(state)
        self._interval.read()
        out, last, segments = self._sinks.out, self.tracker.last, self._segments
        if last is not None and segments.repeated(state, last):
            if forensics is not None:
                self._diagnosis.add(forensics, segments.offset + (last.step if sink_step is None
                                                                  else int(sink_step)), out)
            return last
        restarted = self._restarted(state)
        snapshot = self.tracker.observe(state)
        outcome_metrics = self._skips.metrics(snapshot, outcomes, self._policy)
        at = segments.sink_step(snapshot.step if sink_step is None else int(sink_step))
        if self.writer:
            metrics = {**snapshot.metrics(), **outcome_metrics, **self._ranks.metrics(ranks)}
            if fp8 is not None:
                metrics.update(self._fp8.write(fp8, at, out))
            segments.label(metrics, interval_known=not restarted)
            if forensics is not None:
                self._diagnosis.metrics(forensics, metrics, segments.last_at, at, out)
            out.write(at, metrics)
            segments.written(at)
            self._sinks.write_config_once(self._policy)  # after the metrics: a text lands at their step
            segments.write_note(out)
        if forensics is not None:
            self._diagnosis.add(forensics, at, out, metrics_written=True)
        verdicts: list[Verdict] = []
        if self.health is not None:  # health=None: no rule, so no verdict of the forensics either
            verdicts = self._diagnosis.verdicts(self.health.observe(snapshot), forensics, snapshot.step,
                                                self.health, self.tracker.min_scale, out)
            if self._not_held is not None:
                not_held = self._skips.verdicts(followers, self._not_held.action)
                self.health.verdicts.extend(not_held)  # among the run's problems, in its assessment
                verdicts += not_held
        if fp8 is not None:
            verdicts += self._fp8.judge(fp8, out, self.health)
        self._act(verdicts + self._ranks.judge(ranks, snapshot.step, out, self.health))
        return snapshot

    def _restarted(self, state: Any) -> bool:
        """A new segment when ``state`` cannot follow the last read: the tracker and the rules start over."""
        if not self._segments.restarted(self.tracker.last, state):
            return False
        self.tracker.reset()
        self._skips.restart()
        if self.health is not None:
            self.health.restart()
        return True

    def _act(self, verdicts: list[Verdict]) -> None:
        """Verdicts alerted to the sinks (by the writer), then warned, raised or stopped on."""
        if not verdicts:
            return
        self._sinks.out.alert_verdicts(verdicts)
        assert self.health is not None
        if self.health.apply(verdicts, stop=self.stop, warn=self.writer):
            self.should_stop = True

    # ----------------------------------------------------------------------------- reports

    def write_text(self, tag: str, markdown: str) -> None:
        """A markdown report to every sink (TensorBoard's Text tab, a W&B Table), from the writer only."""
        self._sinks.out.write_text(tag, markdown)

    def report_alignment(self, markdown: str) -> None:
        """The Tensor Core alignment report: printed and written to the sinks, by the writer."""
        if self.writer:
            if self.echo is not None:
                self.echo(markdown)
            self._sinks.out.write_text(ALIGNMENT_TAG, markdown)

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
        out = self._sinks.out
        min_scale = self._policy.min_scale if self._policy is not None else None
        if self.tracker.last is None and self._fp8.reads:  # a run without loss scaling: its fp8 scales
            self.summary = text = self._fp8.summary(note)
        else:
            sentences = [self._skips.sentence(), self._ranks.sentence(), self._segments.sentence(),
                         self._ledger.sentence(), self._fp8.sentence()]
            self.summary = text = run_summary(self.tracker, min_scale, sentences, self.health,
                                              self._diagnosis, out, note)
        if self.writer:
            self._segments.write_note(out)  # a restart seen by a baseline, never followed by a read
            out.write_text(SUMMARY_TAG, text)
            out.flush()
            if self.echo is not None:
                self.echo(text)
        self._ledger.close()
        self._sinks.close_owned()
        return text

    def outcome_metrics(self) -> dict[str, int]:
        """The skip truth's metrics of the last read (the applied steps, the skips by cause: see
        :data:`~lossscale_callbacks._metrics.OUTCOME_METRICS`), ``{}`` before one: for a trainer's own
        metrics, beside the snapshot's."""
        return dict(self._skips.last_metrics)

    def rank_metrics(self) -> dict[str, int]:
        """``{"loss_scale/ranks_disagree": n}`` of the last read that gathered every rank's state, else ``{}``
        (one process): for a trainer's own metrics (Lightning's ``callback_metrics``, the Trainer's logs)."""
        return self._ranks.last_metrics()

    def flush(self) -> None:
        self._sinks.out.flush()

    def close(self) -> None:
        """Close every sink: the owned ones and the caller's (releasing files and runs; a disabled sink
        is closed too), and the file of the ledger of bad steps. A loop that must leave the caller's sinks
        open ends its runs with :meth:`finish`."""
        self._ledger.close()
        self._sinks.close()
