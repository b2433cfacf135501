"""One parser per engine: its loss-scale lines (see :mod:`._engine_formats`) turned into log points.

A parser is fed every line that holds one of its ``markers`` and says whether the line was one of its
formats. What it reads goes into :class:`~._records.Records` (compact, and past a bound in a
temporary file), since a log point's meaning may depend on lines read later (a setting printed late,
the first overflow's scale). At the end, :meth:`_Parser.trajectory` gives the run's log points
``(step, scale, cumulative skipped steps)``, replayed from those records as often as asked, and what
the format left out, in words. Each engine's own semantics decide the step axis (optimizer steps
attempted, skipped ones included):

* Megatron-LM: the iteration printed (it counts skipped iterations); skips are per log interval.
* DeepSpeed: ``step=N, skipped=K`` progress lines; the scale from the overflow lines (none when it grows).
* fairseq: ``num_updates`` counts applied updates only, so the overflow lines are added back.
* apex (and engine logs without progress lines): no step number at all; a lower bound is inferred.

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

from lossscale_callbacks.report import _engine_formats as f
from lossscale_callbacks.report._records import Records

__all__ = ["PARSERS", "ApexParser", "DeepSpeedParser", "FairseqParser", "MegatronParser", "Trajectory"]

Point = tuple[int, float, int]


@dataclasses.dataclass
class Trajectory:
    """What one engine's lines say: log points ``(step, scale, cumulative skipped)``, settings, words.

    ``replay`` gives the log points, in order, each time it is called (from the parser's records: a
    million log points are never held at once). ``notes``: what the format leaves out and what was
    inferred; ``findings``: where the engine's own counters and its log disagree, or the run stopped
    (each one sentence).
    """

    engine: str
    replay: Callable[[], Iterator[Point]]
    lines: int
    notes: list[str] = dataclasses.field(default_factory=list)
    findings: list[str] = dataclasses.field(default_factory=list)
    growth_interval: int | None = None
    min_scale: float | None = None
    steps_known: bool = True

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


class _Parser:
    """One engine's line formats. ``markers``: substrings one of which each of its lines holds."""

    engine = ""
    markers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.lines = 0

    def feed(self, line: str) -> bool:
        """Read ``line`` if it is one of this engine's formats; whether it was."""
        raise NotImplementedError

    def trajectory(self) -> Trajectory | None:
        """The log points read, or None when no line gave a loss scale."""
        raise NotImplementedError


_ITERATION, _LOSS_SCALE = f.MEGATRON_ITERATION.search, f.MEGATRON_LOSS_SCALE.search
_SKIPPED, _NAN = f.MEGATRON_SKIPPED.search, f.MEGATRON_NAN.search
_QUOTED = 3  # disagreements quoted in words


class MegatronParser(_Parser):
    """Megatron-LM's (and Megatron-DeepSpeed's) ``training_log`` iteration lines and argument dump."""

    engine = "Megatron-LM"
    markers = ("loss scale:", "loss_scale_window", "min_loss_scale")

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

    def feed(self, line: str) -> bool:
        if "loss scale:" not in line:
            match = f.MEGATRON_ARG.search(line)
            if match:
                self.settings[match["arg"]] = float(match["value"])
            return match is not None
        # At --log-interval 1 every line of a million is a log point: one search per field, and the
        # scale parsed once while it repeats (it mostly does).
        iteration = _ITERATION(line)
        if iteration is None:
            return False
        scale = _LOSS_SCALE(line)
        if scale is None:
            return False
        skipped_match = _SKIPPED(line)
        if skipped_match is None:
            return False
        self.lines += 1
        nan_match = _NAN(line)  # printed since 2020; older logs lack it
        # The same iteration line again (two log handlers, several ranks printing): read once, or its
        # skipped iterations would count twice and every copy would look like a restart.
        nan_text = nan_match["nan"] if nan_match else None
        key = (iteration["iteration"], scale["scale"], skipped_match["skipped"], nan_text)
        if key == self._last_key:
            self.repeated += 1
            return True
        self._last_key = key
        step = int(iteration["iteration"])
        if step <= self._last_step:  # the iteration went back: a new run in the same log counts its own skips
            self.skipped = 0
        self._last_step = step
        skipped = int(skipped_match["skipped"])
        if skipped:
            self.skipped += skipped
        nan = int(nan_text) if nan_text is not None else 0
        if nan > skipped:
            self.disagreements += 1
            if len(self.disagree) < _QUOTED:
                self.disagree.append(f"iteration {iteration['iteration']}: {nan} NaN iteration(s) but "
                                     f"{skipped} skipped")
        text = scale["scale"]
        if text != self._scale_text:
            self._scale_text, self._scale = text, float(text)
        self.records.add(step, self._scale, self.skipped)
        return True

    def _replay(self) -> Iterator[Point]:
        for step, scale, skipped in self.records:
            yield int(step), scale, int(skipped)

    def trajectory(self) -> Trajectory | None:
        if not self.records:
            return None
        notes = ["Megatron prints the skipped iterations of each log interval: the cumulative count is their "
                 "sum over this log, from where the iteration last went back (skips before that, in a "
                 "resumed run, are not known), and which iterations of an interval were skipped is not known"]
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
        return Trajectory(self.engine, self._replay, self.lines, notes, findings,
                          growth_interval=int(window) if window else None,
                          min_scale=self.settings.get("min_loss_scale"))


