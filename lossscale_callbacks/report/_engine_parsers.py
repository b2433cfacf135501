"""One parser per engine: its loss-scale lines (see :mod:`._engine_formats`) turned into log points and facts.

A parser is fed every line that holds one of its ``markers`` (with the progress counters the line holds,
see :mod:`._engine_text`) and says whether the line was one of its formats; a line it was not fed still
gives it the counters in it (:meth:`_Parser.ticks`). What it reads goes into :class:`~._records.Records`
(compact, and past a bound in a temporary file), since a log point's meaning may depend on lines read
later. At the end, :meth:`_Parser.trajectory` gives the run's log points ``(step, scale, cumulative
skipped steps)``, replayed from those records as often as asked, every level the log printed
(:attr:`Trajectory.levels`), the facts a reader can see (:class:`EngineFacts`), what the format left
out, in words, and what is wrong with the run, in words (:attr:`Trajectory.verdicts`).

The step axis is optimizer steps attempted, skipped ones included, from the counters the log has:

* Megatron-LM: the iteration printed (it counts skipped iterations); skips are per log interval.
* DeepSpeed: ``step=N, skipped=K`` progress lines, ``Grad overflow on iteration N`` (counted from 0),
  or the terminal's counters (a tqdm bar's ``n/total``, ``Epoch: [e][i/n]``, DLLogger's iteration).
* fairseq: ``num_updates`` counts applied updates only, so the overflows are added back; in epoch 1 the
  bar's own count of updates attempted says how many were skipped.
* apex: no step number of its own; the terminal's counters, else none at all.

An overflow between two counters lies inside that interval: it is placed at the first steps after the
earlier counter (a bounded step) and counted in the later counter's log point, as a log interval of our
own loop counts its skips. An overflow after the last counter is a log point of its own, one step after
the last (the steps are then a lower bound, said so). With no counter at all the steps are not known:
each overflow is placed at the least step it can have been at, and the report says the steps are not
known.

Example:
    >>> parser = MegatronParser()
    >>> parser.feed(" iteration       10/     100 | loss scale: 1024.0 | number of skipped iterations:   2 |"
    ...             " number of nan iterations:   0 |")
    True
    >>> parser.trajectory().points
    [(10, 1024.0, 2)]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lossscale_callbacks.report import _engine_formats as f
from lossscale_callbacks.report._engine_text import Level, decimals_of, exact, printed
from lossscale_callbacks.report._records import Records

__all__ = ["PARSERS", "ApexParser", "DeepSpeedParser", "EngineFacts", "FairseqParser", "MegatronParser",
           "TrainerConsoleParser", "Trajectory"]

Point = tuple[int, float, int]
Counter = tuple[int, int, int, str]  # (position in the line, steps done, total, kind)

_FLOAT16_SMALLEST = 2.0**-24  # float16's smallest subnormal: a scale below it scales every loss to zero
_NEAR = 8.0  # a scale within three halvings of the engine's minimum is near it


@dataclasses.dataclass
class EngineFacts:
    """What a reader can see in an engine's log, as ``report --json`` gives it under ``engine_log``."""

    engine: str
    wordings: set[str] = dataclasses.field(default_factory=set)
    lines: int = 0
    overflows: int = 0
    steps_known: bool = False
    steps_at_least: int | None = None
    steps_bound: str | None = None
    first_scale: Level | None = None
    last_scale: Level | None = None
    min_scale_seen: Level | None = None
    max_scale_seen: Level | None = None
    stopped: bool = False
    stop_reason: str | None = None
    grad_norm_nan: int = 0
    nan_not_skipped: int = 0
    every_step_skipped: bool = False
    steps_seen: int = 0
    at_minimum: bool = False
    near_minimum: bool = False
    minimum: float | None = None

    def to_json(self) -> dict[str, Any]:
        scale = {key: None if getattr(self, key) is None else getattr(self, key).to_json()
                 for key in ("first_scale", "last_scale", "min_scale_seen", "max_scale_seen")}
        return {"engine": self.engine, "wordings": sorted(self.wordings), "lines": self.lines,
                "overflows": self.overflows, "steps_known": self.steps_known,
                "steps_at_least": self.steps_at_least, "steps_bound": self.steps_bound, **scale,
                "stopped": self.stopped, "stop_reason": self.stop_reason, "grad_norm_nan": self.grad_norm_nan,
                "nan_not_skipped": self.nan_not_skipped, "every_step_skipped": self.every_step_skipped,
                "at_minimum": self.at_minimum, "near_minimum": self.near_minimum, "minimum": self.minimum}


@dataclasses.dataclass
class Trajectory:
    """What one engine's lines say: log points ``(step, scale, cumulative skipped)``, settings, words.

    ``replay`` gives the log points, in order, each time it is called (from the parser's records: a
    million log points are never held at once); ``levels`` every scale the log printed, each at its
    step or a bounded one. ``notes``: what the format leaves out and what was inferred; ``findings``:
    where the engine's own counters and its log disagree (each one sentence); ``verdicts``: what is wrong
    with the run, ``(rule, step, sentence)``, and ``always`` those the health rules cannot see (the others
    are added only where the rules found no problem).
    """

    engine: str
    replay: Callable[[], Iterator[Point]]
    lines: int
    notes: list[str] = dataclasses.field(default_factory=list)
    findings: list[str] = dataclasses.field(default_factory=list)
    growth_interval: int | None = None
    min_scale: float | None = None
    steps_known: bool = True
    skips_known: bool = True
    scale_known: bool = True
    facts: EngineFacts | None = None
    levels: Callable[[], Iterator[tuple[int, float]]] | None = None
    verdicts: list[tuple[str, int, str, bool]] = dataclasses.field(default_factory=list)

    @property
    def points(self) -> list[Point]:
        """Every log point at once (for a short log, and for tests)."""
        return list(self.replay())


def _lower_bound_steps(overflows: Iterable[tuple[float, float]], initial: float,
                       window: int | None, factor: float = 2.0) -> Iterator[tuple[int, float]]:
    """The least step each overflow can have been at, from the scales alone, with its scale after.

    ``overflows``: ``(attempted scale, scale after)`` per overflow line. Between two overflows the
    scale grew ``g`` times (attempted / scale before = factor**g), which takes at least ``g * window``
    good steps; each overflow is one step. Without a window only the overflows count.
    """
    at, scale = 0, initial
    for attempted, after in overflows:
        ratio = attempted / scale if attempted > 0 and scale > 0 else 1.0
        grown = round(math.log(ratio, factor)) if math.isfinite(ratio) else 0
        at += 1 + max(grown, 0) * (window or 0)
        yield at, after
        scale = after


_DATED = re.compile(r"^\s*(\d{4})-(\d\d)-(\d\d) ")
_ROUNDED_TO_4 = (2020, 8, 20)  # fairseq 83d701ac: the scale rounded to 4 decimals, no more the mean


def _dated(line: str) -> tuple[int, ...] | None:
    """The date fairseq's logger put before a line (since fb76dac1, 2020-01-16), as (year, month, day)."""
    dated = _DATED.match(line)
    return None if dated is None else tuple(map(int, dated.groups()))


def _fatal(line: str, match: re.Match[str] | None, start: int | None = None) -> str:
    """The fatal message as printed: from the exception's name before it (``FloatingPointError: ...``)
    to the end of the line."""
    begin = match.start() if match is not None else (start or 0)
    head = re.search(r"(?:\w+\.)*\w*(?:Error|Exception): $", line[:begin])
    return line[head.start() if head else begin:].strip()


