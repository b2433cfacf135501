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
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from lossscale_callbacks._printable import printable

__all__ = ["EXIT_BAD_INPUT", "PROG", "fail", "integer", "positive_number", "quiet_native_stderr"]

PROG = "lossscale-callbacks"
EXIT_BAD_INPUT = 2


def fail(command: str, message: object, err: TextIO | None = None) -> int:
    """Print ``message`` as one line on ``err`` (stderr) and return the bad-input exit status, 2.

    One line, whatever the cause: these messages end up in CI logs and shell scripts (names in it are
    escaped by :func:`~lossscale_callbacks._printable.printable`). ``command``
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