_NONE = math.nan  # a number the records hold where the log gave none (paired with a flag: NaN is also read)


class _OverflowParser(_Parser):
    """An engine whose overflow lines carry the scale, and whose progress lines (if any) the step.

    What the points need from lines read later (the first overflow's scale, the last setting) is
    kept as it comes; the lines themselves go to two :class:`~._records.Records`.
    """

    initial: float | None = None
    window: int | None = None
    min_scale: float | None = None

    def __init__(self) -> None:
        super().__init__()
        self.overflows = Records(2)  # (attempted, after) per overflow line
        # (step, skipped, overflow lines before it, the last one's scale after, scale printed?, the scale)
        self.progress = Records(6)
        self.scale: float | None = None
        self.stopped: str | None = None
        self.unscaled = 0  # overflow lines without a scale (DeepSpeed with a dtype other than fp16)
        self._first_attempted: float | None = None  # the first overflow's attempted scale
        self._last_after: float | None = None
        self._grown_after_first = 0  # overflows after the first that attempted more than the last after
        self._first_progress_scale: float | None = None
        self._last_progress: tuple[int, int, int] | None = None  # (step, skipped, overflow lines before)

    def _record_overflow(self, attempted: float, after: float) -> None:
        if self._first_attempted is None:
            self._first_attempted = attempted
        elif self._last_after is not None and attempted > self._last_after:
            self._grown_after_first += 1
        self._last_after = after
        self.overflows.add(attempted, after)

    def _overflow(self, attempted: float | None, after: float) -> None:
        self.lines += 1
        before = self.scale if self.scale is not None else self.initial
        self._record_overflow(attempted if attempted is not None else (before or after), after)
        self.scale = after

    def _progress(self, step: int, skipped: int, scale: float | None = None) -> None:
        self.lines += 1
        if scale is not None:
            self.scale = scale
        at = self.scale
        if at is not None and self._first_progress_scale is None:
            self._first_progress_scale = at
        before = len(self.overflows)
        last_after = self._last_after if self._last_after is not None else _NONE
        self.progress.add(step, skipped, before, last_after, at is not None, _NONE if at is None else at)
        self._last_progress = (step, skipped, before)

    def _grown_unseen(self) -> int:
        """Overflow lines whose attempted scale shows a growth the log printed no line for."""
        first = (self._first_attempted is not None and self.initial is not None
                 and self._first_attempted > self.initial)
        return self._grown_after_first + first

    def _first_scale(self) -> float | None:
        if self.initial is not None:
            return self.initial
        return self._first_attempted if self._first_attempted is not None else self._first_progress_scale

    def _progress_points(self) -> Iterator[Point]:
        first = self._first_scale()
        for step, skipped, _, _, printed, scale in self.progress:
            yield int(step), scale if printed else first, int(skipped)

    def _overflow_points(self) -> Iterator[Point]:
        initial = self._first_scale() or 1.0
        for i, (step, after) in enumerate(_lower_bound_steps(self.overflows, initial, self.window)):
            yield step, after, i + 1

    def _unknown_steps_note(self) -> str:
        window = (f"{self.window} good steps (the growth interval) for each doubling of the scale between "
                  "two overflows, " if self.window else "")
        return (f"{self.engine} printed no step number here: each overflow's step is a lower bound (one "
                f"step per overflow line, {window}none otherwise), steps after the last overflow are not "
                "known, and the skip rate is an upper bound")

    def _common_findings(self) -> list[str]:
        findings = [self.stopped] if self.stopped else []
        if self.unscaled:
            findings.append(f"{self.unscaled} overflow line(s) gave no scale ({self.engine} prints it for "
                            "fp16 only): counted as skipped steps, the scale there is the last one known")
        return findings

    def trajectory(self) -> Trajectory | None:
        if not self.overflows and self._first_scale() is None:
            return None  # progress lines alone, with no scale printed nor configured
        if self.progress:
            replay, steps_known = self._progress_points, True
            notes = self._progress_notes()
        else:
            replay, steps_known = self._overflow_points, False
            notes = [self._unknown_steps_note()]
        return Trajectory(self.engine, replay, self.lines, notes,
                          self._common_findings() + self._findings(),
                          growth_interval=self.window if self.progress else None, min_scale=self.min_scale,
                          steps_known=steps_known)

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


