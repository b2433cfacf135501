"""The ``lossscale-callbacks`` command line.

Each subcommand lives in its own module and registers itself on the parser (``report`` in
:mod:`lossscale_callbacks.report_cli`, ``check`` in :mod:`lossscale_callbacks.alignment_cli`).

    lossscale-callbacks report RUN [--json] [--png PATH] [--min-scale X] [--fail-unhealthy]
    lossscale-callbacks check MODEL.keras --batch-size N [--json] [--target GPU] [--fail-on LEVEL]
    lossscale-callbacks audit MODEL.keras [--data SAMPLES.npz] [--batches N] [--json]

Bad input (nothing at the path, no run in the folder, a corrupt file) prints one line on stderr
and exits with status 2, never a traceback. A missing optional package (``--png`` without the
``[plot]`` extra, ``check`` without Keras or TensorFlow) is a
:class:`~lossscale_callbacks.extras.MissingExtraError` from :func:`main`, raised before anything is
read; the console script (:func:`console`) prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from lossscale_callbacks._audit_cli import add_audit_parser
from lossscale_callbacks._version import __version__
from lossscale_callbacks.alignment_cli import add_check_parser
from lossscale_callbacks.cli_common import PROG, fail
from lossscale_callbacks.extras import MissingExtraError
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
    add_audit_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line as a function; returns the exit status.

    Raises:
        MissingExtraError: the command needs an optional package that is not installed.
    """
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


def console(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossscale-callbacks`` console script: :func:`main`, with a missing optional
    package told in one line (exit status 2) instead of a traceback."""
    try:
        return main(argv)
    except MissingExtraError as exc:
        return fail("", exc)


if __name__ == "__main__":
    sys.exit(console())