class _Levels:
    """The scales a log printed, kept as they come: first, last, lowest and highest (exact levels first:
    a bound counts only where the log printed no exact level)."""

    def __init__(self) -> None:
        self.first: Level | None = None
        self.last: Level | None = None
        self.lows: dict[bool, Level] = {}
        self.highs: dict[bool, Level] = {}

    def add(self, level: Level | None) -> None:
        if level is None:
            return
        if self.first is None:
            self.first = level
        self.last = level
        kind = level.exact
        if kind not in self.lows or level.value < self.lows[kind].value:
            self.lows[kind] = level
        if kind not in self.highs or level.value > self.highs[kind].value:
            self.highs[kind] = level

    def lowest(self) -> Level | None:
        """The lowest level: an exact one, unless a rounded one is certainly lower (a bound where the log
        printed nothing exact)."""
        exact_, rounded = self.lows.get(True), self.lows.get(False)
        if exact_ is None or (rounded is not None and rounded.high < exact_.value):
            return rounded or exact_
        return exact_

    def highest(self) -> Level | None:
        exact_, rounded = self.highs.get(True), self.highs.get(False)
        if exact_ is None or (rounded is not None and rounded.below is None and rounded.low > exact_.value):
            return rounded or exact_
        return exact_


class _Parser:
    """One engine's line formats. ``markers``: substrings one of which each of its lines holds."""

    engine = ""
    engine_id = ""
    markers: tuple[str, ...] = ()
    uses_counters = False  # whether the terminal's counters (tqdm bars, Epoch: [e][i/n]) give its steps
    default_minimum: float | None = None

    def __init__(self) -> None:
        self.lines = 0
        self.line_counters: list[Counter] = []  # set by the reader before each feed
        self.line_index = 0  # the non-blank line being read (set by the reader)
        self.levels = _Levels()
        self.wordings: set[str] = set()
        self.stop_reason: str | None = None
        self.traceback = False  # a traceback came after this engine's lines
        self.grad_norm_bad = 0

    def feed(self, line: str) -> bool:
        """Read ``line`` if it is one of this engine's formats; whether it was."""
        raise NotImplementedError

    def ticks(self, counters: list[Counter]) -> None:
        """The counters of a line this parser was not fed."""

    def trajectory(self) -> Trajectory | None:
        """The log points read, or None when no line gave a loss scale."""
        raise NotImplementedError

    def saw_traceback(self) -> None:
        if self.lines and self.stop_reason is None:
            self.traceback = True

    def script_grad_norm(self) -> None:
        """A line of the training script (no engine's) printed a NaN or Inf gradient norm."""

    def _stop(self, reason: str) -> None:
        self.lines += 1
        self.stop_reason = reason

    def _minimum(self) -> float | None:
        """The engine's minimum scale, unless the log printed a scale below it (then it was set lower)."""
        minimum = self.min_scale if getattr(self, "min_scale", None) else self.default_minimum
        low = self.levels.lowest()
        if minimum is None or (low is not None and low.exact and low.value < minimum):
            return None
        return minimum

    def _stop_verdicts(self, at: int) -> list[tuple[str, int, str, bool]]:
        if self.stop_reason:
            words = f"The run stopped: {self.engine} printed '{self.stop_reason}'."
            return [("engine_stopped", at, words, True)]
        if self.traceback:
            return [("engine_stopped", at, f"The log ends in a Python traceback after {self.engine}'s last "
                     "loss-scale line: the run stopped (its error line is not in this log).", True)]
        return []

    def _scale_verdicts(self, facts: EngineFacts, at: int) -> list[tuple[str, int, str, bool]]:
        said = []
        last = facts.last_scale
        if facts.at_minimum:
            said.append(("stuck_at_minimum", at, f"Overflows at {self.engine}'s minimum loss scale "
                         f"({facts.minimum:g}): the scale is stuck there and every step at it is skipped.",
                         False))
        elif facts.near_minimum and last is not None:
            said.append(("near_minimum", at, f"The loss scale ended at {last.words()}, within three halvings "
                         f"of {self.engine}'s minimum ({facts.minimum:g}): a few more overflows and "
                         f"{self._at_minimum_words()}.", False))
        if last is not None and last.below is None and last.high < _FLOAT16_SMALLEST:
            said.append(("scale_underflow", at, f"The loss scale fell to {last.words()}, below float16's "
                         "smallest number (2^-24): every scaled loss is zero or the loss is not finite, so "
                         "the run no longer trains.", False))
        return said

    def _at_minimum_words(self) -> str:
        return "every step is skipped at the minimum"


# --------------------------------------------------------------------------------------------- Megatron

_ITERATION, _LOSS_SCALE = f.MEGATRON_ITERATION.search, f.MEGATRON_LOSS_SCALE.search
_SKIPPED, _NAN = f.MEGATRON_SKIPPED.search, f.MEGATRON_NAN.search
_QUOTED = 3  # disagreements quoted in words
_NOT_FINITE = ("nan", "inf", "-in")  # the first letters of a norm printed as nan, inf or -inf