class DeepSpeedParser(_OverflowParser):
    """DeepSpeed's overflow, hysteresis and progress lines, its config dump, and its stop at the minimum."""

    engine = "DeepSpeed"
    markers = ("OVERFLOW!", "overflow!", "Overflow detected", "skipped=", f.DEEPSPEED_AT_MINIMUM,
               "initial_dynamic_scale", "dynamic_loss_scale_args")

    def __init__(self) -> None:
        super().__init__()
        self.hysteresis_lines = 0
        self.default_args = False

    def feed(self, line: str) -> bool:
        match = f.DEEPSPEED_OVERFLOW.search(line)
        if match:
            self._deepspeed_overflow(match)
            return True
        match = f.DEEPSPEED_FP16_OVERFLOW.search(line)
        if match:
            self._overflow(_number(match["attempted"]), _number(match["scale"]))
            return True
        match = f.DEEPSPEED_PROGRESS.search(line)
        if match:
            self._progress(int(match["step"]), int(match["skipped"]))
            return True
        if f.DEEPSPEED_AT_MINIMUM in line:
            self.lines += 1
            self.stopped = ("the run stopped: DeepSpeed raised 'Current loss scale already at minimum' (an "
                            "overflow at the minimum scale, with raise_error_at_min_scale)")
            return True
        return self._setting(line)

    def _setting(self, line: str) -> bool:
        match = f.DEEPSPEED_INITIAL_SCALE.search(line)
        if match:
            # The scaler's own init_scale (dynamic_loss_scale_args, printed first: the dump is sorted)
            # wins; with no args ZeRO's scaler starts at DynamicLossScaler's 2**32, not at this value.
            if self.initial is None and not self.overflows and not self.default_args:
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
            self.initial = float(start.group(1)) if start and not self.overflows else self.initial
            return True
        return False

    def _deepspeed_overflow(self, match: re.Match[str]) -> None:
        if match["attempted"] is None:
            self.lines += 1
            self.unscaled += 1
            known = self.scale or self.initial or 1.0
            self._record_overflow(known, known)
        elif match["hysteresis"] is not None:  # skipped, the scale kept: hysteresis spent
            self.hysteresis_lines += 1
            attempted = _number(match["attempted"])
            self._overflow(attempted, attempted)
        else:
            self._overflow(_number(match["attempted"]), _number(match["scale"]))

    def _progress_points(self) -> Iterator[Point]:
        """With the config's scale_window, the growths DeepSpeed prints no line for are inferred: every
        ``scale_window`` steps without an overflow (update_scale grows when ``(cur_iter -
        last_overflow_iter) % scale_window == 0``), counting from the end of the log interval that
        held the last overflow (its step is not printed): a lower bound on the scale."""
        if self.window is None:
            yield from super()._progress_points()
            return
        scale, since, seen = self._first_scale(), 0, 0
        # Before the first overflow the growths are counted only from a known initial scale (the
        # first overflow's attempted scale, used otherwise, already holds them).
        counted = self.initial is not None
        for at, skipped, lines_before, last_after, _, _ in self.progress:
            step = int(at)
            if lines_before > seen:
                scale, since, seen = last_after, step, lines_before
            grown = (step - since) // self.window if seen or counted else 0
            yield step, (scale or 1.0) * 2.0**grown, int(skipped)

    def _progress_notes(self) -> list[str]:
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


