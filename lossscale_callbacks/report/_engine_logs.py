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

import json
import math
import os
from typing import Any

from lossscale_callbacks import _metrics as m
from lossscale_callbacks.report import _engine_formats as f
from lossscale_callbacks.report._engine_parsers import PARSERS, Trajectory
from lossscale_callbacks.report._run_readers import (
    ENGINE_LOG,
    GROWTH_INTERVAL,
    MIN_SCALE,
    NoLossScaleError,
    ReplayedRun,
    RunReadError,
    RunSeries,
    looks_like_engine_log,
)
from lossscale_callbacks.report._series_thinning import ThinnedRun

__all__ = ["ENGINE_LOG", "looks_like_engine_log", "read_run"]

_QUOTED = 3  # unknown lines quoted in the report

class _Lines:
    """The lines of a log, fed to every engine's parser; unknown loss-scale lines counted and quoted."""

    def __init__(self) -> None:
        self.parsers = [parser() for parser in PARSERS]
        self.total = 0
        self.unknown = 0
        self.quoted: list[str] = []
        self.truncated: str | None = None

    def feed(self, number: int, line: str, last: bool) -> None:
        self.total += 1
        # Megatron's iteration line (a million at --log-interval 1) is related without a lower-case copy
        related = "loss scale:" in line or any(map(line.lower().__contains__, f.LOSS_SCALE_WORDS))
        if related or "initial_dynamic_scale" in line:
            for parser in self.parsers:  # a plain loop: a million lines come through here
                if any(map(line.__contains__, parser.markers)) and parser.feed(line):
                    return
        if last:  # the file ends inside this line: a log still being written
            self.truncated = (f"the file ends inside line {number} (a log still being written?): "
                              "it was not read")
            return
        if not related or f.SETTING_LINE.search(line):
            return  # a line unrelated to loss scaling, or a setting nobody needs
        self.unknown += 1
        if len(self.quoted) < _QUOTED:
            self.quoted.append(f"line {number}: {line.strip()[:120]!r}")

    def read(self, path: str) -> None:
        feed = self.feed
        with open(path, encoding="utf-8", errors="replace") as file:
            # Universal newlines end every line but the file's last with "\n": only that one can be cut.
            for number, line in enumerate(file, start=1):
                feed(number, line, not line.endswith(("\n", "\r")))

    def unknown_words(self) -> str | None:
        if not self.unknown:
            return None
        return (f"{self.unknown} line(s) speak of loss scaling in a format this reader does not know "
                f"(counted, not read): {'; '.join(self.quoted)}{'; ...' if self.unknown > _QUOTED else ''}")


def _thinned(trajectory: Trajectory) -> tuple[dict[str, list[tuple[int, float]]], str | None]:
    """The series of ``trajectory`` to print and draw (every log point up to a bound, see
    :mod:`._series_thinning`), with the run-wide settings, and words on what was thinned."""
    thinned = ThinnedRun()
    add = thinned.add
    first = None
    for step, scale, skipped in trajectory.replay():
        if first is None:
            first = step
        add(step, scale, skipped)
    series = thinned.series()
    if first is not None:  # settings without a log point (a DeepSpeed config dump alone): the report says so
        if trajectory.growth_interval:
            series[GROWTH_INTERVAL] = [(first, float(trajectory.growth_interval))]
        if trajectory.min_scale:
            series[MIN_SCALE] = [(first, float(trajectory.min_scale))]
    return series, thinned.words()


def _chosen(lines: _Lines) -> tuple[Trajectory, list[str]]:
    """The engine whose lines give the run's series (step numbers first, then the most lines), and words
    on the other engines' lines found in the same log."""
    found = [t for t in (parser.trajectory() for parser in lines.parsers) if t is not None]
    if not found:
        seen = sum(parser.lines for parser in lines.parsers)
        raise NoLossScaleError(
            f"no loss-scale line of DeepSpeed, apex, fairseq or Megatron-LM in {lines.total} line(s)"
            + (f" ({seen} engine line(s) without a scale)" if seen else "")
            + (f"; {lines.unknown_words()}" if lines.unknown else ""))
    best = max(found, key=lambda t: (t.steps_known, t.lines))
    others = [f"{t.lines} {t.engine} line(s) in the same log were read but not used for the series"
              for t in found if t is not best]
    return best, others


def _read_log(path: str) -> RunSeries:
    lines = _Lines()
    lines.read(path)
    trajectory, others = _chosen(lines)
    read = (f"Read as {trajectory.engine}'s log: {trajectory.lines} loss-scale line(s) of {lines.total}; "
            + "; ".join(trajectory.notes))
    said = [read, *trajectory.findings, *others]
    said += [words for words in (lines.unknown_words(), lines.truncated) if words]
    series, thinning = _thinned(trajectory)
    return ReplayedRun(series, trajectory.replay, notes=[*said, *filter(None, [thinning])])


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
        raise NoLossScaleError(
            f"{path}: a Transformers Trainer state without a loss scale (the Trainer logs none; "
            "lossscale_callbacks.transformers.LossScaleTrainerCallback adds it): "
            + (f"{len(bad)} of {len(normed)} logged steps show a non-finite grad_norm, so those steps were "
               f"skipped (steps {', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''}); skips "
               "between the logged steps are not known" if normed else "no grad_norm was logged either"))
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in ours:
        for tag, value in entry.items():
            if tag.startswith("loss_scale/") and _finite(value):
                series.setdefault(tag, []).append((int(entry["step"]), float(value)))
    notes = [f"Read as a Transformers Trainer state: {len(ours)} log(s) of lossscale_callbacks' "
             "LossScaleTrainerCallback in log_history"]
    notes += _grad_norm_disagreement(ours, bad)
    return RunSeries(series, notes=notes)


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