class MegatronParser(_Parser):
    """Megatron-LM's (and Megatron-DeepSpeed's) ``training_log`` iteration lines and argument dump."""

    engine = "Megatron-LM"
    engine_id = "megatron"
    markers = ("loss scale", "loss_scale_window", "min_loss_scale", "number of skipped iterations",
               "found NaN in local grad norm")
    default_minimum = f.MEGATRON_DEFAULT_MIN_SCALE

    def __init__(self) -> None:
        super().__init__()
        self.records = Records(3)  # (iteration, scale, cumulative skipped)
        self.skipped = 0
        self._scale_text, self._scale = "", 0.0
        self.disagreements = 0
        self.disagree: list[str] = []  # the first few, in words
        self.settings: dict[str, float] = {}
        self._last_key: tuple[str | None, ...] | None = None
        self._last_step = -1
        self.repeated = 0
        self.counts_printed = False  # "number of skipped iterations" (since v2.0)
        self.nan_not_skipped = 0
        self.skipped_lines = 0  # lines with a skipped iteration
        self.at_minimum = 0
        self._pending = ""  # an iteration line a terminal wrapped, joined until its counts come
        self.recent: Iterable[str] = ()  # the lines before (set by the reader): where a wrapped line starts
        self.steps_seen = 0
        self.all_skipped = True

    @property
    def min_scale(self) -> float | None:
        return self.settings.get("min_loss_scale")

    def feed(self, line: str) -> bool:
        if "loss scale" not in line:
            if self._pending and "number of skipped iterations" in line:
                record, self._pending = self._pending + " | " + line, ""
                return self.iteration_line(record)
            match = f.MEGATRON_NAN_FATAL.search(line)
            if match:
                self._stop(_fatal(line, match))
                self.grad_norm_bad += 1
                self.wordings.add("megatron.nan-grad-norm-fatal")
                return True
            match = f.MEGATRON_ARG.search(line)
            if match:
                self.settings[match["arg"]] = float(match["value"])
            return match is not None
        if self.iteration_line(line):
            return True
        if _LOSS_SCALE(line) and not _ITERATION(line):  # a wrapped iteration line: its start came before
            before = list(self.recent)
            starts = [i for i, text in enumerate(before) if _ITERATION(text)]
            if starts:
                self._pending = " | ".join(text.strip() for text in [*before[starts[-1]:], line])
                self.wordings.add("wrapped")
                return True
        return False

    def iteration_line(self, line: str) -> bool:
        """Read ``line`` if it is an iteration line of ``training_log``; whether it was."""
        # At --log-interval 1 every line of a million is a log point: one search per field, and the
        # scale parsed once while it repeats (it mostly does).
        iteration = _ITERATION(line)
        if iteration is None:
            return False
        scale = _LOSS_SCALE(line)
        if scale is None:
            return False
        skipped_match = _SKIPPED(line)
        if skipped_match is None and "skipp" in line:
            return False  # its skips said in words no Megatron printed: not read, counted as unknown
        self.lines += 1
        # The same iteration line again (two log handlers, several ranks printing): read once, or its
        # skipped iterations would count twice and every copy would look like a restart.
        if skipped_match is not None:
            skipped_text, nan_text = skipped_match.group("skipped", "nan")  # nan iterations since 2020
        else:
            skipped_text = nan_text = None
        key = (iteration["iteration"], scale["scale"], skipped_text, nan_text)
        if key == self._last_key:
            self.repeated += 1
            return True
        self._last_key = key
        step = int(iteration["iteration"])
        last_step = self._last_step
        if step <= last_step:  # the iteration went back: a new run in the same log counts its own skips
            self.skipped = 0
        self._last_step = step
        skipped = int(skipped_text) if skipped_text is not None else 0
        if skipped_text is not None:
            self.counts_printed = True
            self.skipped += skipped
            if self.all_skipped:  # every step seen skipped, so far: the interval's steps counted
                interval = step - last_step if 0 <= last_step < step else step
                self.steps_seen += interval
                self.all_skipped = skipped >= interval
        norm = line.find("grad norm: ")
        if norm >= 0 and line[norm + 11:norm + 14] in _NOT_FINITE:
            self.grad_norm_bad += 1
            if skipped_text is not None and skipped == 0:
                self.nan_not_skipped += 1
        nan = int(nan_text) if nan_text is not None else 0
        if nan > skipped:
            self.disagreements += 1
            if len(self.disagree) < _QUOTED:
                self.disagree.append(f"iteration {iteration['iteration']}: {nan} NaN iteration(s) but "
                                     f"{skipped} skipped")
        text = scale["scale"]
        if text != self._scale_text:
            self._new_scale(text, line, skipped_text, norm >= 0)
        if skipped:
            self.skipped_lines += 1
            level = self._level
            if level is not None and level.exact and level.value == self.default_minimum:
                self.at_minimum += 1
        self.records.add(step, self._scale, self.skipped)
        return True

    def _new_scale(self, text: str, line: str, skipped_text: str | None, norm: bool) -> None:
        """A scale other than the last one (``training_log`` prints ``{:.1f}``): read, and its level kept."""
        level = printed(text, 1)
        self._scale_text, self._scale, self._level = text, (level.value if level else math.nan), level
        self.levels.add(level)
        self.wordings.add("megatron.loss-scale-colon" if "loss scale:" in line or skipped_text
                          else "megatron.loss-scale-2019")
        if skipped_text is not None:
            self.wordings.add("megatron.skipped-nan")
        if norm:
            self.wordings.add("megatron.grad-norm")

    def _replay(self) -> Iterator[Point]:
        for step, scale, skipped in self.records:
            yield int(step), scale, int(skipped)

    def _levels(self) -> Iterator[tuple[int, float]]:
        for step, scale, _ in self.records:
            yield int(step), scale

    def trajectory(self) -> Trajectory | None:
        if not self.records:
            return None
        notes = ["Megatron prints the skipped iterations of each log interval: the cumulative count is their "
                 "sum over this log, from where the iteration last went back (skips before that, in a "
                 "resumed run, are not known), and which iterations of an interval were skipped is not known"]
        if not self.counts_printed:
            notes = ["this Megatron prints no skipped iterations (before v2.0): skipped steps are not known"]
        if self.repeated:
            notes.append(f"{self.repeated} iteration line(s) repeated the one before them (the same "
                         "iteration, scale and counts: two log handlers, or several ranks printing): "
                         "read once")
        findings = []
        if self.disagreements:
            findings.append(
                f"Megatron's own counters disagree in {self.disagreements} log interval(s) "
                f"({'; '.join(self.disagree)}{'; ...' if self.disagreements > _QUOTED else ''}): an "
                "iteration with a NaN loss that was not counted as skipped may have applied NaN gradients "
                "(as in Megatron-LLM#33 and Megatron-DeepSpeed PR#434)")
        window = self.settings.get("loss_scale_window")
        facts = self._facts()
        at = self._last_step
        verdicts = self._stop_verdicts(at)
        if self.nan_not_skipped:
            verdicts.append(("nan_not_skipped", at, f"{self.nan_not_skipped} iteration(s) with a NaN "
                             "gradient norm were not skipped: their updates were applied "
                             "(as in Megatron-LLM#33).", True))
        if self.disagreements:
            verdicts.append(("nan_iterations_not_skipped", at, findings[0] + ".", True))
        if facts.every_step_skipped:
            verdicts.append(("every_step_skipped", at, f"Every one of the {facts.steps_seen} steps seen was "
                             "skipped.", True))
        verdicts += self._scale_verdicts(facts, at)
        return Trajectory(self.engine, self._replay, self.lines, notes, findings,
                          growth_interval=int(window) if window else None,
                          min_scale=self.settings.get("min_loss_scale"), skips_known=self.counts_printed,
                          facts=facts, verdicts=verdicts)

    def _facts(self) -> EngineFacts:
        minimum = self._minimum()
        last = self.levels.last
        dynamic = self.skipped_lines > 0  # bf16 prints a constant "loss scale: 1.0" with nothing skipped
        return EngineFacts(
            self.engine_id, set(self.wordings), self.lines, self.skipped if self.counts_printed else 0,
            steps_known=True, first_scale=self.levels.first, last_scale=last,
            min_scale_seen=self.levels.lowest(), max_scale_seen=self.levels.highest(),
            stopped=bool(self.stop_reason or self.traceback), stop_reason=self.stop_reason,
            grad_norm_nan=self.grad_norm_bad, nan_not_skipped=self.nan_not_skipped,
            every_step_skipped=self.counts_printed and self.all_skipped and self.steps_seen >= 2,
            steps_seen=self.steps_seen,
            at_minimum=bool(self.at_minimum) and minimum is not None,
            near_minimum=(dynamic and minimum is not None and last is not None
                          and last.value <= _NEAR * minimum),
            minimum=minimum)


# ----------------------------------------------------------------------------------- overflow engines

_NONE = math.nan  # a number the records hold where the log gave none
_OVERFLOW, _COUNTER, _GROWTH = 0.0, 1.0, 2.0
# An overflow's last field: no scale printed; the attempted scale printed; only the scale after printed
# (the attempted one known from the factor: apex, fairseq)
_UNSCALED, _PRINTED, _INFERRED = 1.0, 0.0, 2.0
_GROUP_LIMIT = 4096  # overflows held while waiting for the next counter (past that, placed at once)


