"""A run's loss scale in plain words and numbers: what ``lossscale-callbacks report`` says about one run.

From a run's series (see :mod:`lossscale_callbacks.report._run_readers`), :func:`build_report` rebuilds the
:class:`~lossscale_callbacks.extend.Snapshot` s the training run saw at each log interval and runs
the same health rules over them.

Example:
    >>> report = build_report("run", {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)]})
    >>> report.steps, report.final_scale
    (200, 2048.0)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._health import HealthMonitor, Rule, Verdict, assess, default_rules
from lossscale_callbacks._metrics import MetricsTracker, Snapshot
from lossscale_callbacks._state import LossScaleState
from lossscale_callbacks.report._printable import printable
from lossscale_callbacks.report._run_readers import (
    GROWTH_INTERVAL,
    LEVELS,
    MAX_SCALE,
    MIN_SCALE,
    NoLossScaleError,
    ReplayedRun,
    RunReadError,
)

__all__ = ["RunReport", "build_report", "snapshots_from_series"]

DEFAULT_MIN_SCALE = 1.0



def _find_prefix(series: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    """The tag prefix under which the run's ``loss_scale/scale`` lives.

    ``""`` for this library's sinks, Lightning's loggers and W&B; ``"train/"`` for a run folder
    read from above; ``"batch_"`` (or ``"train/batch_"``) for the per-batch series Keras'
    ``TensorBoard`` callback writes from ``logs``. Per-epoch series (``epoch_``) are refused:
    their step axis is epochs, not optimizer steps.
    """
    if m.SCALE in series:
        return ""
    prefixes = [tag[: -len(m.SCALE)] for tag in series if tag.endswith(m.SCALE)]
    usable = [p for p in prefixes if p.endswith("/") or p.endswith("batch_")]
    if not usable:
        if any(p.endswith("epoch_") for p in prefixes):
            raise NoLossScaleError(
                "the run has only per-epoch loss-scale series (epoch_loss_scale/...), whose step axis is "
                "epochs, not optimizer steps; log per batch (Keras' TensorBoard(update_freq=<int>)) or "
                "write with LossScaleCallback(tensorboard=...)")
        raise NoLossScaleError(f"the run has no {m.SCALE} series (tags found: "
                           f"{', '.join(sorted(series)[:8]) or 'none'})")
    # The library's own series first, then Keras' per-batch copies; the training run first.
    best = min(0 if p.endswith("/") else 1 for p in usable)
    usable = sorted(p for p in usable if (0 if p.endswith("/") else 1) == best)
    if len(usable) > 1:
        train = [p for p in usable if p.rstrip("/").removesuffix("batch_").rstrip("/").endswith("train")]
        if len(train) == 1:
            return train[0]
        names = ", ".join(p + m.SCALE for p in usable)
        raise RunReadError(f"the run has several {m.SCALE} series ({names}); name one run folder")
    return usable[0]


Points = Sequence[tuple[int, float]]
# Series that describe the whole run (the policy), not one stretch of it.
_RUN_WIDE = (MIN_SCALE, MAX_SCALE, GROWTH_INTERVAL)
# Written together with the scale at every interval: they restart exactly where it does (the logging
# loop's restart marker among them, written with every metrics write after a restart).
_WITH_THE_SCALE = (m.SCALE, m.LOG2_SCALE, m.GROWTH_COUNTER, m.SKIPPED_STEPS, m.SKIPPED_IN_INTERVAL,
                   m.SKIP_RATE, m.STEPS, m.SEGMENT, *m.OUTCOME_METRICS)
# A float32 bound read back as float64 may differ from the policy's by the last float32 bit.
_BOUND_SLACK = 2.0**-22


def _steps_of(points: Points) -> np.ndarray:
    return np.fromiter(map(operator.itemgetter(0), points), dtype=np.int64, count=len(points))


def _restarted(previous: Any, step: Any, strict: bool = False) -> Any:
    """The restart rule, written once: a point whose step does not increase on the one before starts a new
    segment (``strict``: only one whose step goes down, for counts a sink may write twice at one step).
    On two steps it says whether the second restarts; on two arrays of steps, where (element by element):
    :func:`_splits` cuts series held in memory with it, :class:`_Restarts` a replayed run as it streams."""
    return step < previous if strict else step <= previous


def _splits(points: Points, strict: bool) -> list[int]:
    """Where each segment of ``points`` starts: where :func:`_restarted` says the step went back."""
    steps = _steps_of(points)
    return [0, *(np.flatnonzero(_restarted(steps[:-1], steps[1:], strict)) + 1).tolist()]


def _scale_splits(series: Mapping[str, Points], prefix: str) -> list[int]:
    """Where the scale series' segments start: where its step does not increase, and where the restart
    marker (``loss_scale/segment``, written with every metrics write after a restart) starts or changes."""
    scale = series[prefix + m.SCALE]
    starts = set(_splits(scale, strict=False))
    marker = series.get(prefix + m.SEGMENT, [])
    offset = len(scale) - len(marker)
    # The marker rides on the scale's own writes, so it lines up with the scale's last points.
    if marker and offset >= 0 and np.array_equal(_steps_of(marker), _steps_of(scale)[offset:]):
        numbers = [number for _, number in marker]
        starts.update(offset + i for i in range(len(numbers))
                      if (i == 0 and offset > 0) or (i > 0 and numbers[i] != numbers[i - 1]))
    return sorted(starts)


def split_segments(series: Mapping[str, Points], prefix: str = "") -> list[dict[str, Points]]:
    """The run's series cut where its step count went back (a restart: an old checkpoint loaded, a new
    scaler), oldest segment first; a run that never restarted is one segment.

    The scale series decides where segments start (where its step does not increase, and where the
    ``loss_scale/segment`` marker of a restart says so). A series written with the scale (the same
    steps) is cut at the same points; any other is cut where its own step goes back, and its pieces
    are matched from the latest segment back (a series that began later has fewer). Series that
    describe the whole run (the policy's bounds and growth interval) go with every segment.

    Example:
        >>> series = {"loss_scale/scale": [(100, 8.0), (200, 16.0), (100, 2.0), (200, 4.0), (300, 8.0)]}
        >>> [s["loss_scale/scale"][-1] for s in split_segments(series)]
        [(200, 16.0), (300, 8.0)]
    """
    scale_starts = _scale_splits(series, prefix)
    scale_steps = _steps_of(series[prefix + m.SCALE])
    segments: list[dict[str, Points]] = [{} for _ in scale_starts]
    for tag, points in series.items():
        name = tag[len(prefix):] if tag.startswith(prefix) else tag
        if name in _RUN_WIDE:
            for segment in segments:
                segment[tag] = points
            continue
        same_steps = len(points) == len(scale_steps) and np.array_equal(_steps_of(points), scale_steps)
        starts = scale_starts if same_steps else _splits(points, strict=name not in _WITH_THE_SCALE)
        pieces = [points[a:b] for a, b in zip(starts, [*starts[1:], len(points)], strict=True)]
        for segment, piece in zip(segments[::-1], pieces[::-1], strict=False):
            segment[tag] = piece
    return segments


def _policy_bounds(series: Mapping[str, Points], prefix: str) -> tuple[float, float] | None:
    low, high = series.get(prefix + MIN_SCALE), series.get(prefix + MAX_SCALE)
    return (float(low[-1][1]), float(high[-1][1])) if low and high else None


def _values_of(points: Points) -> np.ndarray:
    return np.fromiter(map(operator.itemgetter(1), points), dtype=np.float64, count=len(points))


def _drop_out_of_bounds(series: dict[str, Points], prefix: str, damage: list[str]) -> None:
    """Leave out the scales the run's own policy cannot produce (damage written as data), saying so."""
    bounds = _policy_bounds(series, prefix)
    if bounds is None:
        return
    tag = prefix + m.SCALE
    values = _values_of(series[tag])
    inside = (values >= bounds[0] * (1 - _BOUND_SLACK)) & (values <= bounds[1] * (1 + _BOUND_SLACK))
    if inside.all():
        return
    for i in np.flatnonzero(~inside).tolist():
        step, value = series[tag][i]
        damage.append(f"step {step}: a loss scale of {value:g} (2^{math.log2(value):.1f}) is outside the "
                      f"policy's bounds [{bounds[0]:g}, {bounds[1]:g}]: damage, not data (left out)")
    series[tag] = [point for point, keep in zip(series[tag], inside.tolist(), strict=True) if keep]


# Series whose values the report counts with: a NaN or an Inf in one is no count.
_COUNTS = (m.GROWTH_COUNTER, m.SKIPPED_STEPS, m.SKIPPED_IN_INTERVAL, m.STEPS, m.SEGMENT, *m.OUTCOME_METRICS,
           *m.CAUSE_METRICS.values())
_COUNT_PREFIXES = (m.LAYER_METRIC_PREFIX, m.ORIGIN_METRIC_PREFIX)


def _checked_scale(series: Mapping[str, Points], prefix: str) -> None:
    """Refuse, naming the series, the step and the value, a scale that is no loss scale and a count that
    is no number (NaN, Inf): what a report would otherwise fail on deep inside, in other words."""
    values = _values_of(series[prefix + m.SCALE])
    bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
    if bad.size:
        step, value = series[prefix + m.SCALE][bad[0]]
        raise RunReadError(f"the {prefix}{m.SCALE} series holds {value!r} at step {step}: "
                           "not a loss scale (a finite number > 0)")
    for tag, points in series.items():
        name = tag.removeprefix(prefix)
        if name in _COUNTS or name.startswith(_COUNT_PREFIXES):
            bad = np.flatnonzero(~np.isfinite(_values_of(points)))
            if bad.size:
                step, value = points[bad[0]]
                raise RunReadError(f"the {tag} series holds {value!r} at step {step}: not a count (a "
                                   "finite number)")


def _aligned(points: Points, steps: list[int], default: float | None) -> list[float]:
    """The values of ``points`` at ``steps`` (where a step has none: ``default``, or the step itself when
    None); a series written with the scale (the same steps) is taken as it is."""
    if len(points) == len(steps) and all(a == b for (a, _), b in zip(points, steps, strict=True)):
        return [value for _, value in points]
    by_step = {int(step): float(value) for step, value in points}
    return [by_step.get(step, step if default is None else default) for step in steps]


def _min_scale_of(series: Mapping[str, Points], prefix: str, min_scale: float | None) -> float:
    if min_scale is not None:
        return float(min_scale)
    bounds = series.get(prefix + MIN_SCALE)
    return float(bounds[-1][1]) if bounds else DEFAULT_MIN_SCALE


def _states(segment: Mapping[str, Points], prefix: str) -> Iterator[LossScaleState]:
    """The scaler states one segment logged, one per log interval: what the integration saw there."""
    scale = segment[prefix + m.SCALE]
    steps = [int(step) for step, _ in scale]
    growth = _aligned(segment.get(prefix + m.GROWTH_COUNTER, ()), steps, 0)
    skipped = _aligned(segment.get(prefix + m.SKIPPED_STEPS, ()), steps, 0)
    # Runs logged on another axis (Lightning's logging step) carry the optimizer steps as a value.
    attempted = _aligned(segment.get(prefix + m.STEPS, ()), steps, None)
    for (_, value), at, counter, skips in zip(scale, attempted, growth, skipped, strict=True):
        yield LossScaleState(float(value), int(counter), 0, int(skips), int(at))


def _iter_snapshots(segment: Mapping[str, Points], prefix: str, min_scale: float) -> Iterator[Snapshot]:
    """The snapshots one segment logged, one at a time (the tracker sees what the integration saw at each
    interval): a report judges them as they come and keeps none (a million log points were half a gigabyte
    of snapshots)."""
    return map(MetricsTracker(min_scale=min_scale).observe, _states(segment, prefix))


def snapshots_from_series(series: Mapping[str, Points],
                          min_scale: float | None = None) -> tuple[list[Snapshot], float]:
    """Rebuild the snapshots a run logged, one per log interval, from its metric series.

    The tracker sees what the integration saw at each interval: the step, the scale, the growth
    counter and the cumulative skipped steps. A run that restarted (see :func:`split_segments`)
    gives the snapshots of its latest segment. Returns the snapshots and the ``min_scale`` used
    (from ``min_scale``, else the run's ``loss_scale/min_scale`` series, else the policy default 1.0).
    """
    prefix = _find_prefix(series)
    _checked_scale(series, prefix)
    used = _min_scale_of(series, prefix, min_scale)
    return list(_iter_snapshots(split_segments(series, prefix)[-1], prefix, used)), used


@dataclasses.dataclass(frozen=True)
class Segment:
    """One stretch of a run between restarts (the step count going back), judged on its own.

    ``index`` counts restarts as the logging loop's ``loss_scale/segment`` does: 0 before the first,
    1 after it, and so on. ``skipped_steps`` is None when the run did not log skipped steps.
    """

    index: int
    first_step: int
    last_step: int
    log_points: int
    skipped_steps: int | None
    final_scale: float
    verdicts: tuple[Verdict, ...]

    def words(self) -> str:
        """The segment in one line."""
        skipped = ("skipped steps not logged" if self.skipped_steps is None
                   else f"{self.skipped_steps} skipped")
        problems = f"{len(self.verdicts)} problem(s)" if self.verdicts else "no problem found"
        return (f"segment {self.index}: steps {self.first_step} to {self.last_step} ({self.log_points} log "
                f"points), {skipped}, final scale {self.final_scale:g}, {problems}")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "healthy": not self.verdicts}


