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
import json
import math
import os
import sys
from typing import Any

from lossscale_callbacks.run_discovery import discover_runs
from lossscale_callbacks.run_picture import write_png
from lossscale_callbacks.run_readers import RunReadError, read_series
from lossscale_callbacks.run_report import build_report

__all__ = ["add_report_parser", "run_report"]

PROG = "lossscale-callbacks"
EXIT_OK, EXIT_UNHEALTHY, EXIT_BAD_INPUT = 0, 1, 2


def _fail(message: str) -> int:
    # One line, whatever the cause: these messages end up in CI logs and shell scripts.
    print(f"{PROG} report: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value



_PICTURE_FORMATS = ("png", "svg", "pdf")


def _picture_format(path: str) -> str:
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in _PICTURE_FORMATS:
        allowed = ", ".join("." + f for f in _PICTURE_FORMATS)
        raise RunReadError(f"--png {path}: the file name must end in one of {allowed} "
                           f"(got {extension and '.' + extension!r})")
    return extension


def _health_word(report: Any) -> str:
    if not report.healthy:
        return f"{len(report.verdicts)} problem(s)"
    if report.skipped_steps is None or "not everything could be judged" in report.health:
        return "no problem found (not fully judged)"
    return "OK"


def _table(reports: list[Any], root: str) -> str:
    rows = [("run", "steps", "skipped", "skip rate", "final scale", "health")]
    for r in reports:
        rows.append((os.path.relpath(r.path, root) if r.path != root else ".", str(r.steps),
                     "-" if r.skipped_steps is None else str(r.skipped_steps),
                     "-" if r.skip_rate is None else f"{r.skip_rate:.2%}", f"{r.final_scale:g}",
                     _health_word(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _read_reports(root: str, min_scale: float | None) -> tuple[list[Any], list[str]]:
    """One report per run at or below ``root``; the runs that could not be read, as messages."""
    runs = discover_runs(root)
    if len(runs) <= 1:
        reader, series = read_series(root if not runs else runs[0])
        return [build_report(root if not runs else runs[0], series, reader=reader, min_scale=min_scale)], []
    reports, skipped = [], []
    for run in runs:
        try:
            reader, series = read_series(run)
            reports.append(build_report(run, series, reader=reader, min_scale=min_scale))
        except RunReadError as exc:
            skipped.append(f"{os.path.relpath(run, root)}: {exc}")
    if not reports:
        raise RunReadError(f"{root}: none of its {len(runs)} runs has a loss-scale series ({skipped[0]})")
    return reports, skipped


def run_report(args: argparse.Namespace) -> int:
    try:
        fmt = _picture_format(args.png) if args.png else None
        reports, unreadable = _read_reports(args.run, args.min_scale)
    except RunReadError as exc:
        return _fail(str(exc))
    except Exception as exc:  # a reader tripping over an unexpected file is still bad input
        return _fail(f"{args.run}: cannot be read ({type(exc).__name__}: {exc})")
    png = None
    if args.png:
        if len(reports) > 1:
            return _fail(f"--png draws one run, but {args.run} holds {len(reports)}; name one run")
        try:
            png = write_png(reports[0], args.png, fmt)
        except RunReadError as exc:
            return _fail(str(exc))
        except OSError as exc:
            return _fail(f"cannot write {args.png}: {exc.strerror or exc}")
    if args.json:
        payloads = [r.to_json() for r in reports]
        if len(reports) == 1:
            payload: Any = {**payloads[0], "png": png}
        else:
            payload = {"runs": payloads, "unreadable": unreadable}
        print(json.dumps(payload, indent=2, sort_keys=True))
    elif len(reports) == 1:
        print(reports[0].text())
        if png:
            print(f"Picture: {png}")
    else:
        print(_table(reports, args.run))
        for message in unreadable:
            print(f"not a loss-scale run: {message}")
    unhealthy = [r for r in reports if not r.healthy]
    if args.fail_unhealthy and unhealthy:
        print(f"{PROG} report: {len(unhealthy)} of {len(reports)} run(s) unhealthy", file=sys.stderr)
        return EXIT_UNHEALTHY
    return EXIT_OK


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", help="summarise the loss scale of TensorBoard runs and W&B offline runs",
        description="Read a TensorBoard run folder (or event file) or a W&B offline run (offline-run-* "
                    "folder or .wandb file) and describe its loss scale in plain words: steps, skipped "
                    "steps and rate, scale range, steps at the minimum, health verdict. A folder with "
                    "several runs below it (runs/) gives a table with one row per run.",
        epilog="Exit status: 0 done; 1 with --fail-unhealthy when a run has a health problem; 2 bad input.",
    )
    parser.add_argument("run", metavar="RUN", help="run folder, event file, .wandb file, or a folder of runs")
    parser.add_argument("--json", action="store_true", help="print the numbers (and the series) as JSON")
    parser.add_argument("--png", metavar="PATH", help="also draw the scale and the skip rate into PATH "
                        "(.png, .svg or .pdf)")
    parser.add_argument("--min-scale", type=_positive_float, default=None, metavar="X",
                        help="the policy's min_scale (default: as logged by the run, else 1)")
    parser.add_argument("--fail-unhealthy", action="store_true",
                        help="exit with status 1 when any run has a health problem (for CI)")
    parser.set_defaults(handler=run_report)
    return parser
