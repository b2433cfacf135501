"""A log's lines as a terminal left them, read by every engine's parser (see :mod:`._engine_parsers`).

Each line is taken as a terminal left it: its colours dropped, its progress counters found (a message
glued after a bar is read after it), a word a terminal broke with its padding joined again; the lines
of no known format that speak of loss scaling are counted and quoted.

Example:
    >>> line = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1024, reducing to 512"
    >>> engine_lines([line])
    True
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from lossscale_callbacks.report import _engine_formats as f
from lossscale_callbacks.report._engine_parsers import PARSERS, MegatronParser
from lossscale_callbacks.report._engine_text import cleaned, counters, unwrapped

__all__ = ["FORMATS_KNOWN", "Lines", "engine_lines"]

_QUOTED = 3  # unknown lines quoted in the report
FORMATS_KNOWN = ("DeepSpeed, apex (amp and FP16_Optimizer), fairseq, Megatron-LM and the Transformers "
                 "Trainer's console")
_RECENT = 4  # lines kept for a Megatron iteration line a terminal wrapped


class Lines:
    """The lines of a log, fed to every engine's parser; unknown loss-scale lines counted and quoted.

    Each line is taken as a terminal left it: its colours dropped, its progress counters found (a
    message glued after a bar is read after it), and, where no format matched, a word a terminal broke
    with its padding joined again before a second try.
    """

    def __init__(self) -> None:
        self.parsers = [parser() for parser in PARSERS]
        self.megatron = next(p for p in self.parsers if isinstance(p, MegatronParser))
        self.recent: collections.deque[str] = collections.deque(maxlen=_RECENT)
        self.total = 0
        self.index = 0
        self.unknown = 0
        self.quoted: list[str] = []
        self.truncated: str | None = None
        self.counters_seen = 0
        self.terminal: set[str] = set()  # what a terminal did to the lines read (wording ids)

    def _dispatch(self, line: str, counters: list) -> Any:
        for parser in self.parsers:  # a plain loop: a million lines come through here
            if any(map(line.__contains__, parser.markers)):
                parser.line_counters = counters
                parser.line_index = self.index
                if parser.feed(line):
                    return parser
        return None

    def feed(self, number: int, line: str, last: bool) -> None:
        self.total += 1
        # Megatron's iteration line (a million at --log-interval 1): read first, nothing else to look for
        if "loss scale:" in line and "iteration" in line and self.megatron.iteration_line(line):
            self.index += 1
            return
        if "\x1b" in line or "^[" in line:
            line = cleaned(line)
            self.terminal.add("ansi.caret")
        if line.isspace() or not line:
            return
        self.index += 1
        # Substring tests, not a regex: a log's lines are mostly unrelated, and these reject them fastest
        # (the words of f.LOSS_SCALE_WORDS, f.OTHER_MARKERS and f.COUNTER_MARKERS, written out).
        lower = line.lower()
        related = "overflow" in lower or "loss scal" in lower or "loss_scal" in lower or "skipp" in lower
        other = related or ("Traceback" in line or "FloatingPointError" in line or "found NaN" in line
                            or "grad" in line or "num_updates" in line or "{'loss':" in line
                            or "initial_dynamic_scale" in line)
        counted = "%|" in line or "][" in line or "Training Iteration" in line
        if not (other or counted):
            if "iteration" in line:
                self.recent.append(line)  # where an iteration line a terminal wrapped starts
            if last:
                self._cut(number)
            return
        found = counters(line) if counted else []
        consumer = None
        if other:
            self.megatron.recent = self.recent
            if related and f.WRAPPED.search(line):  # a message a terminal wrapped: joined before it is read
                line = unwrapped(line)
                self.terminal.add("wrapped")
            consumer = self._dispatch(line, found)
        if found:
            self.counters_seen += 1
            self.terminal.update(f"counter.{kind}" for *_, kind in found)
            for parser in self.parsers:
                if parser is not consumer:
                    parser.ticks(found)
        if consumer is not None:
            return
        if other and ("norm" in line or "NORM" in line):
            self._grad_norm(line)
        if f.TRACEBACK in line:
            for parser in self.parsers:
                parser.saw_traceback()
        self.recent.append(line)
        if last:
            self._cut(number)
            return
        if not related or f.SETTING_LINE.search(line) or f.APEX_BANNER.search(line):
            return  # a line unrelated to loss scaling, or a setting nobody needs
        self.unknown += 1
        if len(self.quoted) < _QUOTED:
            self.quoted.append(f"line {number}: {line.strip()[:120]!r}")

    def _grad_norm(self, line: str) -> None:
        """A gradient norm in a line no engine read (the training script's own): NaN or Inf is told to
        every parser (a mean in brackets counts too: a non-finite norm since it was last reset)."""
        match = f.SCRIPT_GRAD_NORM.search(line)
        if match is None:
            return
        self.terminal.add("script.grad-norm")
        if match["value"].lower() in f.NOT_FINITE or (match["mean"] or "").lower() in f.NOT_FINITE:
            for parser in self.parsers:
                parser.script_grad_norm()

    def _cut(self, number: int) -> None:
        """The file ends inside line ``number``: a log still being written."""
        self.truncated = f"the file ends inside line {number} (a log still being written?): it was not read"

    def read(self, path: str) -> None:
        feed = self.feed
        with open(path, encoding="utf-8", errors="replace") as file:
            # Universal newlines end every line but the file's last with "\n" (a carriage return ends a
            # line too: each refresh of a progress bar is a line): only the last one can be cut.
            for number, line in enumerate(file, start=1):
                feed(number, line, not line.endswith(("\n", "\r")))

    def unknown_words(self) -> str | None:
        if not self.unknown:
            return None
        return (f"{self.unknown} line(s) speak of loss scaling in a format this reader does not know "
                f"(counted, not read): {'; '.join(self.quoted)}{'; ...' if self.unknown > _QUOTED else ''}")


def engine_lines(lines: Iterable[str]) -> bool:
    """Whether any of ``lines`` is a line of an engine's format (read as :func:`read_run` reads a log)."""
    reader = Lines()
    for number, line in enumerate(lines, start=1):
        reader.feed(number, line, False)
        if any(parser.lines for parser in reader.parsers):
            return True
    return False
