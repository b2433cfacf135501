"""Runs this library did not train: other engines' logs and state files, read by content into series.

The ``engine_log`` reader (an entry point of the ``lossscale_callbacks.readers`` group, like the
TensorBoard and W&B readers) turns a DeepSpeed, apex, fairseq or Megatron-LM text log, or a
Transformers Trainer ``trainer_state.json``, into the series this library's own sinks write
(``loss_scale/scale``, ``loss_scale/skipped_steps``), so ``report`` judges them with the same rules
and draws the same picture. The formats, each cited from its engine's source, are in
:mod:`._engine_formats`; each engine's meaning of its lines in :mod:`._engine_parsers`.

The file is read line by line, never whole, and memory stays bounded however long the log: the
parsers keep what they read in compact records that go to a temporary file past a bound
(:mod:`._records`), the series returned are thinned past 32,768 log points (:mod:`._series_thinning`),
and the report replays every log point from the records to judge them (:class:`ReplayedRun`).
Every line that speaks of loss scaling in no known format is counted and quoted in the report's
notes; what a format leaves out (a step number, the scale's growth) is said there too.

Example:
    >>> read_run("no/such/folder/")  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable
from typing import Any

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._health import Verdict
from lossscale_callbacks.report import _engine_formats as f
from lossscale_callbacks.report._engine_lines import FORMATS_KNOWN, Lines
from lossscale_callbacks.report._engine_parsers import TrainerConsoleParser, Trajectory
from lossscale_callbacks.report._run_readers import (
    ENGINE_LOG,
    GROWTH_INTERVAL,
    LEVELS,
    MIN_SCALE,
    NoLossScaleError,
    ReplayedRun,
    RunReadError,
    RunSeries,
    looks_like_engine_log,
)
from lossscale_callbacks.report._series_thinning import LIMIT, ThinnedRun

__all__ = ["ENGINE_LOG", "looks_like_engine_log", "read_run"]

def _thinned(trajectory: Trajectory) -> tuple[dict[str, list[tuple[int, float]]], str | None]:
    """The series of ``trajectory`` to print and draw (every log point up to a bound, see
    :mod:`._series_thinning`), with the run-wide settings and every level the log printed, and words on
    what was thinned."""
    thinned = ThinnedRun()
    add = thinned.add
    first = None
    for step, scale, skipped in trajectory.replay():
        if first is None:
            first = step
        add(step, scale, skipped)
    series = thinned.series()
    if not trajectory.skips_known:
        series.pop(m.SKIPPED_STEPS, None)
    if first is not None:  # settings without a log point (a DeepSpeed config dump alone): the report says so
        if trajectory.growth_interval:
            series[GROWTH_INTERVAL] = [(first, float(trajectory.growth_interval))]
        if trajectory.min_scale:
            series[MIN_SCALE] = [(first, float(trajectory.min_scale))]
    if trajectory.levels is not None and trajectory.scale_known:
        series[LEVELS] = _levels_series(trajectory.levels())
    return series, thinned.words()


_DISTINCT = 4096  # distinct levels each kept at their first step (powers of two: a few hundred at most)


def _levels_series(levels: Iterable[tuple[int, float]], limit: int = LIMIT) -> list[tuple[int, float]]:
    """Every distinct scale the log printed, at the first step it was printed at, with the changes of
    level between (thinned to about ``limit`` when there are more: every other one kept, then every
    fourth...): the picture and the run's range hold every level however long the log.

    Example:
        >>> _levels_series([(1, 8.0), (2, 8.0), (3, 4.0), (4, 8.0), (5, 2.0)], limit=2)
        [(1, 8.0), (3, 4.0), (4, 8.0), (5, 2.0)]
    """
    firsts: dict[float, int] = {}
    changes: list[tuple[int, float]] = []
    previous, seen, stride = None, 0, 1
    for step, value in levels:
        if value not in firsts and len(firsts) < _DISTINCT:
            firsts[value] = step
        if value == previous:
            continue
        previous, seen = value, seen + 1
        if (seen - 1) % stride == 0:
            changes.append((step, value))
            if len(changes) > limit:
                changes, stride = changes[::2], stride * 2
    return sorted({*changes, *((step, value) for value, step in firsts.items())})


def _chosen(lines: Lines) -> tuple[Trajectory, list[str]]:
    """The engine whose lines give the run's series (a loss scale first, then step numbers, then the most
    lines), and words on the other engines' lines found in the same log."""
    found = [t for t in (parser.trajectory() for parser in lines.parsers) if t is not None]
    if not found:
        seen = sum(parser.lines for parser in lines.parsers)
        words = [f"no loss-scale lines in {lines.total} line{'' if lines.total == 1 else 's'} "
                 f"(formats known: {FORMATS_KNOWN})"]
        if seen:
            words.append(f"{seen} engine line(s) without a scale")
        console = next(p for p in lines.parsers if isinstance(p, TrainerConsoleParser))
        if console.logs or lines.counters_seen:
            counted = console._last_counter
            steps = f"its progress bar counts {counted} steps; " if counted else ""
            words.append(f"a Transformers Trainer console ({steps}the Trainer prints no loss scale, and its "
                         f"{console.logs} log(s) hold no non-finite grad_norm: skipped steps cannot be told)")
        if lines.unknown:
            words.append(lines.unknown_words() or "")
        raise NoLossScaleError("; ".join(words))
    best = max(found, key=lambda t: (t.scale_known, t.steps_known, t.lines))
    others = [f"{t.lines} {t.engine} line(s) in the same log were read but not used for the series"
              for t in found if t is not best]
    return best, others