class ApexParser(_OverflowParser):
    """apex amp's and FP16_Optimizer's overflow lines (no step number: steps are inferred lower bounds)."""

    engine = "apex"
    markers = ("Gradient overflow.  Skipping step", "OVERFLOW within closure!")

    def __init__(self) -> None:
        super().__init__()
        self.other_scalers = 0

    def feed(self, line: str) -> bool:
        match = f.APEX_AMP_OVERFLOW.search(line)
        if match:
            if match["scaler"] != "0":  # amp keeps one scaler per loss: the series follows loss scaler 0
                self.lines += 1
                self.other_scalers += 1
                return True
            self.initial, self.window = f.APEX_AMP_INITIAL, f.APEX_AMP_WINDOW
        else:
            match = f.APEX_FP16_OVERFLOW.search(line)
            if match is None:
                return False
            self.initial, self.window = f.APEX_FP16_INITIAL, f.APEX_FP16_WINDOW
        after = _number(match["scale"])
        before = self.scale if self.scale is not None else self.initial
        # apex halves the scale and prints only the new one; the same scale again is the minimum clamp
        # (or a growth and a halving: then no growth is counted, which keeps the steps a lower bound)
        self._overflow(after if after == before else after * 2.0, after)
        return True

    def _findings(self) -> list[str]:
        if self.other_scalers:
            return [f"{self.other_scalers} overflow line(s) of apex loss scalers other than 0 (one per loss) "
                    "are counted here only: the series follows loss scaler 0"]
        return []


class FairseqParser(_OverflowParser):
    """fairseq's overflow lines (fp16 and --amp), its train progress lines, its config and its stop."""

    engine = "fairseq"
    markers = ("gradient overflow detected", "AMP: overflow detected", "Minimum loss scale reached",
               "num_updates", "'fp16_scale_window'")

    def feed(self, line: str) -> bool:
        match = f.FAIRSEQ_OVERFLOW.search(line) or f.FAIRSEQ_AMP_OVERFLOW.search(line)
        if match:
            self._overflow(None, _number(match["scale"]))
            return True
        match = f.FAIRSEQ_AT_MINIMUM.search(line)
        if match:
            self.lines += 1
            self.stopped = ("the run stopped: fairseq raised "
                            f"'Minimum loss scale reached ({match['scale']})' "
                            "(its loss was exploding)")
            return True
        updates = f.FAIRSEQ_NUM_UPDATES.search(line)
        if updates:
            scale = f.FAIRSEQ_LOSS_SCALE.search(line)
            if scale is None:
                return False  # a validation or bf16 line: no loss scale in it
            skipped = len(self.overflows)
            self._progress(int(updates["value"]) + skipped, skipped, _power_of_two(_number(scale["value"])))
            return True
        return self._setting(line)

    def _setting(self, line: str) -> bool:
        window = f.FAIRSEQ_SCALE_WINDOW.search(line)
        if window is None:
            return False
        self.window = None if window["value"] == "None" else int(window["value"])
        return True

    def _overflow(self, attempted: float | None, after: float) -> None:
        # fairseq prints the scale after the overflow only; it divides by its scale factor (2.0).
        super()._overflow(attempted if attempted is not None else after * 2.0, after)

    def _progress_notes(self) -> list[str]:
        return ["fairseq's num_updates counts applied updates only: the steps attempted are num_updates plus "
                "the overflow lines before each progress line (overflows before this log's first line, in a "
                "resumed run, are not known); its loss_scale is the scale of the interval's last applied "
                "update"]


PARSERS: tuple[type[_Parser], ...] = (MegatronParser, DeepSpeedParser, FairseqParser, ApexParser)
