"""What the ``lossscale-callbacks`` commands share: their name, one-line errors, argument types that say why.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--batch-size", type=integer("--batch-size", 1, 64))
    >>> parser.parse_args(["--batch-size", "8"]).batch_size
    8
    >>> positive_number("--min-scale")("0.5")
    0.5
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import TextIO

__all__ = ["EXIT_BAD_INPUT", "PROG", "fail", "integer", "positive_number"]

PROG = "lossscale-callbacks"
EXIT_BAD_INPUT = 2


def fail(command: str, message: object, err: TextIO | None = None) -> int:
    """Print ``message`` as one line on ``err`` (stderr) and return the bad-input exit status, 2.

    One line, whatever the cause: these messages end up in CI logs and shell scripts. ``command``
    (``"report"``, ``"check"``, or ``""`` for the program itself) starts the line.
    """
    where = f"{PROG} {command}" if command else PROG
    print(f"{where}: error: {' '.join(str(message).split())}", file=err or sys.stderr)
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