def _forensics_lines(forensics: Any) -> list[str]:
    named = {"loss_nonfinite": "non-finite loss", "grad_inf": "Inf gradients",
             "grad_nan": "NaN gradients", "grad_nonfinite": "non-finite gradients (kind not told)"}
    parts = [f"{count} {named[c]}" for c, count in forensics.causes.items() if count]
    lines = ["Skip causes (overflow forensics): " + (", ".join(parts) or "none recorded")]
    ranked = sorted(forensics.layer_skips.items(), key=lambda item: -item[1])
    if ranked:
        lines.append("Layers with non-finite gradients in skipped steps: "
                     + ", ".join(f"`{layer}` ({count})" for layer, count in ranked[:5]))
    return lines + forensics.sentences()


def _listed(sentences: Sequence[str], limit: int = 3) -> str:
    return "; ".join(sentences[:limit]) + ("; ..." if len(sentences) > limit else "")


_NAMED = 5  # earlier segments named in the text (all of them in the JSON)


def _level_words(level: Any) -> str:
    """A scale an engine's log printed (see :class:`~._engine_text.Level`) in words."""
    if isinstance(level, dict):
        if "below" in level:
            return f"below {level['below']:g}"
        low, high = level["between"]
        return f"{low:g} or {high:g}"
    return f"{level:g} (2^{math.log2(level):.1f})" if level > 0 else f"{level:g}"


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What ``lossscale-callbacks report`` says about one run.

    A run whose step count went back (an old checkpoint loaded, a new scaler) is cut into
    ``segments``, each judged on its own; the numbers, verdicts and snapshots are those of the
    latest segment, the run's state. ``skipped_steps`` and ``skip_rate`` are ``None`` when the run
    did not log ``loss_scale/skipped_steps``: then nothing is known about skips, and the skip rules
    are not judged. ``damage``: records left out as damaged (by the reader, or scales outside the
    policy's bounds); ``notes``: what the reader adds (a file that ends inside a record).
    """

    path: str
    reader: str
    steps: int
    skipped_steps: int | None
    skip_rate: float | None
    final_scale: float
    min_scale_seen: float
    max_scale_seen: float
    min_scale: float
    steps_at_min_scale: int
    log_points: int
    verdicts: tuple[Verdict, ...]
    series: Mapping[str, Sequence[tuple[int, float]]] = dataclasses.field(repr=False, compare=False)
    health: str = ""
    max_scale: float | None = None
    forensics: Any = None
    damage: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    segments: tuple[Segment, ...] = ()
    steps_known: bool = True
    scale_known: bool = True
    engine: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
    # Skip truth, when the run logged it (loss_scale/applied_steps and the skips by cause): the applied
    # steps, the skipped ones per cause, the applied non-finite ones; None when not logged.
    applied_steps: int | None = None
    skipped_by_cause: Mapping[str, int] | None = None
    applied_nonfinite: int | None = None

    @property
    def healthy(self) -> bool:
        return not self.verdicts

    @functools.cached_property
    def snapshots(self) -> tuple[Snapshot, ...]:
        """The latest segment's snapshots, one per log point, rebuilt from :attr:`series` when first asked
        (for the picture): the report itself judged them one at a time and kept none."""
        return tuple(snapshots_from_series(self.series, self.min_scale)[0])

    def advice(self) -> Any:
        """The precision advice from the logged forensics (the words of the run's own summary)."""
        return self.forensics.advice(at_min_scale=self.steps_at_min_scale > 0, min_scale=self.min_scale)

    def to_json(self) -> dict[str, Any]:
        """Plain numbers for machines (``--json``). What the run's log does not hold is ``null``: the steps
        of a log with no step counter (``engine_log.steps_at_least`` has the least they can be, and the
        skip rate is not given), the scales of a log that prints none."""
        scale = (lambda value: value) if self.scale_known else (lambda value: None)
        return {
            "path": self.path,
            "reader": self.reader,
            "steps": self.steps if self.steps_known else None,
            "skipped_steps": self.skipped_steps,
            "skip_rate": self.skip_rate if self.steps_known else None,
            "final_scale": scale(self.final_scale),
            "min_scale_seen": scale(self.min_scale_seen),
            "max_scale_seen": scale(self.max_scale_seen),
            "min_scale": scale(self.min_scale),
            "steps_at_min_scale": self.steps_at_min_scale,
            "log_points": self.log_points,
            "healthy": self.healthy,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "bounds": {"min_scale": self.min_scale, "max_scale": self.max_scale},
            "summary": self.text(),
            "damage": list(self.damage),
            "notes": list(self.notes),
            "segments": [segment.to_json() for segment in self.segments],
            "applied_steps": self.applied_steps,
            "skipped_by_cause": None if self.skipped_by_cause is None else dict(self.skipped_by_cause),
            "applied_nonfinite": self.applied_nonfinite,
            "forensics": None if self.forensics is None else {
                "causes": dict(self.forensics.causes), "layer_skips": dict(self.forensics.layer_skips),
                "producers": dict(self.forensics.producers), "advice": self.advice().to_dict()},
            "engine_log": None if self.engine is None else dict(self.engine),
            # (step, value) pairs: JSON writes a tuple as an array, so the pairs need no copy
            "series": {tag: list(points) for tag, points in self.series.items()
                       if self.scale_known or tag != m.SCALE},
        }

    def _restart_line(self) -> list[str]:
        if len(self.segments) < 2:
            return []
        latest, earlier = self.segments[-1], self.segments[:-1]
        # The first few and the last, however many (a log with each line printed twice restarts at each).
        named = [segment.words() for segment in (earlier if len(earlier) <= _NAMED else
                                                 (*earlier[:_NAMED - 1], earlier[-1]))]
        if len(earlier) > _NAMED:
            named.insert(_NAMED - 1, f"... {len(earlier) - _NAMED} more ...")
        return [f"Restarts: the step count went back {len(earlier)} time(s) (an old checkpoint loaded, or "
                f"a new scaler); reported here is the latest segment ({latest.index}, steps "
                f"{latest.first_step} to {latest.last_step}). Earlier: " + "; ".join(named) + "."]

    def _outcome_line(self) -> list[str]:
        """Applied and skipped steps apart, by cause (a run that logged them)."""
        if self.applied_steps is None:
            return []
        causes = ", ".join(f"{count} {cause}" for cause, count in (self.skipped_by_cause or {}).items()
                           if count)
        line = f"Applied steps: {self.applied_steps}; skipped by cause: {causes or 'none'}"
        if self.applied_nonfinite:
            line += f"; applied with non-finite gradients (monitoring only): {self.applied_nonfinite}"
        return [line]

    def _health_line(self) -> str:
        if self.healthy and self.skipped_steps is None:
            return ("Health: no problem seen, but only the scale was logged: skipped steps and the "
                    "skip rate could not be judged.")
        if self.healthy and not self.steps_known:
            return ("Health: no problem seen, but not judged: the log has no step counter, so how many steps "
                    "ran and the skip rate are not known.")
        return self.health or assess((), list(self.snapshots), self.verdicts)

    def _steps_lines(self) -> list[str]:
        if self.steps_known:
            bound = "at least " if self.engine and self.engine.get("steps_bound") else ""
            skipped = ("" if self.engine is None or not self.engine.get("skipped_bound")
                       else f"{self.engine['skipped_bound']} ")
            return [f"Optimizer steps attempted: {bound}{self.steps}",
                    f"Skipped steps (Inf/NaN gradients): {skipped}{self.skipped_steps} ({self.skip_rate:.2%})"
                    if self.skipped_steps is not None and self.skip_rate is not None else
                    "Skipped steps (Inf/NaN gradients): not logged by this run "
                    f"(no {m.SKIPPED_STEPS} series)"]
        least = (self.engine or {}).get("steps_at_least") or self.steps
        return [f"Optimizer steps attempted: not known (the log has no step counter; at least {least})",
                f"Skipped steps (Inf/NaN gradients): {self.skipped_steps} (the skip rate is not known: "
                f"at most {self.skipped_steps / least:.2%} of the least steps there can have been)"
                if self.skipped_steps is not None and least else
                "Skipped steps (Inf/NaN gradients): not known"]

    def _scale_line(self) -> str:
        if not self.scale_known:
            return "Loss scale: not in this log (the engine prints none)"
        engine = self.engine or {}
        low, high, last = engine.get("min_scale_seen"), engine.get("max_scale_seen"), engine.get("last_scale")
        if low is not None and high is not None and last is not None:
            return (f"Loss scale: final {_level_words(last)}; ranged from {_level_words(low)} to "
                    f"{_level_words(high)} (every scale the log printed)")
        return (f"Loss scale: final {self.final_scale:g} (2^{math.log2(self.final_scale):.1f}); "
                f"ranged from {self.min_scale_seen:g} to {self.max_scale_seen:g}")

    def text(self) -> str:
        """The summary in plain words, each line escaped by
        :func:`~lossscale_callbacks.report._printable.printable` (a name from the disk cannot add a line or
        drive the terminal)."""
        if self.steps == 0:
            return printable(f"{self.path}: the run logged its loss scale, but no optimizer step was taken.")
        at_min = (f"about {self.steps_at_min_scale}" if self.steps_at_min_scale else "none seen")
        if not self.steps_at_min_scale and (self.engine or {}).get("at_minimum"):
            # An engine's overflow lines reached the minimum, but its log points never fell on it.
            at_min = "reached (the log's overflow lines are there; the steps spent there are not logged)"
        lines = [
            f"Run: {self.path} (read as {self.reader}, {self.log_points} log points)",
            *self._restart_line(),
            *self._steps_lines(),
            *self._outcome_line(),
            self._scale_line(),
            *([f"Steps at the minimum scale ({self.min_scale:g}): {at_min}"] if self.scale_known else []),
            # one line per problem: each escaped on its own, the line breaks between them kept
            *self._health_line().split("\n"),
        ]
        if self.forensics is not None:
            lines.extend(_forensics_lines(self.forensics))
            advice = self.advice()
            lines.extend(advice.findings)
            lines.extend(f"Advice: {sentence}" for sentence in advice.actions)
        if self.damage:
            lines.append(f"Damaged records, left out ({len(self.damage)}): {_listed(self.damage)}")
        if self.notes:
            lines.append(f"Note: {_listed(self.notes)}")
        return "\n".join(printable(line) for line in lines)


@dataclasses.dataclass
class _Judged:
    """One segment judged: its first and last snapshot, how many, the scales' range, the health monitor
    that saw them (it keeps a bounded window), its forensics."""

    first: Snapshot
    last: Snapshot
    count: int
    lowest: float
    highest: float
    monitor: HealthMonitor | None  # let go once a later segment is judged
    verdicts: list[Verdict]
    forensics: Any
    skips_logged: bool


def _judge_snapshots(snapshots: Iterable[Snapshot], growth_interval: int | None, rules: Sequence[Rule] | None,
                     ranks: Points = (), forensics: Any = None, skips_logged: bool = True) -> _Judged:
    """Judge one segment's snapshots as they come (the health monitor keeps a bounded window of them);
    ``ranks``: its rank-agreement series, ``forensics``: its logged forensics totals."""
    monitor = HealthMonitor(default_rules("warn", growth_interval) if rules is None else rules)
    observe = monitor.observe
    first = last = None
    count, lowest, highest = 0, math.inf, -math.inf
    for snap in snapshots:
        observe(snap)
        first, last, count = first or snap, snap, count + 1
        scale = snap.scale
        if scale < lowest:
            lowest = scale
        if scale > highest:
            highest = scale
    assert first is not None and last is not None  # a segment holds at least one scale
    monitor.final()
    monitor.verdicts.extend(_ranks_verdicts(ranks))  # in its assessment
    verdicts = list(monitor.verdicts)
    if forensics is not None and forensics.causes["loss_nonfinite"]:
        verdicts.append(Verdict("NonFiniteLoss", "warn", last.step, forensics.sentences()[0]))
    return _Judged(first, last, count, lowest, highest, monitor, verdicts, forensics, skips_logged)


def _growth_interval_of(series: Mapping[str, Points], prefix: str) -> int | None:
    interval = series.get(prefix + GROWTH_INTERVAL)
    return int(interval[-1][1]) if interval else None


def _forensics_of(series: Mapping[str, Points]) -> Any:
    """The run's logged forensics totals, or ``None`` when it logged none. The forensics room is loaded
    only for a run that logged them: ``report`` on a plain run loads none of it."""
    if not any(tag in series for tag in m.CAUSE_METRICS.values()):
        return None
    from lossscale_callbacks.forensics._gradients import totals_from_series

    return totals_from_series(series)


def _judge(segment: Mapping[str, Points], prefix: str, min_scale: float,
           rules: Sequence[Rule] | None) -> _Judged:
    forensics = _forensics_of({tag[len(prefix):]: points for tag, points in segment.items()
                               if tag.startswith(prefix)})
    return _judge_snapshots(_iter_snapshots(segment, prefix, min_scale), _growth_interval_of(segment, prefix),
                            rules, segment.get(prefix + m.RANKS_DISAGREE, ()), forensics,
                            bool(segment.get(prefix + m.SKIPPED_STEPS)))


class _Restarts:
    """A key for :func:`itertools.groupby`: how often the step has gone back so far, by
    :func:`_restarted` (the rule :func:`split_segments` cuts a scale series by)."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.number = 0

    def __call__(self, point: tuple[int, float, int]) -> int:
        step = point[0]
        if self.last is not None and _restarted(self.last, step):
            self.number += 1
        self.last = step
        return self.number


def _replayed_states(points: Iterable[tuple[int, float, int]]) -> Iterator[LossScaleState]:
    """The states of replayed log points ``(step, scale, cumulative skipped)``, each scale checked as
    :func:`_checked_scale` checks a whole series."""
    for step, scale, skipped in points:
        if not 0.0 < scale < math.inf:
            raise RunReadError(f"the {m.SCALE} series holds {scale!r} at step {step}: "
                               "not a loss scale (a finite number > 0)")
        yield LossScaleState(scale, 0, 0, skipped, step)


def _judge_replayed(run: ReplayedRun, min_scale: float, growth_interval: int | None,
                    rules: Sequence[Rule] | None) -> Iterator[_Judged]:
    """Every log point of a replayed run judged at full resolution, segment by segment, none kept."""
    for _, points in itertools.groupby(run.replay(), key=_Restarts()):
        yield _judge_snapshots(map(MetricsTracker(min_scale=min_scale).observe, _replayed_states(points)),
                               growth_interval, rules, skips_logged=run.skips_known)


def _in_turn(segments: Iterable[_Judged]) -> list[_Judged]:
    """The segments judged one after another, each earlier one's health monitor (its window of snapshots)
    let go: only the latest segment's assessment is read, so a run of many restarts keeps two windows."""
    judged: list[_Judged] = []
    for segment in segments:
        if judged:
            judged[-1].monitor = None
        judged.append(segment)
    return judged


def _ranks_verdicts(points: Points) -> list[Verdict]:
    """The run's rank-agreement series (written by runs of several processes) in words."""
    differing = [(int(step), int(value)) for step, value in points if value > 0]
    if not differing:
        return []
    step, count = differing[0]
    return [Verdict("ranks_disagree", "warn", step,
                    f"The ranks held different loss-scale states at {len(differing)} of {len(points)} log "
                    f"interval(s), first at step {step} ({count} rank(s) differed from rank 0; the run's "
                    f"{m.RANKS_TAG} text names them and their values). Each rank scaled and skipped on its "
                    "own.")]


def _segment(index: int, judged: _Judged) -> Segment:
    first, last = judged.first, judged.last
    return Segment(index, first.step, last.step, judged.count,
                   last.skipped_steps if judged.skips_logged else None, last.scale, tuple(judged.verdicts))


def build_report(path: str, series: Mapping[str, Points], reader: str = "", min_scale: float | None = None,
                 rules: Sequence[Rule] | None = None, damage: Sequence[str] = (),
                 notes: Sequence[str] = ()) -> RunReport:
    """Describe a run from its series: counts, scale range, time at the minimum, health verdicts.

    Series are taken in the order written: where the step count goes back, a new segment starts
    (see :func:`split_segments`) and the latest one is reported as the run's state, the earlier ones
    named. Scales outside the bounds of the run's own policy (its ``loss_scale/min_scale`` and
    ``loss_scale/max_scale``) are left out as damage. ``damage`` and ``notes`` are what the reader
    found (one sentence each); the report says them.

    Example:
        >>> series = {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)],
        ...           "loss_scale/skipped_steps": [(100, 3.0), (200, 3.0)]}
        >>> report = build_report("run", series)
        >>> report.steps, report.skipped_steps, report.final_scale, report.healthy
        (200, 3, 2048.0, True)
    """
    prefix = _find_prefix(series)
    replayed = series if isinstance(series, ReplayedRun) else None
    series, damage = dict(series), list(damage)
    if replayed is None:  # a replayed run's scales are checked as they are replayed; it has no bounds
        _checked_scale(series, prefix)
        _drop_out_of_bounds(series, prefix, damage)
    if not series[prefix + m.SCALE]:
        raise NoLossScaleError(f"{path}: the {prefix}{m.SCALE} series holds no loss scale")
    used_min = _min_scale_of(series, prefix, min_scale)
    if replayed is not None and not replayed.scale_known:
        used_min = _NO_SCALE_MIN  # the replayed scale is a placeholder: it is never at a minimum
    judged = _in_turn(
        (_judge(segment, prefix, used_min, rules) for segment in split_segments(series, prefix))
        if replayed is None else  # a long run's series are thinned: its every log point is replayed
        _judge_replayed(replayed, used_min, _growth_interval_of(series, prefix), rules))
    latest = judged[-1]
    assert latest.monitor is not None  # only earlier segments' monitors are let go
    if replayed is not None:
        _engine_verdicts(latest, replayed)
    last = latest.last
    upper = series.get(prefix + MAX_SCALE)
    lowest, highest = _levels_range(series, latest)
    return RunReport(
        path=path, reader=reader, steps=last.step,
        skipped_steps=last.skipped_steps if latest.skips_logged else None,
        skip_rate=(last.skipped_steps / last.step if last.step else 0.0) if latest.skips_logged else None,
        final_scale=last.scale, min_scale_seen=lowest, max_scale_seen=highest,
        min_scale=used_min, steps_at_min_scale=last.total_steps_at_min_scale, log_points=latest.count,
        verdicts=tuple(latest.verdicts), series=series,
        health=latest.monitor.assessment(), max_scale=float(upper[-1][1]) if upper else None,
        forensics=latest.forensics, damage=tuple(damage), notes=tuple(notes),
        segments=tuple(_segment(i, j) for i, j in enumerate(judged)),
        steps_known=True if replayed is None else replayed.steps_known,
        scale_known=True if replayed is None else replayed.scale_known,
        engine=None if replayed is None else replayed.engine,
        **_outcomes_logged(series, prefix),
    )


_NO_SCALE_MIN = 2.0**-126  # the minimum a run with no scale in its log is judged against: never reached


def _engine_verdicts(latest: _Judged, run: ReplayedRun) -> None:
    """What an engine's log shows wrong that no health rule sees (the engine's fatal message, a NaN
    gradient norm applied) into the latest segment's verdicts; the rest (every step skipped, the scale at
    the engine's minimum) only where the rules found no problem."""
    found = bool(latest.verdicts)
    extra = [v for v, always in zip(run.verdicts, run.verdicts_always, strict=True) if always or not found]
    latest.verdicts.extend(extra)
    assert latest.monitor is not None
    latest.monitor.verdicts.extend(extra)


def _levels_range(series: Mapping[str, Points], latest: _Judged) -> tuple[float, float]:
    """The lowest and highest scale: of the latest segment's log points, and of every level an engine's log
    printed (between its log points, an engine prints more than the points hold)."""
    lowest, highest = latest.lowest, latest.highest
    levels = series.get(LEVELS)
    if levels:
        values = [value for _, value in levels if value > 0 and math.isfinite(value)]
        if values:
            lowest, highest = min(lowest, *values), max(highest, *values)
    return lowest, highest


def _outcomes_logged(series: Mapping[str, Points], prefix: str) -> dict[str, Any]:
    """The applied steps and the skips by cause as the run last logged them (each series' last point), or
    nothing when the run did not log them (a run of an earlier release, another engine's log)."""
    applied = series.get(prefix + m.APPLIED_STEPS)
    if not applied:
        return {}
    last = {name: int(points[-1][1]) for name in (*m.SKIPPED_BY_CAUSE.values(), m.APPLIED_NONFINITE)
            if (points := series.get(prefix + name))}
    return {"applied_steps": int(applied[-1][1]),
            "skipped_by_cause": {cause: last.get(name, 0) for cause, name in m.SKIPPED_BY_CAUSE.items()},
            "applied_nonfinite": last.get(m.APPLIED_NONFINITE, 0)}
