"""The ``lossscale-callbacks`` command line.

Each subcommand lives in its own module and registers itself on the parser (``report`` in
:mod:`lossscale_callbacks.report_cli`, ``check`` in :mod:`lossscale_callbacks.alignment_cli`).

    lossscale-callbacks report RUN [--json] [--png PATH] [--min-scale X] [--fail-unhealthy]
    lossscale-callbacks check MODEL.keras --batch-size N [--json] [--target GPU] [--fail-on LEVEL]

Bad input (nothing at the path, no run in the folder, a corrupt file) prints one line on stderr
and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from lossscale_callbacks._version import __version__
from lossscale_callbacks.alignment_cli import add_check_parser
from lossscale_callbacks.cli_common import PROG
from lossscale_callbacks.report_cli import add_report_parser

EXIT_OK = 0

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog=PROG, description="lossscale-callbacks command line tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_report_parser(subparsers)
    add_check_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossscale-callbacks`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        status = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`report runs/ | head`): stop quietly, as Unix tools do. Point
        # stdout at /dev/null so that the interpreter's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    return status


if __name__ == "__main__":
    sys.exit(main())
