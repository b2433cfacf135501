"""``lossscale-callbacks report RUN``: the loss scale of TensorBoard and W&B offline runs, in plain words.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="lossscale-callbacks")
    >>> _ = add_report_parser(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["report", "runs", "--json", "--fail-unhealthy"])
    >>> args.run, args.json, args.fail_unhealthy, args.png
    ('runs', True, True, None)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TextIO

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._cli import PROG, fail, positive_number, quiet_native_stderr
from lossscale_callbacks._extras import MissingExtraError, install_hint, require
from lossscale_callbacks.report import _run_readers as run_readers
from lossscale_callbacks.report._printable import printable
from lossscale_callbacks.report._run_readers import (
    FoundRun,
    NoLossScaleError,
    RunReadError,
    RunSeries,
    discover_runs,
    read_series,
)
from lossscale_callbacks.report._run_report import RunReport, build_report

__all__ = [
    "NO_LOSS_SCALE",
    "READ",
    "UNREADABLE",
    "JsonWriter",
    "RunOutcome",
    "TextWriter",
    "add_report_parser",
    "health_word",
    "judge_run",
    "judge_runs",
    "run_report",
    "write_png",
]


# ----------------------------------------
# What the report says about each run it found: read and judged, read but holding no loss scale, or not read.
#
# :func:`judge_runs` reads and judges one run at a time and hands each outcome on before reading the
# next, so the report's memory does not grow with the number of runs. A run that cannot be read
# (a corrupt file, a file the user may not read, a reader whose package is missing) is an outcome
# like the others, with the reason and the pip command that would read it: it never stops the runs
# after it.


READ, NO_LOSS_SCALE, UNREADABLE = "read", "no_loss_scale", "unreadable"


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One run found on disk, as the report saw it.

    Attributes:
        path: the run's folder or file.
        reader: the reader that read it or was meant to (``"tensorboard"``, ``"wandb"``), or None.
        status: :data:`READ`, :data:`NO_LOSS_SCALE` (read, but no loss-scale series on the
            optimizer-step axis) or :data:`UNREADABLE`.
        report: the run's report when it was read.
        reason: why it was not read (one sentence), or None.
        install: the pip command that installs its missing reader, or None.
    """

    path: str
    reader: str | None
    status: str
    report: RunReport | None = None
    reason: str | None = None
    install: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The run for ``--json``: the report's numbers when it was read, else why not; the ledger of bad
        steps beside it when there is one (``"ledger"``: its entries and the bad samples)."""
        head = {"path": self.path, "reader": self.reader, "status": self.status, "reason": self.reason,
                "install": self.install}
        out = head if self.report is None else {**self.report.to_json(), **head}
        ledger = _ledger_json(self.path)
        if ledger is not None:
            out["ledger"] = ledger
        return out


def _has_ledger(path: str) -> bool:
    """Whether a ledger of bad steps lies beside the run (looked for without loading the ledger's modules)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    return bool(glob.glob(os.path.join(glob.escape(folder), "bad_steps.rank*.jsonl")))


def _ledger_json(path: str) -> dict[str, Any] | None:
    if not _has_ledger(path):
        return None
    from lossscale_callbacks.ledger._read import bad_samples, read_ledgers

    entries = read_ledgers(path)
    return {"entries": [json.loads(e.to_json()) for e in entries],
            "bad_samples": [{"sample": b.sample, "steps": list(b.steps), "ranks": list(b.ranks),
                             "verdicts": list(b.verdicts), "layers": list(b.layers)}
                            for b in bad_samples(entries)]}


def _ledger_text(path: str) -> str | None:
    """The report's section on the ledger beside the run: the bad samples, then the bad steps in words."""
    if not _has_ledger(path):
        return None
    from lossscale_callbacks.ledger._read import ledger_markdown, read_ledgers

    text = ledger_markdown(read_ledgers(path))
    return f"Ledger of bad steps:\n{text}" if text else None


def _write_skip_list(path: str, folder: str) -> str:
    """``--skip-list``: the skip list of the ledger beside the run, into ``folder``."""
    from lossscale_callbacks.ledger._read import read_ledgers
    from lossscale_callbacks.ledger._skip import write_skip_list

    samples, batches = write_skip_list(read_ledgers(path), folder)
    return f"Skip list: {samples} and {batches} (Lightning's skip_batches.json format)"


def _ledger_only(args: argparse.Namespace) -> int:
    """A folder that holds a ledger of bad steps and no run (a loop with no dashboard): the ledger alone."""
    if args.json:
        print(json.dumps({"run": args.run, "runs": [], "ledger": _ledger_json(args.run)}, indent=2,
                         sort_keys=True))
    else:
        print(printable(f"{args.run}: no dashboard run here, only a ledger of bad steps."))
        print(printable(_ledger_text(args.run) or "Ledger of bad steps: empty."))
    if getattr(args, "skip_list", None):
        message = _write_skip_list(args.run, args.skip_list)
        print(printable(message), file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def judge_run(found: FoundRun, min_scale: float | None = None) -> RunOutcome:
    """Read and judge one run; every failure becomes an outcome, never an exception."""
    if found.problem is not None:
        return RunOutcome(found.path, found.kind, UNREADABLE, reason=found.problem)
    reader = found.kind
    try:
        reader, series = read_series(found.path, found.kind)
        said = series if isinstance(series, RunSeries) else RunSeries()
        report = build_report(found.path, series, reader=reader, min_scale=min_scale, damage=said.damage,
                              notes=said.notes)
    except NoLossScaleError as exc:
        return RunOutcome(found.path, reader, NO_LOSS_SCALE, reason=str(exc))
    except RunReadError as exc:
        return RunOutcome(found.path, reader, UNREADABLE, reason=str(exc), install=exc.install)
    except OSError as exc:  # a file the user may not read, a disk error
        reason = f"{exc.filename or found.path}: cannot be read ({exc.strerror or exc})"
        return RunOutcome(found.path, reader, UNREADABLE, reason=reason)
    except Exception as exc:  # a reader tripping over an unexpected file is still this run's problem only
        return RunOutcome(found.path, reader, UNREADABLE,
                          reason=f"{found.path}: cannot be read ({type(exc).__name__}: {exc})")
    return RunOutcome(found.path, reader, READ, report=report)


def judge_runs(runs: Iterable[FoundRun], min_scale: float | None = None) -> Iterator[RunOutcome]:
    """:func:`judge_run` for each run in turn; a run is read only when the previous outcome was taken."""
    for found in runs:
        yield judge_run(found, min_scale)


EXIT_OK, EXIT_UNHEALTHY = 0, 1


def _fail(args: argparse.Namespace, message: str, outcomes: Sequence[RunOutcome] = ()) -> int:
    """Bad input: one line on stderr; with ``--json`` also one JSON document on stdout (the runs found,
    and the message as its ``error``), so that a script always has a document to read."""
    if args.json:
        writer = JsonWriter(args.run, sys.stdout)
        for outcome in outcomes:
            writer.add(outcome)
        writer.finish(None, _counts(outcomes), error=message)
    return fail("report", message)


def _load_readers(runs: Sequence[FoundRun]) -> None:
    """Import the readers the runs need with TensorFlow's start-up lines silenced (a reader's package may
    import it); one that cannot be loaded is said by its runs' outcomes."""
    kinds = {run.kind for run in runs}
    with quiet_native_stderr():
        for kind in sorted(kinds - {None}) if None not in kinds else sorted(run_readers._entry_points()):
            try:
                run_readers.load_reader(kind)
            except run_readers.RunReadError:
                continue


_PICTURE_FORMATS = ("png", "svg", "pdf")


def _picture_format(path: str) -> str:
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in _PICTURE_FORMATS:
        allowed = ", ".join("." + f for f in _PICTURE_FORMATS)
        raise ValueError(f"--png {path}: the file name must end in one of {allowed} "
                         f"(got {extension and '.' + extension!r})")
    return extension


def _counts(outcomes: Iterable[RunOutcome]) -> dict[str, int]:
    counts = dict.fromkeys(("runs", READ, NO_LOSS_SCALE, UNREADABLE, "unhealthy", "damaged"), 0)
    for outcome in outcomes:
        counts["runs"] += 1
        counts[outcome.status] += 1
        if outcome.report is not None:
            counts["unhealthy"] += not outcome.report.healthy
            counts["damaged"] += bool(outcome.report.damage)
    return counts


class _Tally:
    """Counts the outcomes as they pass, keeping none of them."""

    def __init__(self) -> None:
        self.counts = _counts(())

    def __call__(self, outcomes: Iterable[RunOutcome]) -> Iterator[RunOutcome]:
        for outcome in outcomes:
            for key, value in _counts((outcome,)).items():
                self.counts[key] += value
            yield outcome


def _one_picture(outcomes: Iterator[RunOutcome], root: str) -> list[RunOutcome]:
    """Every outcome, for --png: refused as soon as a second run is readable (one picture, one run)."""
    kept: list[RunOutcome] = []
    for outcome in outcomes:
        if outcome.report is not None and any(k.report for k in kept):
            names = ", ".join(k.path for k in (*kept, outcome) if k.report)
            raise ValueError(f"--png draws one run, but {root} holds several ({names}); name one run")
        kept.append(outcome)
    return kept


def _draw(outcomes: list[RunOutcome], path: str, fmt: str) -> str | None:
    report = next((o.report for o in outcomes if o.report is not None), None)
    if report is None:
        return None
    try:
        return write_png(report, path, fmt)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None


def _single(outcome: RunOutcome, args: argparse.Namespace, png_format: str | None) -> int:
    """The report on a path that holds one run: its summary, or one line on stderr when it cannot be read."""
    if outcome.report is None:
        reason = outcome.reason or f"{outcome.path}: cannot be read"
        if outcome.install and outcome.install not in reason:
            reason += f"; install: {outcome.install}"
        return _fail(args, reason, [outcome])
    try:
        png = _draw([outcome], args.png, png_format) if png_format else None
    except ValueError as exc:
        return _fail(args, str(exc), [outcome])
    counts = _counts([outcome])
    if args.json:
        writer = JsonWriter(args.run, sys.stdout)
        writer.add(outcome)
        writer.finish(png, counts, error=_none_read(args, counts))
    else:
        print(outcome.report.text())
        ledger = _ledger_text(outcome.path)
        if ledger:
            print(printable(ledger))
        if png:
            print(printable(f"Picture: {png}"))
    if getattr(args, "skip_list", None):
        if not _has_ledger(outcome.path):
            return _fail(args, f"{outcome.path}: --skip-list needs a ledger of bad steps beside the run "
                               "(bad_steps.rank<r>.jsonl); there is none")
        message = _write_skip_list(outcome.path, args.skip_list)
        print(printable(message), file=sys.stderr if args.json else sys.stdout)
    return _exit_status(args, counts)


def _none_read(args: argparse.Namespace, counts: dict[str, int]) -> str | None:
    if counts[READ]:
        return None
    return (f"{args.run}: none of its {counts['runs']} runs could be read as a loss-scale run (each is "
            "listed above with the reason)")


def _exit_status(args: argparse.Namespace, counts: dict[str, int]) -> int:
    error = _none_read(args, counts)
    if error:
        return fail("report", error)
    failed = counts["unhealthy"] + counts["damaged"] + counts[UNREADABLE]
    if args.fail_unhealthy and failed:
        words = [f"{counts['unhealthy']} of {counts[READ]} run(s) unhealthy"]
        words += [f"{counts['damaged']} damaged"] if counts["damaged"] else []
        words += [f"{counts[UNREADABLE]} not read"] if counts[UNREADABLE] else []
        print(f"{PROG} report: {', '.join(words)}", file=sys.stderr)
        return EXIT_UNHEALTHY
    return EXIT_OK


def run_report(args: argparse.Namespace) -> int:
    """Run the ``report`` command; returns the exit status (0 done, 1 --fail-unhealthy, 2 bad input).

    With ``--json`` it prints one JSON document whatever happens (a missing extra too: its message is the
    document's ``error``, then it is raised).

    Raises:
        MissingExtraError: ``--png`` without matplotlib (the ``[plot]`` extra), before anything is read.
    """
    if args.png:
        try:
            require("matplotlib.figure", "plot", feature="report --png")  # before anything is read
        except MissingExtraError as exc:
            if args.json:
                JsonWriter(args.run, sys.stdout).finish(None, _counts(()), error=str(exc))
            raise
    try:
        png_format = _picture_format(args.png) if args.png else None
    except ValueError as exc:
        return _fail(args, str(exc))
    runs = discover_runs(args.run)
    if not runs and os.path.isdir(args.run) and _has_ledger(args.run):
        return _ledger_only(args)
    if not runs:
        return _fail(args, f"{args.run}: no such file or folder" if not os.path.lexists(args.run) else
                     f"{args.run}: no TensorBoard or W&B run here (no events.out.tfevents.* file and no "
                     ".wandb file in it or below), nor another engine's log or Trainer state")
    _load_readers(runs)
    if len(runs) == 1:
        return _single(judge_run(runs[0], args.min_scale), args, png_format)
    tally = _Tally()
    outcomes: Iterable[RunOutcome] = tally(judge_runs(runs, args.min_scale))
    png = None
    if png_format:
        try:
            outcomes = _one_picture(iter(outcomes), args.run)
            png = _draw(outcomes, args.png, png_format)
        except ValueError as exc:
            return _fail(args, str(exc))
    writer = JsonWriter(args.run, sys.stdout) if args.json else TextWriter(args.run, [r.path for r in runs],
                                                                           sys.stdout)
    for outcome in outcomes:
        writer.add(outcome)
    if args.json:
        writer.finish(png, tally.counts, error=_none_read(args, tally.counts))
    else:
        writer.finish(png)
    return _exit_status(args, tally.counts)


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``report`` command to an ``argparse`` subparsers object; ``args.handler(args)`` runs it."""
    parser = subparsers.add_parser(
        "report", help="summarise the loss scale of TensorBoard runs and W&B offline runs "
                       "(needs the [tensorboard] and/or [wandb] extra)",
        description="Read a TensorBoard run folder (or event file) or a W&B run (offline-run-* folder or "
                    ".wandb file), or another engine's log (DeepSpeed, apex, fairseq, Megatron-LM) or "
                    "Trainer state (trainer_state.json), found by content, and describe its loss scale in "
                    "plain words: steps, skipped steps and "
                    "rate, scale range, steps at the minimum, health verdict, damaged records, restarts. "
                    "A folder with several runs below it (runs/) gives a table with one row per run; every "
                    "run found is listed, with the reason when it could not be read. Runs are read and "
                    "judged one at a time. Needs: "
                    f"{install_hint('tensorboard')} to read TensorBoard runs, {install_hint('wandb')} to "
                    f"read W&B runs, {install_hint('plot')} for --png.",
        epilog="Exit status: 0 done; 1 with --fail-unhealthy when a run has a health problem, holds damaged "
               "records, or could not be read; 2 bad input (nothing at the path, no run found, or no run "
               "that could be read).",
    )
    parser.add_argument("run", metavar="RUN", help="run folder, event file, .wandb file, an engine's log or "
                        "trainer_state.json, or a folder of runs")
    parser.add_argument("--json", action="store_true",
                        help='print every run as JSON: {"runs": [...], "png": ..., "counts": {...}, '
                             '"error": ...}, one document whatever was found (error: why the exit status '
                             "is 2, else null); the same shape for one run or many; each run has a status "
                             "(read, "
                             "no_loss_scale, unreadable), the numbers and series when read, else the reason "
                             "and what to install")
    parser.add_argument("--png", metavar="PATH", help="also draw the scale and the skip rate into PATH "
                        "(.png, .svg or .pdf; the folder must hold one readable run; needs the [plot] extra)")
    parser.add_argument("--min-scale", type=positive_number("--min-scale"), default=None, metavar="X",
                        help="the policy's min_scale (default: as logged by the run, else 1)")
    parser.add_argument("--skip-list", metavar="DIR", default=None,
                        help="write the skip list of the ledger of bad steps beside the run into DIR: "
                             "skip_samples.json (what skip_samples() reads) and skip_batches.json "
                             "(Lightning's SpikeDetection format); one run only")
    parser.add_argument("--fail-unhealthy", action="store_true",
                        help="exit with status 1 when any run has a health problem, holds damaged records "
                             "or could not be read (for CI)")
    parser.set_defaults(handler=run_report)
    return parser

# ----------------------------------------
# How ``lossscale-callbacks report`` prints its outcomes: a table or one run in words, or JSON, run by run.
#
# Both writers print each run as it is judged and keep no report once it is printed, so a sweep of
# a thousand runs costs the memory of one. The JSON has one shape whatever the number of runs: an
# object whose ``runs`` list holds every run found, read or not (``status``, ``reason``,
# ``install``), followed by ``png`` and the ``counts``.
#
# The text is the run's summary in plain words when the folder holds one readable run (the runs not
# read are listed after it), and a table with one row per run, read or not, when it holds several.
# To print the single summary the writer waits for the second readable run before it starts the
# table, so it holds one report at most.


# Series are long flat lists of (step, value) pairs: no indentation, no cycle check (a pair holds none).
_COMPACT = json.JSONEncoder(separators=(",", ":"), check_circular=False)

_HEADER = ("run", "steps", "skipped", "skip rate", "final scale", "health")

_WIDTHS = (0, 9, 9, 9, 11)  # the run column is as wide as the longest run name


def health_word(report: RunReport) -> str:
    """The health column of the table: OK, the problems, what could not be judged, damage."""
    if not report.healthy:
        word = f"{len(report.verdicts)} problem(s)"
    elif not report.steps_known:
        word = "no problem seen (not judged: no step counter)"
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
        # an engine's log without a step counter: the steps a lower bound, the skip rate not known
        steps = str(r.steps) if r.steps_known else f"≥{(r.engine or {}).get('steps_at_least') or r.steps}"
        bound = "≥" if (r.engine or {}).get("skipped_bound") else ""  # a Trainer state logged sparsely
        rate = "-" if r.skip_rate is None or not r.steps_known else f"{bound}{r.skip_rate:.2%}"
        return self._line((self._name(outcome.path), steps,
                           "-" if r.skipped_steps is None else f"{bound}{r.skipped_steps}", rate,
                           f"{r.final_scale:g}" if r.scale_known else "-", health_word(r)))

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

# ----------------------------------------
# The picture of a run: the scale on a log2 axis with skipped steps marked, and the skip rate per interval.
#
# matplotlib (the ``[plot]`` extra) is imported when a picture is drawn, never by the report itself.


_RATE_GROUPS = 1000  # the most steps the skip-rate panel draws (it is about 900 pixels wide)


def _skip_rates(snapshots: Sequence[m.Snapshot]) -> tuple[list[float], list[int], int]:
    """The skip rate over consecutive groups of ``size`` log intervals (one interval each up to
    :data:`_RATE_GROUPS` of them), with the groups' edges on the step axis: skipped steps over steps
    attempted in each group, so a group's rate is exact, never an average of rates."""
    if not snapshots:
        return [], [0], 1
    size = -(-len(snapshots) // _RATE_GROUPS)
    rates, edges = [], [snapshots[0].step - snapshots[0].interval_steps]
    for start in range(0, len(snapshots), size):
        group = snapshots[start:start + size]
        attempted = sum(s.interval_steps for s in group)
        rates.append(sum(s.skipped_in_interval for s in group) / attempted if attempted else 0.0)
        edges.append(group[-1].step)
    return rates, edges, size


def _draw_scale(top: Any, report: RunReport, skipped: Sequence[m.Snapshot]) -> None:
    """The top panel: the scale at each log point, every other scale an engine's log printed (its
    levels), the intervals with skipped steps and the minimum; a log with no scale says so."""
    top.set_ylabel("loss scale (log2)")
    top.grid(True, which="major", alpha=0.3)
    if not report.scale_known:  # the points hold a placeholder scale: nothing to draw
        top.set_yticks([])
        top.text(0.5, 0.5, "no loss scale in this log (the engine prints none)", transform=top.transAxes,
                 ha="center", va="center", color="grey")
        return
    snapshots = report.snapshots
    top.step([s.step for s in snapshots], [s.scale for s in snapshots], where="post", color="tab:blue",
             label="loss scale")
    top.set_yscale("log", base=2)
    first, last = snapshots[0].step, snapshots[-1].step
    levels = [(step, scale) for step, scale in report.series.get(run_readers.LEVELS, ())
              if first <= step <= last and scale > 0]
    if levels:
        top.scatter([step for step, _ in levels], [scale for _, scale in levels], marker=".", s=12,
                    color="tab:blue", zorder=2, label="every scale the log printed")
    if skipped:
        top.scatter([s.step for s in skipped], [s.scale for s in skipped], marker="v", color="tab:red",
                    zorder=3, label="interval with skipped steps")
    top.axhline(report.min_scale, color="grey", linestyle=":", linewidth=1,
                label=f"min_scale {report.min_scale:g}")
    top.legend(loc="best", fontsize="small")


def write_png(report: RunReport, path: str, fmt: str = "png") -> str:
    """Draw the run: the scale on a log2 axis with skipped steps marked, and the skip rate per interval
    (a run that skipped nothing says "no skipped steps" on that panel).

    ``fmt`` is the picture format (``"png"``, ``"svg"``, ``"pdf"``); the CLI takes it from the file
    name. matplotlib is imported here only. The figure is drawn with matplotlib's object API and
    saved by its Agg renderer: no display is needed and pyplot's global backend is left alone.

    Raises:
        MissingExtraError: matplotlib (the ``[plot]`` extra) is not installed.
        OSError: the picture cannot be written to ``path``.
    """
    Figure = require("matplotlib.figure", "plot", feature="the report's picture").Figure
    snapshots = report.snapshots
    skipped = [s for s in snapshots if s.skipped_in_interval > 0]

    fig = Figure(figsize=(9, 6), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    _draw_scale(top, report, skipped)
    if not report.steps_known:
        steps = f"steps not known (at least {(report.engine or {}).get('steps_at_least') or report.steps})"
        skips = f"{report.skipped_steps} skipped" if report.skipped_steps is not None else "skips not known"
    else:
        steps = f"{report.steps} steps"
        skips = ("skipped steps not logged" if report.skipped_steps is None or report.skip_rate is None
                 else f"{report.skipped_steps} skipped ({report.skip_rate:.2%})")
    top.set_title(f"Loss scale: {steps}, {skips}"
                  + ("" if report.healthy else f", {len(report.verdicts)} health problem(s)"))

    # One step patch, not one bar per interval: a long run's tens of thousands of bars took 40 s and 0.8 GB.
    rates, edges, size = _skip_rates(snapshots)
    bottom.stairs(rates, edges, fill=True, color="tab:red", alpha=0.7)
    span = (edges[-1] - edges[0]) / max(len(rates), 1)
    bottom.set_ylabel("skip rate per interval" if size == 1 else f"skip rate per ~{span:,.0f} steps")
    bottom.set_xlabel(m.STEP_AXIS if report.steps_known else
                      f"{m.STEP_AXIS}: the least steps there can have been (the log has no step counter)")
    bottom.set_ylim(0, max(0.05, max(rates, default=0.0) * 1.1))
    if not skipped:  # an empty panel would look like a drawing that failed
        words = "skipped steps not logged" if report.skipped_steps is None else "no skipped steps"
        bottom.text(0.5, 0.5, words, transform=bottom.transAxes, ha="center", va="center", color="grey")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format=fmt)
    return path


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "report_outcomes": """
    >>> from lossscale_callbacks.report._run_readers import FoundRun
    >>> outcome = judge_run(FoundRun("no/such/run", "tensorboard"))
    >>> outcome.status, outcome.reason
    ('unreadable', 'no/such/run: no such file or folder')
""",
    "report_output": """
    >>> import io
    >>> from lossscale_callbacks.report._report_cli import UNREADABLE, RunOutcome
    >>> out = io.StringIO()
    >>> writer = JsonWriter("runs", out)
    >>> writer.add(RunOutcome("runs/a", "wandb", UNREADABLE, reason="runs/a: bad header"))
    >>> writer.finish(png=None, counts={"runs": 1})
    >>> import json; json.loads(out.getvalue())["runs"][0]["reason"]
    'runs/a: bad header'
""",
    "run_picture": """
    >>> from lossscale_callbacks.report._run_report import build_report
    >>> report = build_report("run", {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)]})
    >>> write_png(report, "scale.png")  # doctest: +SKIP
    'scale.png'
""",
}