class _OverflowParser(_Parser):
    """An engine whose overflow lines carry the scale, and whose progress lines or the terminal's counters
    (if any) the step.

    Every event goes to one :class:`~._records.Records` in the order read: an overflow ``(attempted,
    after, its own step)``, a counter ``(step, the engine's skipped count, the scale it printed)``, a
    growth the engine printed ``(before, after)``. The log points and the levels are placed from them
    when replayed (see the module).
    """

    initial: float | None = None
    window: int | None = None
    min_scale: float | None = None
    lower_bound = False  # the steps of the last progress line are a lower bound (skips before the log)

    def __init__(self) -> None:
        super().__init__()
        self.events = Records(5)  # (kind, a, b, c, d)
        self.scale: float | None = None
        self.overflow_count = 0
        self.counter_count = 0
        self.engine_counters = 0  # counters of the engine's own progress lines
        self.unscaled = 0  # overflow lines without a scale (DeepSpeed with a dtype other than fp16)
        self.at_minimum = 0
        self._first_attempted: float | None = None  # the first overflow's attempted scale
        self._last_after: float | None = None
        self._grown_after_first = 0  # overflows after the first that attempted more than the last after
        self._first_progress_scale: float | None = None
        self._last_progress: tuple[int, int, int] | None = None  # (step, skipped, overflows before)
        self._last_counter: int | None = None
        self._bar_total = 0
        # Whether the overflows came one after another (for a log with no counter): the line of the
        # last one and the lines of this engine read since.
        self._last_overflow_line: int | None = None
        self._consumed_since = 0
        self.consecutive = True
        self.grew = False  # a scale above the last one printed: good steps came between overflows
        self._shown = self._skipped_shown = 0  # steps whose outcome the counters show, and of those skipped
        self._since_counter = 0
        self._engine_skipped = 0
        # whether the overflows before the first counter came one after another (nothing between them)
        self._before_first_in_a_row = True
        self.script_bad_norms = 0  # NaN or Inf gradient norms the training script printed

    # ---------------------------------------------------------------- reading
    def ticks(self, counters: list[Counter]) -> None:
        for _, done, total, kind in counters:
            self._tick(done, total, kind)

    def _in_line_order(self, line: str, matches: list[tuple[int, Any]]) -> None:
        """The line's messages and the terminal's counters, each handled where it stands in the line."""
        for _, part in _parts(line, matches, self.line_counters):
            if isinstance(part, tuple):
                self._tick(*part)
            else:
                self._message(part)  # DeepSpeed's and apex's parsers (one match each)

    def _tick(self, done: int, total: int, kind: str) -> None:
        """A counter of the terminal: ``done`` steps done (a tqdm bar's smaller total is another bar)."""
        if not self.uses_counters:
            return
        if kind == "tqdm":
            if total < self._bar_total:
                return
            self._bar_total = total
        self._counter(done, None, None, engine=False)

    def _counter(self, step: int, skipped: int | None, scale: float | None, engine: bool,
                 since_start: bool = True) -> None:
        """A counter: ``step`` steps done; ``skipped``: the engine's count of skipped ones, which with
        ``since_start`` covers every step since the run started."""
        last = self._last_counter
        if last is not None and (step == last or (step < last and not engine)):
            return  # the bar printed again, or a counter behind the last one (another bar, a lagging print)
        # The steps whose outcome the counters show, and of those the skipped ones: an engine's progress
        # line counts both since the run started; between two counters of the terminal every step is shown,
        # and skipped where an overflow came between.
        if engine and skipped is not None and since_start:
            if last is None or step > last:
                self._shown += step - (last or 0) if last is not None else step
                self._skipped_shown += max(skipped - self._engine_skipped, 0)
            self._engine_skipped = skipped
        elif last is None:  # the overflows before the first counter: as in a log with none (see _facts)
            self._shown += self._since_counter
            self._skipped_shown += self._since_counter
            self._before_first_in_a_row = self._since_counter < 2 or (self.consecutive and not self.grew)
        elif step > last:
            gap = step - last
            self._shown += gap
            self._skipped_shown += min(self._since_counter, gap)
        self._since_counter = 0
        self._last_counter = step
        self.counter_count += 1
        self.engine_counters += engine
        self.events.add(_COUNTER, step, _NONE if skipped is None else skipped,
                        _NONE if scale is None else scale, 1.0 if engine else 0.0)

    def _consumed(self) -> None:
        self.lines += 1
        self._consumed_since += 1

    def _overflow(self, attempted: float | None, after: float | None, own_step: int | None = None,
                  level_after: Level | None = None, attempted_printed: bool = True) -> None:
        """One overflow (a skipped step): its attempted scale and the scale after (``after`` None: the line
        printed no scale, the scale is unchanged as far as is known)."""
        self.lines += 1
        shown = attempted is not None and attempted_printed
        if after is None:
            attempted = after = None
        else:
            before = self.scale if self.scale is not None else self.initial
            attempted_value = attempted if attempted is not None else (before or after)
            if self._first_attempted is None:
                self._first_attempted = attempted_value
            elif self._last_after is not None and attempted_value > self._last_after:
                self._grown_after_first += 1
            if attempted is not None and attempted_printed:
                if self.scale is not None and attempted > self.scale:
                    self.grew = True
                self.levels.add(exact(attempted))
            elif self.scale is not None and after > self.scale:
                self.grew = True
            self.levels.add(level_after or exact(after))
            minimum = self._minimum_value()
            if attempted is not None and attempted == after and minimum is not None and after <= minimum:
                self.at_minimum += 1
            self._last_after = after
            self.scale = after
            attempted = attempted_value
        self.overflow_count += 1
        self._since_counter += 1
        if self._last_overflow_line is not None and (
                self.line_index - self._last_overflow_line > self._consumed_since + 1):
            self.consecutive = False
        self._last_overflow_line = self.line_index
        self._consumed_since = 0
        self.events.add(_OVERFLOW, _NONE if attempted is None else attempted,
                        _NONE if after is None else after, _NONE if own_step is None else own_step,
                        _UNSCALED if after is None else _PRINTED if shown else _INFERRED)
        if own_step is not None:
            self._counter(own_step, None, None, engine=True)

    def _minimum_value(self) -> float | None:
        return self.min_scale if self.min_scale else self.default_minimum

    def _progress(self, step: int, skipped: int, scale: float | None = None,
                  level: Level | None = None, since_start: bool = True) -> None:
        self._consumed()
        if scale is not None:
            self.scale = scale
        self.levels.add(level if level is not None else (exact(scale) if scale is not None else None))
        at = self.scale
        if at is not None and self._first_progress_scale is None:
            self._first_progress_scale = at
        before = self.overflow_count
        self._counter(step, skipped, at, engine=True, since_start=since_start)
        self._last_progress = (step, skipped, before)

    # ---------------------------------------------------------------- replaying
    def _grown_unseen(self) -> int:
        """Overflow lines whose attempted scale shows a growth the log printed no line for."""
        first = (self._first_attempted is not None and self.initial is not None
                 and self._first_attempted > self.initial)
        return self._grown_after_first + first

    def _first_scale(self) -> float | None:
        if self.initial is not None:
            return self.initial
        return self._first_attempted if self._first_attempted is not None else self._first_progress_scale

    def _placed(self) -> Iterator[tuple[float, int, float, int, bool]]:
        """Every event with its step: ``(kind, step, scale, cumulative skipped, judged)``: a counter (a log
        point), an overflow (a log point only after the last counter or with none; between two counters
        it lies in the later one's interval)."""
        counters_left = self.counter_count
        if not counters_left:
            yield from self._unplaced()
            return
        last: int | None = None
        group: list[tuple[float, float]] = []
        skipped, scale = 0, self._first_scale() or 1.0
        for kind, a, b, c, d in self.events:
            if kind == _OVERFLOW:
                group.append((a, b, d))
                if counters_left == 0 or len(group) > _GROUP_LIMIT:  # after the last counter: placed now
                    start = last if last is not None else 0
                    for _, after, unscaled in group:
                        start, skipped = start + 1, skipped + 1
                        scale = scale if unscaled == _UNSCALED else after
                        yield kind, start, scale, skipped, True
                    last, group = start, []
            elif kind == _COUNTER:
                counters_left -= 1
                step = int(a)
                firsts = ([step - len(group) + 1 + i for i in range(len(group))] if last is None else
                          [min(last + 1 + i, step) for i in range(len(group))])
                for (_, after, unscaled), at in zip(group, firsts, strict=True):
                    skipped, scale = skipped + 1, scale if unscaled == _UNSCALED else after
                    yield _OVERFLOW, max(at, 1), scale, skipped, False
                group = []
                if not math.isnan(b):
                    skipped = int(b)  # the engine's own count
                if not math.isnan(c):
                    scale = c
                yield kind, step, scale, skipped, True
                last = step if last is None else max(last, step)
            else:  # a growth the engine printed
                scale = b

    def _unplaced(self) -> Iterator[tuple[float, int, float, int, bool]]:
        initial = self._first_scale() or 1.0
        known = [initial]

        def overflows() -> Iterator[tuple[float, float]]:
            for kind, a, b, _, unscaled in self.events:
                if kind == _OVERFLOW:
                    if unscaled == _UNSCALED:  # no scale printed: the last one known, kept
                        a = b = known[0]
                    known[0] = b
                    yield a, b
        count = 0
        for count, (step, after) in enumerate(_lower_bound_steps(overflows(), initial,
                                                                 self._placement_window()), start=1):
            yield _OVERFLOW, step, after, count, True
        if not count:  # nothing but the engine's fatal message: one log point, at no known step
            yield _OVERFLOW, 1, initial, 0, True

    def _placement_window(self) -> int | None:
        return self.window

    def _points(self) -> Iterator[Point]:
        for _kind, step, scale, skipped, judged in self._placed():
            if judged:
                yield step, scale, skipped

    def _levels(self) -> Iterator[tuple[int, float]]:
        """The scale at each placed event, and before each overflow the scale it attempted where the
        engine printed it (the level in effect up to it), one step earlier."""
        attempted = ((a if d == _PRINTED else _NONE) for kind, a, _, _, d in self.events if kind == _OVERFLOW)
        for kind, step, scale, _, _ in self._placed():
            if kind == _OVERFLOW:
                tried = next(attempted, _NONE)
                if math.isfinite(tried) and tried > 0:
                    yield max(step - 1, 0), tried
            yield step, scale

    def _unknown_steps_note(self) -> str:
        window = (f"{self.window} good steps (the growth interval) for each doubling of the scale between "
                  "two overflows, " if self.window else "")
        return (f"{self.engine} printed no step number here, and the log holds no step counter: the steps "
                "are not known; each overflow is placed at the least step it can have been at, a lower "
                f"bound (one step per overflow line, {window}none otherwise), and the skip rate is not known "
                "(at most the skipped steps over that bound)")

    def script_grad_norm(self) -> None:
        self.script_bad_norms += 1
        self.grad_norm_bad += 1

    def _grad_norm_verdicts(self, at: int) -> list[tuple[str, int, str, bool]]:
        """A non-finite gradient norm the training script printed: explained by the engine's overflows
        (those steps' gradients were not finite, and they were skipped) when it printed any, else a
        problem: nothing says those steps were skipped."""
        if not self.script_bad_norms or self.overflow_count:
            return []
        return [("nonfinite_grad_norm", at, f"{self.script_bad_norms} line(s) of the training script print "
                 f"a NaN or Inf gradient norm, and {self.engine} printed no overflow: nothing says those "
                 "steps were skipped (their updates may have been applied).", True)]

    def _common_findings(self) -> list[str]:
        findings = []
        if self.stop_reason:
            findings.append(f"the run stopped: {self.engine} printed '{self.stop_reason}'")
        if self.script_bad_norms and self.overflow_count:
            findings.append(f"{self.script_bad_norms} line(s) of the training script print a NaN or Inf "
                            f"gradient norm (or a running mean holding one): explained by {self.engine}'s "
                            f"{self.overflow_count} overflow(s), whose steps had non-finite gradients and "
                            "were skipped")
        if self.unscaled:
            findings.append(f"{self.unscaled} overflow line(s) gave no scale ({self.engine} prints it for "
                            "fp16 only): counted as skipped steps, the scale there is the last one known")
        return findings

    def trajectory(self) -> Trajectory | None:
        if not self.overflow_count and self._first_scale() is None and not self.stop_reason:
            return None  # progress lines alone, with no scale printed nor configured
        if self._first_scale() is None and not self.counter_count and not self.overflow_count and \
                not self.stop_reason:
            return None
        steps_known = bool(self.counter_count)
        if steps_known:
            notes = self._progress_notes()
            if self._since_counter > 1:
                notes.append(f"{self._since_counter} overflows after the log's last step counter are placed "
                             "one step each after it: the steps are a lower bound")
        else:
            notes = [self._unknown_steps_note()]
        if self.counter_count - self.engine_counters and self.engine_counters == 0:
            notes.append("steps from the terminal's counters (a progress bar or an epoch/batch counter): an "
                         "overflow between two of them is placed at the first steps after the earlier one")
        facts = self._facts(steps_known)
        last_step = self._last_step(steps_known)
        verdicts = self._stop_verdicts(last_step)
        if facts.every_step_skipped:
            how = ("" if steps_known else f" (the log prints no step counter: the steps it shows are its "
                   f"{facts.steps_seen} overflows, one after another)")
            verdicts.append(("every_step_skipped", last_step, f"Every one of the {facts.steps_seen} steps "
                             f"seen was skipped{how}.", True))
        verdicts += self._grad_norm_verdicts(last_step)
        verdicts += self._scale_verdicts(facts, last_step)
        return Trajectory(self.engine, self._points, self.lines, notes,
                          self._common_findings() + self._findings(),
                          growth_interval=self.window if steps_known else None, min_scale=self.min_scale,
                          steps_known=steps_known, scale_known=self._first_scale() is not None,
                          facts=facts, levels=self._levels, verdicts=verdicts)

    def _last_step(self, steps_known: bool) -> int:
        last = 0
        for step, _, _ in self._points():
            last = step
        return last

    def _facts(self, steps_known: bool) -> EngineFacts:
        minimum = self._minimum()
        last = self.levels.last
        at_least = None if steps_known else self._last_step(False)
        if steps_known:
            shown = self._shown + self._since_counter
            skipped_shown = self._skipped_shown + self._since_counter
            every = shown >= 2 and skipped_shown >= shown and self._before_first_in_a_row
        else:
            shown = skipped_shown = self.overflow_count
            every = shown >= 2 and self.consecutive and not self.grew
        stop = self.stop_reason is not None
        at_min = bool(self.at_minimum or (stop and self._stop_is_minimum)) and (minimum is not None or stop)
        return EngineFacts(
            self.engine_id, set(self.wordings), self.lines, self.overflow_count, steps_known=steps_known,
            steps_at_least=at_least,
            steps_bound="at least" if steps_known and (self._since_counter > 1 or self.lower_bound) else None,
            first_scale=self.levels.first, last_scale=last, min_scale_seen=self.levels.lowest(),
            max_scale_seen=self.levels.highest(), stopped=stop or self.traceback,
            stop_reason=self.stop_reason, grad_norm_nan=self.grad_norm_bad, every_step_skipped=every,
            steps_seen=shown, at_minimum=at_min,
            near_minimum=(self.overflow_count + self._dynamic_evidence() > 0 and minimum is not None
                          and last is not None and last.value <= _NEAR * minimum),
            minimum=minimum if minimum is not None else (self._stop_minimum if stop else None))

    _stop_is_minimum = False
    _stop_minimum: float | None = None

    def _dynamic_evidence(self) -> int:
        return 0

    def _progress_notes(self) -> list[str]:
        return []

    def _findings(self) -> list[str]:
        return []