def _read_log(path: str) -> RunSeries:
    lines = Lines()
    lines.read(path)
    trajectory, others = _chosen(lines)
    read = (f"Read as {trajectory.engine}'s log: {trajectory.lines} loss-scale line(s) of {lines.total}; "
            + "; ".join(trajectory.notes))
    said = [read, *trajectory.findings, *others]
    said += [words for words in (lines.unknown_words(), lines.truncated) if words]
    series, thinning = _thinned(trajectory)
    facts = trajectory.facts
    if facts is not None:
        facts.lines = trajectory.lines
        facts.wordings |= lines.terminal
        for parser in lines.parsers:
            facts.wordings |= parser.wordings
    return ReplayedRun(series, trajectory.replay, notes=[*said, *filter(None, [thinning])],
                       engine=None if facts is None else facts.to_json(),
                       steps_known=trajectory.steps_known, scale_known=trajectory.scale_known,
                       skips_known=trajectory.skips_known,
                       verdicts=[Verdict(rule, "warn", step, words)
                                 for rule, step, words, _ in trajectory.verdicts],
                       verdicts_always=[always for *_, always in trajectory.verdicts])


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _read_trainer_state(path: str, state: dict[str, Any]) -> RunSeries:
    """A Trainer's ``trainer_state.json``: our callback's ``loss_scale/*`` logs when it ran, else the facts
    ``grad_norm`` gives (a non-finite norm: the logged step was skipped)."""
    logs = [entry for entry in state.get("log_history", []) if isinstance(entry, dict) and "step" in entry]
    normed = [entry for entry in logs if "grad_norm" in entry]
    bad = [int(entry["step"]) for entry in normed if not _finite(entry["grad_norm"])]
    ours = [entry for entry in logs if _finite(entry.get(m.SCALE))]
    if not ours:
        return _read_stock_trainer_state(path, state, normed, bad)
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in ours:
        for tag, value in entry.items():
            if tag.startswith("loss_scale/") and _finite(value):
                series.setdefault(tag, []).append((int(entry["step"]), float(value)))
    notes = [f"Read as a Transformers Trainer state: {len(ours)} log(s) of lossscale_callbacks' "
             "LossScaleTrainerCallback in log_history"]
    notes += _grad_norm_disagreement(ours, bad)
    return RunSeries(series, notes=notes)


