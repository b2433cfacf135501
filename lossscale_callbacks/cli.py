"""The ``lossscale-callbacks`` command line.

Subcommands are registered by small ``_add_<name>`` functions, so new ones (``check`` for the
alignment checker) plug in beside ``report`` without touching it.

    lossscale-callbacks report RUN [--json] [--png PATH] [--min-scale X]
    lossscale-callbacks check MODEL.keras --batch-size N [--json] [--target GPU] [--fail-on LEVEL]

Bad input (nothing at the path, no run in the folder, a corrupt file) prints one line on stderr
and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence

from lossscale_callbacks._version import __version__

PROG = "lossscale-callbacks"
EXIT_OK, EXIT_BAD_INPUT = 0, 2

Handler = Callable[[argparse.Namespace], int]


def _fail(command: str, message: str) -> int:
    # One line, whatever the cause: these messages end up in CI logs and shell scripts.
    print(f"{PROG} {command}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------
# report


def _run_report(args: argparse.Namespace) -> int:
    from lossscale_callbacks.report import RunReadError, build_report, read_series, write_png

    try:
        reader, series = read_series(args.run)
        report = build_report(args.run, series, reader=reader, min_scale=args.min_scale)
    except RunReadError as exc:
        return _fail("report", str(exc))
    except Exception as exc:  # a reader tripping over an unexpected file is still bad input
        return _fail("report", f"{args.run}: cannot be read ({type(exc).__name__}: {exc})")
    png = None
    if args.png:
        try:
            png = write_png(report, args.png)
        except RunReadError as exc:
            return _fail("report", str(exc))
        except OSError as exc:
            return _fail("report", f"cannot write {args.png}: {exc.strerror or exc}")
    if args.json:
        payload = report.to_json()
        payload["png"] = png
        print(json.dumps(payload, indent=2, sort_keys=True))
    else:
        print(report.text())
        if png:
            print(f"Picture: {png}")
    return EXIT_OK


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="summarise the loss scale of a TensorBoard run or a W&B offline run",
        description="Read a TensorBoard run folder (or event file) or a W&B offline run (offline-run-* "
                    "folder or .wandb file) and describe its loss scale in plain words: steps, skipped "
                    "steps and rate, scale range, steps at the minimum, health verdict.",
    )
    parser.add_argument("run", metavar="RUN", help="run folder, event file, or .wandb file")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of text")
    parser.add_argument("--png", metavar="PATH", help="also draw the scale and the skip rate into PATH")
    parser.add_argument("--min-scale", type=_positive_float, default=None, metavar="X",
                        help="the policy's min_scale (default: as logged by the run, else 1)")
    parser.set_defaults(handler=_run_report)


# ---------------------------------------------------------------------------------------------
# check


def _add_check(subparsers: argparse._SubParsersAction) -> None:
    from lossscale_callbacks.alignment_cli import add_check_parser

    add_check_parser(subparsers)


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog=PROG, description="lossscale-callbacks command line tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_report(subparsers)
    _add_check(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossscale-callbacks`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