def _number(text: str) -> float:
    return float(text)


def _power_of_two(value: float) -> float:
    """fairseq prints its stats with ``"{:g}"`` (six digits: 2**20 is ``1.04858e+06``); its scale is a
    power of two (init 2**7, factor 2), so a value within that rounding of one is that power."""
    if not (value > 0 and math.isfinite(value)):
        return value
    power = 2.0 ** round(math.log2(value))
    return power if abs(value - power) <= 5e-6 * power else value


def _parts(line: str, matches: list[tuple[int, Any]], counters: list[Counter]) -> list[tuple[int, Any]]:
    """Messages and counters of one line in the order they sit (a message glued after a bar comes after
    it)."""
    return sorted([*matches, *((position, (done, total, kind)) for position, done, total, kind in counters)],
                  key=lambda part: part[0])


# -------------------------------------------------------------------------------------------- DeepSpeed

_DEEPSPEED_PATTERNS = (("Skipping step.", f.DEEPSPEED_OVERFLOW), ("Overflow detected", f.DEEPSPEED_DETECTED),
                       ("Grad overflow on", f.DEEPSPEED_GRAD_OVERFLOW), ("scale from", f.DEEPSPEED_REDUCING),
                       ("scale from", f.DEEPSPEED_INCREASING), ("skipped=", f.DEEPSPEED_PROGRESS),
                       ("static loss scale", f.DEEPSPEED_STATIC))