def _read_stock_trainer_state(path: str, state: dict[str, Any], normed: list[dict[str, Any]],
                              bad: list[int]) -> RunSeries:
    """The stock state (no loss scale): its steps, and the skipped steps its non-finite ``grad_norm`` entries
    show. At ``logging_steps`` 1 every step's norm is logged, so they are the skipped steps (inferred: the
    GradScaler skips a step whose gradients are not finite); at larger intervals only the logged steps'
    norms are, so they are a lower bound."""
    if not normed:
        raise NoLossScaleError(
            f"{path}: a Transformers Trainer state without a loss scale (the Trainer logs none; "
            "lossscale_callbacks.transformers.LossScaleTrainerCallback adds it) and without grad_norm "
            "(logged since transformers 4.38): nothing about skipped steps can be told")
    steps = [int(entry["step"]) for entry in normed]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    every = state.get("logging_steps") or (min(gaps) if gaps else 1)
    last = max(int(state.get("global_step") or 0), steps[-1])
    points: list[tuple[int, float, int]] = []
    skipped = 0
    bad_steps = set(bad)
    for step in steps:
        skipped += step in bad_steps
        if not points or step > points[-1][0]:
            points.append((step, 1.0, skipped))
    if points[-1][0] < last:
        points.append((last, 1.0, skipped))
    exact_skips = every == 1
    listed = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    notes = [f"Read as a Transformers Trainer state: {len(normed)} log(s) with a grad_norm, every {every} "
             f"step(s); the Trainer logs no loss scale, so the report holds none"]
    if exact_skips:
        notes.append("every step's grad_norm is logged (logging_steps 1): a non-finite one is a step fp16's "
                     "GradScaler skipped (inferred), so the skipped steps are those")
    else:
        notes.append(f"only every {every}th step's grad_norm is logged: the {len(bad)} non-finite one(s) are "
                     "skipped steps, and the steps between the logs are not known (a lower bound)")
    verdicts = []
    if bad:
        verdicts.append(Verdict("nonfinite_grad_norm", "warn", bad[-1],
                                f"{len(bad)} of the {len(normed)} logged steps show a non-finite grad_norm "
                                f"(steps {listed}): with fp16's GradScaler those steps were skipped; "
                                "under bf16 or fp32 their updates were applied."))
    facts = {"engine": "transformers", "wordings": ["transformers.trainer-state"], "lines": len(normed),
             "overflows": len(bad), "steps_known": True, "steps_at_least": None, "steps_bound": None,
             "first_scale": None, "last_scale": None, "min_scale_seen": None, "max_scale_seen": None,
             "stopped": False, "stop_reason": None, "grad_norm_nan": len(bad), "nan_not_skipped": 0,
             "every_step_skipped": len(bad) >= 2 and len(bad) == len(normed) and exact_skips,
             "at_minimum": False, "near_minimum": False, "minimum": None,
             "skipped_bound": None if exact_skips else "at least"}
    return ReplayedRun({m.SCALE: [(s, v) for s, v, _ in points],
                        m.SKIPPED_STEPS: [(s, float(k)) for s, _, k in points]},
                       lambda: iter(points), notes=notes, engine=facts, steps_known=True, scale_known=False,
                       skips_known=True, verdicts=verdicts, verdicts_always=[True] * len(verdicts))


def _grad_norm_disagreement(ours: list[dict[str, Any]], bad: list[int]) -> list[str]:
    """Logged steps whose grad_norm was not finite while our callback saw no skip in their interval."""
    clean = {int(e["step"]) for e in ours if e.get(m.SKIPPED_IN_INTERVAL) == 0}
    odd = [step for step in bad if step in clean]
    if not odd:
        return []
    return [f"the Trainer logged a non-finite grad_norm at step(s) {', '.join(map(str, odd[:10]))} where the "
            "callback counted no skipped step in the interval: a non-finite gradient that was applied"]


def _trainer_state(path: str) -> dict[str, Any] | None:
    if not path.lower().endswith(".json"):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            state = json.load(file)  # Python's json reads the NaN and Infinity the Trainer writes
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunReadError(f"{path}: not a readable JSON state file ({exc})") from None
    if isinstance(state, dict) and all(key in state for key in f.TRAINER_STATE_KEYS):
        return state
    raise RunReadError(f"{path}: a JSON file, but not a Transformers Trainer state (no log_history)")


def read_run(path: str) -> RunSeries:
    """Read another engine's log or state file at ``path`` into the report's series.

    Raises:
        RunReadError: ``path`` is a folder, or a JSON file that is not a Trainer state.
        NoLossScaleError: no line gives a loss scale (the report says what was seen instead).

    Example:
        >>> read_run("train.log")["loss_scale/scale"][:2]  # doctest: +SKIP
        [(10, 65536.0), (20, 32768.0)]
    """
    if os.path.isdir(path):
        raise RunReadError(f"{path}: a folder, not a log file (report finds the logs in it)")
    state = _trainer_state(path)
    return _read_trainer_state(path, state) if state is not None else _read_log(path)
