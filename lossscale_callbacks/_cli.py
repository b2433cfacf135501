"""The ``lossscale-callbacks`` command line.

Each subcommand lives in the room of what it runs and registers itself on the parser (``report`` in
:mod:`lossscale_callbacks.report._report_cli`, ``check`` in
:mod:`lossscale_callbacks.alignment._alignment_cli`, ``audit`` in
:mod:`lossscale_callbacks.alignment._audit_cli`); a command line that names one imports only that one
(``report`` never loads the alignment checker).

    lossscale-callbacks report RUN [--json] [--png PATH] [--min-scale X] [--fail-unhealthy]
    lossscale-callbacks check MODEL.keras --batch-size N [--json] [--target GPU] [--fail-on LEVEL]
    lossscale-callbacks audit MODEL.keras [--data SAMPLES.npz] [--batches N] [--json]

Bad input (nothing at the path, no run in the folder, a corrupt file) prints one line on stderr
and exits with status 2, never a traceback. A missing optional package (``--png`` without the
``[plot]`` extra, ``check`` without Keras or TensorFlow) is a
:class:`~lossscale_callbacks.extend.MissingExtraError` from :func:`main`, raised before anything is
read; the console script (:func:`console`) prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

from lossscale_callbacks._extras import MissingExtraError
from lossscale_callbacks.report._printable import printable

# ----------------------------------------
# What the ``lossscale-callbacks`` commands share: their name, one-line errors, argument types that say why.


PROG = "lossscale-callbacks"

EXIT_BAD_INPUT = 2


def fail(command: str, message: object, err: TextIO | None = None) -> int:
    """Print ``message`` as one line on ``err`` (stderr) and return the bad-input exit status, 2.

    One line, whatever the cause: these messages end up in CI logs and shell scripts (names in it are
    escaped by :func:`~lossscale_callbacks.report._printable.printable`). ``command``
    (``"report"``, ``"check"``, or ``""`` for the program itself) starts the line.
    """
    where = f"{PROG} {command}" if command else PROG
    print(f"{where}: error: {printable(' '.join(str(message).split()))}", file=err or sys.stderr)
    return EXIT_BAD_INPUT


def integer(flag: str, low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (no upper bound when None), else an error
    naming ``flag``, the allowed range and ``why``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{flag} must be an integer {allowed}, got {text!r}{why}")
        return value

    return parse


def positive_number(flag: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0, else an error naming ``flag``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number > 0, got {text!r}")
        return value

    return parse


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence what TensorFlow's C++ start-up writes to file descriptor 2 (oneDNN, CPU features, absl)
    while a framework or a reader is imported; Python's own errors are raised after it, not lost.

    ``TF_CPP_MIN_LOG_LEVEL`` is set to 3 (unless the user set it), so a TensorFlow imported later
    stays quiet too. Both commands import through it (``check`` its model loader, ``report`` its
    readers).

    Example:
        >>> with quiet_native_stderr():
        ...     import json
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            sys.stderr.flush()
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


EXIT_OK = 0

Handler = Callable[[argparse.Namespace], int]
# subcommand -> (its module, the function that adds its parser); imported when the command line needs it.
_COMMANDS = {"report": ("lossscale_callbacks.report._report_cli", "add_report_parser"),
             "check": ("lossscale_callbacks.alignment._alignment_cli", "add_check_parser"),
             "audit": ("lossscale_callbacks.alignment._audit_cli", "add_audit_parser")}


class _Version(argparse.Action):
    """``--version``, as argparse's own action prints it, with the version read only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0,
                         help="show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from lossscale_callbacks._version import __version__

        print(f"{parser.prog} {__version__}")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser with every subcommand, or with ``command`` alone when it is one of them."""
    parser = argparse.ArgumentParser(prog=PROG, description="lossscale-callbacks command line tools.")
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in [command] if command in _COMMANDS else _COMMANDS:
        module, register = _COMMANDS[name]
        getattr(importlib.import_module(module), register)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line as a function; returns the exit status.

    Raises:
        MissingExtraError: the command needs an optional package that is not installed.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
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


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "cli_common": """
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--batch-size", type=integer("--batch-size", 1, 64))
    >>> parser.parse_args(["--batch-size", "8"]).batch_size
    8
    >>> positive_number("--min-scale")("0.5")
    0.5
""",
}