class DeepSpeedParser(_OverflowParser):
    """DeepSpeed's overflow, hysteresis and progress lines of every release, its config dump, its fused
    optimizers' verbose lines, and its stop at the minimum."""

    engine = "DeepSpeed"
    engine_id = "deepspeed"
    markers = ("OVERFLOW!", "overflow!", "Overflow detected", "skipped=", f.DEEPSPEED_AT_MINIMUM,
               "initial_dynamic_scale", "dynamic_loss_scale_args", "Grad overflow on iteration",
               "dynamic loss scale from", "Using static loss scale", "Skipping step. Attempted")
    uses_counters = True
    default_minimum = f.DEEPSPEED_MIN_SCALE
    _stop_is_minimum = True
    _stop_minimum = f.DEEPSPEED_MIN_SCALE

    def __init__(self) -> None:
        super().__init__()
        self.hysteresis_lines = 0
        self.default_args = False
        self.static = False
        # The overflow being printed by the fused optimizers ("Grad overflow on iteration N", "Reducing
        # dynamic loss scale from A to B", "Overflow detected ... A, reducing to B": one overflow, by
        # every process): its iteration and scales; a new one starts at another iteration or scale.
        self._event: tuple[int | None, tuple[float, float] | None] | None = None
        # the last ZeRO message's rank and text
        self._last_rank: tuple[str | None, str, str | None] | None = None

    def feed(self, line: str) -> bool:
        matches: list[tuple[int, Any]] = []
        for words, pattern in _DEEPSPEED_PATTERNS:  # each pattern only where its words are
            if words in line:
                matches += [(m.start(), m) for m in pattern.finditer(line)]
        # "OVERFLOW! Skipping step." with neither DeepSpeed's tag nor a rank is an FP16_Optimizer's (apex's)
        matches = [(at, m) for at, m in matches
                   if m.re is not f.DEEPSPEED_OVERFLOW or m["tag"] or m["rank"]
                   or m["what"].startswith("fp16")]
        if not matches:
            if f.DEEPSPEED_AT_MINIMUM in line:
                self._stop(_fatal(line, None, line.index(f.DEEPSPEED_AT_MINIMUM)))
                self.wordings.add("deepspeed.at-minimum")
                return True
            return self._setting(line)
        self._in_line_order(line, matches)
        return True

    def _message(self, match: re.Match[str]) -> None:
        pattern = match.re
        if pattern is f.DEEPSPEED_OVERFLOW:
            self._zero_overflow(match)
        elif pattern is f.DEEPSPEED_PROGRESS:
            self._event = None
            self._last_rank = None
            self.wordings.add("deepspeed.progress")
            self._progress(int(match["step"]), int(match["skipped"]))
        elif pattern is f.DEEPSPEED_GRAD_OVERFLOW:
            self._iteration(int(match["iteration"]), static=bool(match["static"]))
        elif pattern is f.DEEPSPEED_STATIC:
            self._consumed()
            self.static = True
            self.wordings.add("deepspeed.fused.static")
            self.levels.add(exact(_number(match["scale"])))
            self.scale = _number(match["scale"])
            if self.initial is None:
                self.initial = self.scale
        elif pattern is f.DEEPSPEED_INCREASING:
            self._consumed()
            self.wordings.add("deepspeed.fused.growth")
            before, after = _number(match["before"]), _number(match["scale"])
            self.levels.add(exact(after))
            self.grew = True
            self.scale = after
            self.events.add(_GROWTH, before, after, _NONE, 0.0)
        else:  # "Reducing dynamic loss scale from A to B", "Overflow detected ... A, reducing to B"
            self._fused(match, detected=pattern is f.DEEPSPEED_DETECTED)

    def _iteration(self, iteration: int, static: bool) -> None:
        """``Grad overflow on iteration N``: one overflow, printed by every process (N counts from 0)."""
        if self._event is not None and self._event[0] == iteration:
            self._consumed()
            return
        self.wordings.add("deepspeed.fused.static" if static
                          else "deepspeed.fused.grad-overflow-on-iteration")
        self._event = (iteration, None)
        if static:  # the scale comes on the next line ("Using static loss scale of: X"), and stays
            self._overflow(None, None, own_step=iteration + 1)
        else:
            self._pending_iteration = iteration

    _pending_iteration: int | None = None

    def _fused(self, match: re.Match[str], detected: bool) -> None:
        attempted, after = _number(match["attempted"]), _number(match["scale"])
        self.wordings.add("deepspeed.fused.overflow-detected" if detected
                          else "deepspeed.fused.grad-overflow-on-iteration")
        event = self._event
        if event is not None and event[1] in (None, (attempted, after)):
            if event[1] is None:  # the iteration's overflow: now its scales are known
                self._event = (event[0], (attempted, after))
                iteration = self._pending_iteration
                self._pending_iteration = None
                self._overflow(attempted, after, own_step=None if iteration is None else iteration + 1)
                return
            self._consumed()  # another process printing the same overflow
            return
        self._event = (None, (attempted, after))
        self._overflow(attempted, after)

    def _setting(self, line: str) -> bool:
        match = f.DEEPSPEED_INITIAL_SCALE.search(line)
        if match:
            # The scaler's own init_scale (dynamic_loss_scale_args, printed first: the dump is sorted)
            # wins; with no args ZeRO's scaler starts at DynamicLossScaler's 2**32, not at this value.
            if self.initial is None and not self.overflow_count and not self.default_args:
                self.initial = _number(match["value"])
            return True
        match = f.DEEPSPEED_SCALE_ARGS.search(line)
        if match:
            args = match["value"]
            self.default_args = args == "None"
            window = re.search(r"'scale_window': (\d+)", args)
            self.window = int(window.group(1)) if window else 1000  # DynamicLossScaler's default
            least = re.search(rf"'min_scale': ({f._NUM})", args)
            self.min_scale = float(least.group(1)) if least else None
            start = re.search(rf"'init_scale': ({f._NUM})", args)
            self.initial = float(start.group(1)) if start and not self.overflow_count else self.initial
            return True
        return False

    def _zero_overflow(self, match: re.Match[str]) -> None:
        tag, what, rank = match["tag"], match["what"], match["rank"]
        if match["hysteresis"] is not None:
            self.wordings.add("deepspeed.hysteresis")
        if tag == "deepscale":
            self.wordings.add("deepspeed.deepscale-rank")
        elif what.startswith("fp16"):
            self.wordings.add("deepspeed.fp16-dynamic-overflow")
        elif match["attempted"] is None:
            self.wordings.add("deepspeed.overflow-no-scale")
        elif rank is None:
            self.wordings.add("deepspeed.overflow-v0.1")
        elif match["hysteresis"] is None:
            self.wordings.add("deepspeed.rank-overflow")
        # The same message of another rank, next to it, is the same overflow.
        text = match.group(0)
        body = text[text.index("Skipping"):]
        if self._last_rank is not None and rank is not None and self._last_rank[1] == body and \
                self._last_rank[0] != rank:
            self._consumed()
            return
        self._last_rank = (rank, body, None)
        self._event = None
        if match["attempted"] is None:
            self.unscaled += 1
            self._overflow(None, None)
        elif match["hysteresis"] is not None:  # skipped, the scale kept: hysteresis spent
            self.hysteresis_lines += 1
            attempted = _number(match["attempted"])
            self._overflow(attempted, attempted)
            self.at_minimum -= self.at_minimum > 0 and attempted <= (self._minimum_value() or 0)
        else:
            attempted, after = match["attempted"], match["scale"]
            self._overflow(_number(attempted), _number(after), level_after=self._int_printed(after))

    @staticmethod
    def _int_printed(text: str) -> Level | None:
        """A scale printed with ``int()`` (since v0.8.3): ``0`` is a scale below 1."""
        return printed(text, 0) if text == "0" else None

    def _placed(self) -> Iterator[tuple[float, int, float, int, bool]]:
        if self.window is None or not self.engine_counters:
            yield from super()._placed()
            return
        yield from self._placed_with_growth()

    def _placed_with_growth(self) -> Iterator[tuple[float, int, float, int, bool]]:
        """With the config's scale_window, the growths DeepSpeed prints no line for are inferred: every
        ``scale_window`` steps without an overflow (update_scale grows when ``(cur_iter -
        last_overflow_iter) % scale_window == 0``), counting from the end of the log interval that
        held the last overflow (its step is not printed): a lower bound on the scale."""
        scale, since, seen_overflow = self._first_scale(), 0, False
        # Before the first overflow the growths are counted only from a known initial scale (the
        # first overflow's attempted scale, used otherwise, already holds them).
        counted = self.initial is not None
        pending: list[float] = []
        skipped = 0
        last = None
        for kind, step, point_scale, point_skipped, judged in super()._placed():
            if kind == _OVERFLOW and not judged:
                pending.append(point_scale)
                yield kind, step, point_scale, point_skipped, judged
                continue
            if kind == _COUNTER and judged:
                if pending:
                    scale, since, seen_overflow = pending[-1], step, True
                    pending = []
                grown = (step - since) // self.window if seen_overflow or counted else 0
                last, skipped = step, point_skipped
                yield kind, step, (scale or 1.0) * 2.0**grown, point_skipped, judged
            else:
                scale, since, seen_overflow = point_scale, step, True
                yield kind, step, point_scale, point_skipped, judged
        del last, skipped

    def _progress_notes(self) -> list[str]:
        if not self.engine_counters or self.engine_counters == self.overflow_count:
            return []
        grown = self._grown_unseen()
        words = ("DeepSpeed prints no line when the scale grows: the scale at each log point is the last one "
                 "an overflow line gave (before the first, the first overflow's attempted scale or the "
                 "config's initial_dynamic_scale)")
        if self.window is not None:
            words += (f", grown once every {self.window} steps without an overflow (the config's "
                      "scale_window; each overflow taken at the end of its log interval, so a lower bound)")
        if grown and self.window is None:
            words += (f"; {grown} overflow line(s) attempted a larger scale than the last one printed, so "
                      "the scale grew unseen before them: log points between show the lower, last printed "
                      "scale")
        return [words]

    def _findings(self) -> list[str]:
        last_step, counted, lines_before = self._last_progress or (0, 0, 0)
        if self._last_progress and counted != lines_before:
            return [f"DeepSpeed's own skipped counter says {counted} at step {last_step}, but the log holds "
                    f"{lines_before} overflow line(s) before that line (lines of another rank, or a log that "
                    "starts mid-run)"]
        return []

    def _at_minimum_words(self) -> str:
        return "DeepSpeed stops the run ('Current loss scale already at minimum')"

    def _facts(self, steps_known: bool) -> EngineFacts:
        facts = super()._facts(steps_known)
        if self.static:  # a static scale never comes near a minimum
            facts.near_minimum = facts.at_minimum = False
        return facts


