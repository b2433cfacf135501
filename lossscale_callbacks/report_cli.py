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
import os
import sys
from collections.abc import Iterable, Iterator

from lossscale_callbacks.cli_common import PROG, fail, positive_number
from lossscale_callbacks.extras import install_hint, require
from lossscale_callbacks.report_outcomes import (
    NO_LOSS_SCALE,
    READ,
    UNREADABLE,
    RunOutcome,
    judge_run,
    judge_runs,
)
from lossscale_callbacks.report_output import JsonWriter, TextWriter
from lossscale_callbacks.run_discovery import discover_runs
from lossscale_callbacks.run_picture import write_png

__all__ = ["add_report_parser", "run_report"]

EXIT_OK, EXIT_UNHEALTHY = 0, 1


def _fail(message: str) -> int:
    return fail("report", message)


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
        return _fail(reason)
    try:
        png = _draw([outcome], args.png, png_format) if png_format else None
    except ValueError as exc:
        return _fail(str(exc))
    if args.json:
        writer = JsonWriter(args.run, sys.stdout)
        writer.add(outcome)
        writer.finish(png, _counts([outcome]))
    else:
        print(outcome.report.text())
        if png:
            print(f"Picture: {png}")
    return _exit_status(args, _counts([outcome]))


def _exit_status(args: argparse.Namespace, counts: dict[str, int]) -> int:
    if counts[READ] == 0:
        return _fail(f"{args.run}: none of its {counts['runs']} runs could be read as a loss-scale run "
                     "(each is listed above with the reason)")
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

    Raises:
        MissingExtraError: ``--png`` without matplotlib (the ``[plot]`` extra), before anything is read.
    """
    if args.png:
        require("matplotlib.figure", "plot", feature="report --png")  # before anything is read
    try:
        png_format = _picture_format(args.png) if args.png else None
    except ValueError as exc:
        return _fail(str(exc))
    runs = discover_runs(args.run)
    if not runs:
        return _fail(f"{args.run}: no such file or folder" if not os.path.lexists(args.run) else
                     f"{args.run}: no TensorBoard or W&B run here (no events.out.tfevents.* file and no "
                     ".wandb file in it or below), nor another engine's log or Trainer state")
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
            return _fail(str(exc))
    writer = JsonWriter(args.run, sys.stdout) if args.json else TextWriter(args.run, [r.path for r in runs],
                                                                           sys.stdout)
    for outcome in outcomes:
        writer.add(outcome)
    if args.json:
        writer.finish(png, tally.counts)
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
                        help='print every run as JSON: {"runs": [...], "png": ..., "counts": {...}}, '
                             "the same shape for one run or many; each run has a status (read, "
                             "no_loss_scale, unreadable), the numbers and series when read, else the reason "
                             "and what to install")
    parser.add_argument("--png", metavar="PATH", help="also draw the scale and the skip rate into PATH "
                        "(.png, .svg or .pdf; the folder must hold one readable run; needs the [plot] extra)")
    parser.add_argument("--min-scale", type=positive_number("--min-scale"), default=None, metavar="X",
                        help="the policy's min_scale (default: as logged by the run, else 1)")
    parser.add_argument("--fail-unhealthy", action="store_true",
                        help="exit with status 1 when any run has a health problem, holds damaged records "
                             "or could not be read (for CI)")
    parser.set_defaults(handler=run_report)
    return parser
