"""How ``lossscale-callbacks report`` prints its outcomes: a table or one run in words, or JSON, run by run.

Both writers print each run as it is judged and keep no report once it is printed, so a sweep of
a thousand runs costs the memory of one. The JSON has one shape whatever the number of runs: an
object whose ``runs`` list holds every run found, read or not (``status``, ``reason``,
``install``), followed by ``png``, the ``counts`` and the ``error`` (why the command failed, else
null): whatever the command found, ``--json`` prints exactly one JSON document.

Every line of the text goes out through :func:`~lossscale_callbacks._printable.printable`: a run
named with a newline or an escape sequence cannot add a row or drive the terminal. The text is the
run's summary in plain words when the folder holds one readable run (the runs not read are listed
after it), and a table with one row per run, read or not, when it holds several.
To print the single summary the writer waits for the second readable run before it starts the
table, so it holds one report at most.

Example:
    >>> import io
    >>> from lossscale_callbacks.report_outcomes import UNREADABLE, RunOutcome
    >>> out = io.StringIO()
    >>> writer = JsonWriter("runs", out)
    >>> writer.add(RunOutcome("runs/a", "wandb", UNREADABLE, reason="runs/a: bad header"))
    >>> writer.finish(png=None, counts={"runs": 1})
    >>> import json; json.loads(out.getvalue())["runs"][0]["reason"]
    'runs/a: bad header'
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from lossscale_callbacks._printable import printable
from lossscale_callbacks.report_outcomes import NO_LOSS_SCALE, RunOutcome
from lossscale_callbacks.run_report import RunReport

__all__ = ["JsonWriter", "TextWriter", "health_word"]

# Series are long flat lists of (step, value) pairs: no indentation, no cycle check (a pair holds none).
_COMPACT = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_HEADER = ("run", "steps", "skipped", "skip rate", "final scale", "health")
_WIDTHS = (0, 9, 9, 9, 11)  # the run column is as wide as the longest run name


def health_word(report: RunReport) -> str:
    """The health column of the table: OK, the problems, what could not be judged, damage."""
    if not report.healthy:
        word = f"{len(report.verdicts)} problem(s)"
    elif report.skipped_steps is None or "not everything could be judged" in report.health:
        word = "no problem found (not fully judged)"
    else:
        word = "OK"
    if report.damage:
        word += f"; {len(report.damage)} damaged record(s) left out"
    return word


def _without_path(outcome: RunOutcome) -> str:
    # The table names the run already; most readers start their messages with the path.
    reason = outcome.reason or ""
    return reason.removeprefix(f"{outcome.path}: ")


def _not_read(outcome: RunOutcome) -> str:
    what = "no loss-scale series" if outcome.status == NO_LOSS_SCALE else "not read"
    words = f"{what}: {_without_path(outcome)}"
    if outcome.install and outcome.install not in words:
        words += f" (install: {outcome.install})"
    return words


class TextWriter:
    """Prints the outcomes as words: one readable run in full, several as a table (see the module)."""

    def __init__(self, root: str, paths: Sequence[str], out: TextIO) -> None:
        self.root = root
        self.out = out
        names = [self._name(p) for p in paths]
        self._widths = (max(len(_HEADER[0]), *map(len, names)), *_WIDTHS[1:])
        self._held: list[RunOutcome] = []  # until a second readable run starts the table
        self._table = False

    def _name(self, path: str) -> str:
        return printable("." if path == self.root else os.path.relpath(path, self.root))

    def _print(self, line: str) -> None:
        """Every line goes out through the one escaping rule (names come from the disk)."""
        print(printable(line), file=self.out)

    def _line(self, cells: Sequence[str]) -> str:
        cells = [printable(cell) for cell in cells]  # escaped before padding: the columns stay aligned
        padded = [cell.ljust(w) for cell, w in zip(cells[:-1], self._widths, strict=True)]
        return "  ".join([*padded, cells[-1]]).rstrip()

    def _row(self, outcome: RunOutcome) -> str:
        r = outcome.report
        if r is None:
            return self._line((self._name(outcome.path), "-", "-", "-", "-", _not_read(outcome)))
        return self._line((self._name(outcome.path), str(r.steps),
                           "-" if r.skipped_steps is None else str(r.skipped_steps),
                           "-" if r.skip_rate is None else f"{r.skip_rate:.2%}", f"{r.final_scale:g}",
                           health_word(r)))

    def _start_table(self) -> None:
        self._table = True
        self._print(self._line(_HEADER))
        self._print("  ".join("-" * w for w in (*self._widths, len(_HEADER[-1]))))
        for held in self._held:
            self._print(self._row(held))
        self._held = []

    def add(self, outcome: RunOutcome) -> None:
        """Print the run, or hold it while the folder may still turn out to hold one readable run."""
        if not self._table and outcome.report is not None and any(h.report for h in self._held):
            self._start_table()
        if self._table:
            self._print(self._row(outcome))
        else:
            self._held.append(outcome)

    def finish(self, png: str | None) -> None:
        """Print what was held: the one readable run in words and the runs not read, or the table."""
        read = [h for h in self._held if h.report is not None]
        if read and not self._table:
            assert read[0].report is not None
            print(read[0].report.text(), file=self.out)  # escaped line by line by the report
            if png:
                self._print(f"Picture: {png}")
            others = [h for h in self._held if h.report is None]
            if others:
                print(file=self.out)
                self._print(f"Not read ({len(others)} of the {len(self._held)} runs below {self.root}):")
                for other in others:
                    self._print(f"  {self._name(other.path)}: {_not_read(other)}")
        elif self._held:
            self._start_table()


class JsonWriter:
    """Prints the outcomes as one JSON object, run by run (see the module)."""

    def __init__(self, root: str, out: TextIO) -> None:
        self.out = out
        self._first = True
        print("{\n" + f'  "root": {json.dumps(root)},\n  "runs": [', file=self.out, end="")

    def add(self, outcome: RunOutcome) -> None:
        """Print one run (its series on one line each: the indented encoder is slow on long series)."""
        entry = outcome.to_json()
        series = entry.pop("series", None)
        text = json.dumps(entry, indent=2, sort_keys=True)
        if series is not None:
            lines = ",\n".join(f"    {json.dumps(tag)}: {_COMPACT.encode(points)}"
                                for tag, points in series.items())
            text = text[:-2] + ',\n  "series": {' + ("\n" + lines + "\n  " if lines else "") + "}\n}"
        print(("\n" if self._first else ",\n") + textwrap.indent(text, "    "), file=self.out, end="")
        self._first = False

    def finish(self, png: str | None, counts: Mapping[str, Any], error: str | None = None) -> None:
        """Close the list and the object with the picture, the counts and the error (None when done)."""
        tail = {"png": png, "counts": dict(counts), "error": error}
        rest = json.dumps(tail, indent=2, sort_keys=True)[1:]  # the object's own "{" is open already
        print(("\n  " if not self._first else "") + "],\n" + rest.lstrip("\n"), file=self.out)