# --------------------------------------------------------------------------------------------------- apex

class ApexParser(_OverflowParser):
    """apex amp's and FP16_Optimizer's overflow lines of every release (and the copies of its
    FP16_Optimizer in Megatron-LM 2019 and NVIDIA's tacotron2); its steps from the terminal's counters."""

    engine = "apex"
    engine_id = "apex"
    markers = ("Gradient overflow", "OVERFLOW!", "OVERFLOW within closure!", "loss_scale  ",
               "Selected optimization level")
    uses_counters = True

    def __init__(self) -> None:
        super().__init__()
        self.other_scalers = 0
        self.banner = False
        self.repeated = 0  # identical messages in a row: several processes print every overflow
        self._last_message: str | None = None
        self._halving_only = True  # only the attempted scale printed: the scale after is it halved

    def feed(self, line: str) -> bool:
        matches: list[tuple[int, Any]] = []
        for pattern in (f.APEX_AMP_OVERFLOW, f.APEX_REDUCING, f.APEX_ATTEMPTED):
            matches += [(m.start(), m) for m in pattern.finditer(line)]
        if f.APEX_OLD_AMP in line:
            matches += [(line.index(f.APEX_OLD_AMP), None)]
        if not matches:
            if f.APEX_BANNER.search(line):
                self.banner = True
                self.wordings.add("apex.amp.banner")
                return True
            return False
        if "[deepspeed]" in line or "[deepscale]" in line or ("Rank" in line and "Skipping step." in line):
            return False  # DeepSpeed's
        matches = _drop_overlaps(matches)
        self._in_line_order(line, matches)
        return True

    def _message(self, match: re.Match[str] | None) -> None:
        if match is None:  # amp.init's "Gradient overflow, skipping update": no scale printed
            self.wordings.add("apex.amp.old-handle")
            self._overflow(None, None)
            return
        text = re.sub(r"\s+", " ", match.group(0))
        if text == self._last_message and self._last_overflow_line is not None and \
                self.line_index - self._last_overflow_line <= 1:
            self.repeated += 1
        self._last_message = text
        if match.re is f.APEX_AMP_OVERFLOW:
            if match["scaler"] != "0":  # amp keeps one scaler per loss: the series follows loss scaler 0
                self._consumed()
                self.other_scalers += 1
                return
            self.initial, self.window = f.APEX_AMP_INITIAL, f.APEX_AMP_WINDOW
            self.wordings.add("apex.amp.loss-scaler")
            self._halved(_number(match["scale"]))
        elif match.re is f.APEX_REDUCING:
            self.initial, self.window = f.APEX_FP16_INITIAL, f.APEX_FP16_WINDOW
            self.wordings.add("apex.gradient-overflow" if match["gradient"]
                              else "apex.fp16_optimizer.2019-02")
            self._halved(_number(match["scale"]))
        else:  # "OVERFLOW! Skipping step. Attempted loss scale: A[, reducing to B]"
            self.initial, self.window = f.APEX_FP16_INITIAL, f.APEX_FP16_WINDOW
            attempted = _number(match["attempted"])
            if match["scale"] is None:
                self.wordings.add("apex.fp16_optimizer.attempted-only")
                self._overflow(attempted, attempted / 2.0)  # the copy halves by 2 and prints no more
            else:
                self.wordings.add("apex.fp16_optimizer.closure.2018" if match["closure"]
                                  else "apex.fp16_optimizer.2018")
                self._overflow(attempted, _number(match["scale"]))

    def _halved(self, after: float) -> None:
        before = self.scale if self.scale is not None else self.initial
        # apex halves the scale and prints only the new one; the same scale again is the minimum clamp,
        # another process printing the same overflow, or a growth and a halving (then no growth is counted,
        # which keeps the steps a lower bound)
        self._overflow(after if after == before else after * 2.0, after, attempted_printed=False)

    def _findings(self) -> list[str]:
        said = []
        if self.other_scalers:
            said.append(f"{self.other_scalers} overflow line(s) of apex loss scalers other than 0 (one per "
                        "loss) are counted here only: the series follows loss scaler 0")
        if self.repeated:
            said.append(f"{self.repeated} message(s) repeat the one right before them: amp prints every "
                        "overflow in every process, so identical messages in a row may be one overflow seen "
                        "by several processes (each is counted as a skipped step here)")
        return said


def _drop_overlaps(matches: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Matches of several patterns over one message: the first (the longest at one place) is kept."""
    kept: list[tuple[int, Any]] = []
    end = -1
    for position, match in sorted(matches, key=lambda m: (m[0], -(m[1].end() if m[1] is not None else 0))):
        if position < end:
            continue
        kept.append((position, match))
        end = match.end() if match is not None else position + len(f.APEX_OLD_AMP)
    return kept


# ------------------------------------------------------------------------------------------------ fairseq

_TRAIN_LINE = re.compile(r'(?<![A-Za-z])lr(?:=|": "| )')  # a training line (validation lines have no lr)
_FAIRSEQ_TQDM = re.compile(r"\bepoch (?P<epoch>\d+):\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)\s+\[")


class FairseqParser(_OverflowParser):
    """fairseq's overflow lines of every release (fp16 and --amp), its progress lines (simple, end of epoch,
    JSON, tqdm), its config and its stops."""

    engine = "fairseq"
    engine_id = "fairseq"
    markers = ("overflow detected", "Minimum loss scale reached", "num_updates", "'fp16_scale_window'",
               "gradients are Nan/Inf")
    default_minimum = f.FAIRSEQ_DEFAULT_MIN_SCALE
    _stop_minimum = f.FAIRSEQ_DEFAULT_MIN_SCALE

    def __init__(self) -> None:
        super().__init__()
        self.means = 0  # progress scales that are an interval's mean (no level)
        self.lower_bound = False
        self._epoch1_skipped: int | None = None

    def feed(self, line: str) -> bool:
        matches: list[tuple[int, Any]] = []
        for pattern in (f.FAIRSEQ_OVERFLOW, f.FAIRSEQ_AMP_OVERFLOW):
            matches += [(m.start(), m) for m in pattern.finditer(line)]
        updates = f.FAIRSEQ_NUM_UPDATES.search(line)
        train = _TRAIN_LINE.search(line) and "valid" not in line
        if updates and (f.FAIRSEQ_LOSS_SCALE.search(line) or train):
            matches.append((updates.start(), updates))
        for _, match in sorted(matches, key=lambda m: m[0]):
            self._message(match, line)
        if matches:
            return True
        match = f.FAIRSEQ_AT_MINIMUM.search(line)
        if match:
            self._stop(_fatal(line, match))
            self._stop_is_minimum = True
            self._stop_minimum = _number(match["scale"])
            self.wordings.add("fairseq.amp-minimum" if match["amp"] else "fairseq.minimum")
            return True
        if f.FAIRSEQ_NAN_GRADIENTS in line:
            self._stop(_fatal(line, None, line.index("gradients are Nan/Inf")))
            self.grad_norm_bad += 1
            self.wordings.add("fairseq.nan-gradients")
            return True
        if updates:
            return False  # a validation or bf16 line: no loss scale in it
        return self._setting(line)

    def _message(self, match: re.Match[str], line: str) -> None:
        if match.re is f.FAIRSEQ_AMP_OVERFLOW:
            self.wordings.add("fairseq.amp-overflow")
            self._fairseq_overflow(match)
        elif match.re is f.FAIRSEQ_OVERFLOW:
            self.wordings.add("fairseq.warning-overflow" if match["warning"]
                              else "fairseq.note-gradient-overflow" if match["gradient"]
                              else "fairseq.note-overflow")
            self._fairseq_overflow(match)
        else:
            self._progress_line(line, int(match["value"]))

    def _fairseq_overflow(self, match: re.Match[str]) -> None:
        after = _number(match["scale"])
        # fairseq prints the scale after the overflow only; it divides by its scale factor (2.0).
        self._overflow(after * 2.0, after, attempted_printed=False)

    def _progress_line(self, line: str, num_updates: int) -> None:
        scale_match = f.FAIRSEQ_LOSS_SCALE.search(line)
        scale_text = scale_match["value"] if scale_match else None
        level = printed(scale_text, decimals_of(scale_text)) if scale_text else None
        if scale_text is None:  # a training line with no loss scale (bf16, fp32): its steps only
            scale = self.scale
        elif level is None:
            self.means += 1  # an interval's mean (fairseq 2020-01 to 2020-08): the scale is the last level
            self.wordings.add("fairseq.scale.interval-mean")
            scale = self.scale
        else:
            scale = level.value
            printed_as = self._scale_wording(line, scale_text, level)
            if printed_as is not None:
                self.wordings.add(printed_as)
        self.wordings.add(self._progress_wording(line))
        skipped = self.overflow_count
        step = num_updates + skipped
        count = self._epoch1_count(line)
        since_start = count is not None and count >= step
        if since_start:  # epoch 1: the bar counts the updates attempted since the run started
            skipped, step = count - num_updates, count
        self.lower_bound = not since_start  # else overflows before this log are not known
        self._progress(step, skipped, scale, level, since_start=since_start)

    @staticmethod
    def _scale_wording(line: str, text: str, level: Level) -> str | None:
        """How the scale was printed: to 3 decimals (until 2020-01-11), the interval's mean rounded to an
        integer (to 2020-08-19), the last value rounded to 4 decimals (since). A line fairseq's logger dated
        (since 2020-01-16) is of one of the last two by its date; an undated one by its digits (None:
        either)."""
        era = _dated(line)
        if era is not None:
            return "fairseq.scale.interval-mean" if era < _ROUNDED_TO_4 else "fairseq.scale.4-decimals"
        decimals = decimals_of(text)
        if decimals == 3:
            return "fairseq.scale.3-decimals"
        if decimals == 4:
            return "fairseq.scale.4-decimals"
        return None if level.exact else "fairseq.scale.interval-mean"

    @staticmethod
    def _progress_wording(line: str) -> str:
        if '"train_num_updates"' in line:
            return "fairseq.progress.json-epoch"
        if _FAIRSEQ_TQDM.search(line):
            return "fairseq.progress.tqdm"
        return "fairseq.progress.simple" if f.FAIRSEQ_EPOCH_COUNTER.search(line) else "fairseq.progress.epoch"

    @staticmethod
    def _epoch1_count(line: str) -> int | None:
        """In epoch 1 the progress bar's count is of updates attempted since the run started: printed as
        the index from 0 by the print-era bar (``| epoch 001:    200 / 1374``, until 2020-03), else the
        count."""
        bar = _FAIRSEQ_TQDM.search(line)
        if bar and int(bar["epoch"]) == 1:
            return int(bar["n"])
        simple = f.FAIRSEQ_EPOCH_COUNTER.search(line)
        if simple is None or int(simple["epoch"]) != 1:
            return None
        index = int(simple["i"])
        return index + 1 if line.lstrip().startswith("| epoch") else index

    def _setting(self, line: str) -> bool:
        window = f.FAIRSEQ_SCALE_WINDOW.search(line)
        if window is None:
            return False
        self.window = None if window["value"] == "None" else int(window["value"])
        least = f.FAIRSEQ_MIN_SCALE.search(line)
        if least:
            self.min_scale = float(least["value"])
        return True

    def _dynamic_evidence(self) -> int:
        return self.engine_counters  # fairseq's scale starts at 128: a low one printed came from overflows

    def _at_minimum_words(self) -> str:
        return "fairseq stops the run (FloatingPointError: Minimum loss scale reached)"

    def _progress_notes(self) -> list[str]:
        said = ["fairseq's num_updates counts applied updates only: the steps attempted are num_updates plus "
                "the overflow lines before each progress line (in epoch 1, the progress bar's count of "
                "updates attempted where it is higher; overflows before this log's first line, in a resumed "
                "run, are not known); its loss_scale is the scale of the interval's last update, printed "
                "rounded (read as the power of two it rounds from)"]
        if self.means:
            said.append(f"{self.means} progress line(s) print the interval's mean scale (fairseq from "
                        "2020-01 to 2020-08 averaged it): no level, the scale there is the last one known")
        return said


# --------------------------------------------------------------------------------- the Trainer's console

class TrainerConsoleParser(_OverflowParser):
    """The Transformers Trainer's console: its logs as dicts (``{'loss': ..., 'grad_norm': nan, ...}``) and
    its progress bar. It prints no loss scale; a non-finite ``grad_norm`` is a step fp16's GradScaler
    skipped, or one whose update bf16 and fp32 applied."""

    engine = "the Transformers Trainer"
    engine_id = "transformers"
    markers = ("'grad_norm':", "{'loss':", "{'train_runtime'")
    uses_counters = True

    def __init__(self) -> None:
        super().__init__()
        self.logs = 0
        self.bad_logs = 0

    def feed(self, line: str) -> bool:
        if "'loss':" not in line and "'grad_norm':" not in line:
            return False
        self.ticks(self.line_counters)
        self._consumed()
        self.logs += 1
        match = f.TRAINER_GRAD_NORM.search(line)
        if match is None:
            self.wordings.add("transformers.console-dict-old")
            return True
        self.wordings.add("transformers.console-dict-str" if "'grad_norm': '" in line
                          else "transformers.console-dict")
        value = float(match["value"].replace("Infinity", "inf").replace("NaN", "nan"))
        if not math.isfinite(value):
            self.bad_logs += 1
            self.grad_norm_bad += 1
        return True

    def trajectory(self) -> Trajectory | None:
        if not self.bad_logs:
            return None
        steps_known = bool(self.counter_count)
        last = self._last_counter or 0
        facts = EngineFacts(self.engine_id, set(self.wordings), self.lines, 0, steps_known=steps_known,
                            grad_norm_nan=self.bad_logs, stopped=self.traceback)
        words = (f"{self.bad_logs} of the {self.logs} logs the Trainer printed show a non-finite gradient "
                 "norm (NaN or Inf): with fp16's GradScaler those steps were skipped; under bf16 or fp32 "
                 "their updates were applied.")
        verdicts = [("nonfinite_grad_norm", last, words, True), *self._stop_verdicts(last)]
        notes = ["the Trainer prints no loss scale: the report holds no scale, and skipped steps are not "
                 "known"]
        points = ((lambda: self._points()) if steps_known
                  else (lambda: iter([(i + 1, 1.0, 0) for i in range(self.logs)])))
        return Trajectory(self.engine, points, self.lines, notes, steps_known=steps_known, skips_known=False,
                          scale_known=False, facts=facts, verdicts=verdicts)

    def _first_scale(self) -> float | None:
        return 1.0  # no scale: a placeholder the report does not show


PARSERS: tuple[type[_Parser], ...] = (MegatronParser, DeepSpeedParser, FairseqParser, ApexParser,
                                      TrainerConsoleParser)
