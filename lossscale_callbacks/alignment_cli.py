"""``lossscale-callbacks check MODEL.keras --batch-size N [--json] [--target GPU]``: the alignment check.

Loads the model file (without compiling it), traces one training step at the given batch size (shapes
only: no batch is allocated, so ``--batch-size 1000000000`` costs what 8 does) and prints a header (model,
target, precision, batch size, TF32), the findings table and a line explaining the exit status (or the
whole report as JSON). Exit status: 0 when nothing is at least as severe as ``--fail-on`` (default
``high``), 1 when something is, 2 when the file cannot be checked. TensorFlow's own start-up logging
is silenced.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="lossscale-callbacks")
    >>> _ = add_check_parser(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["check", "model.keras", "--batch-size", "64", "--target", "a100"])
    >>> args.model, args.batch_size, args.target, args.json, args.fail_on
    ('model.keras', 64, 'a100', False, 'high')
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from lossscale_callbacks.alignment.checkers import framework_of_file, load_checker
from lossscale_callbacks.alignment.report import AlignmentReport
from lossscale_callbacks.alignment.targets import TARGETS

_TF32 = {"auto": None, "on": True, "off": False}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--batch-size must be an integer >= 1, got {text!r}")
    return value


def _fail(err: TextIO, message: str) -> int:
    # One line, like the report command: these messages end up in CI logs and shell scripts.
    print(f"lossscale-callbacks check: error: {' '.join(str(message).split())}", file=err)
    return 2


def add_check_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``check`` command to an ``argparse`` subparsers object; ``args.handler(args)`` runs it."""
    parser = subparsers.add_parser(
        "check", help="check a saved model's shapes against the Tensor Core rules",
        description="Trace one training step of a saved Keras model and report the layer dimensions that "
                    "keep Tensor Cores from running at full speed, and mixed-precision problems.")
    parser.add_argument("model", help="a saved Keras model (.keras)")
    parser.add_argument("--batch-size", type=_positive_int, default=8,
                        help="training batch size (a GEMM dimension too); default 8")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--target", choices=sorted(TARGETS), default=None,
                        help="GPU whose recommendations (128-byte alignment, SM count) apply")
    parser.add_argument("--tf32", choices=sorted(_TF32), default="auto",
                        help="whether float32 runs as TF32 (default: TensorFlow's own setting)")
    parser.add_argument("--fail-on", choices=("high", "medium", "low", "never"), default="high",
                        help="lowest severity that makes the exit status 1 (default high)")
    parser.set_defaults(handler=run_check)
    return parser


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence what TensorFlow's C++ start-up writes to file descriptor 2 (oneDNN, CPU features, absl)
    while it is imported; Python's own errors are raised after it, not lost."""
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


def _status_line(report: AlignmentReport, fail_on: str) -> tuple[int, str]:
    if fail_on == "never":
        return 0, "Exit status 0: --fail-on never."
    bad = report.at_least(fail_on)
    if bad:
        return 1, (f"Exit status 1: {len(bad)} finding(s) at or above --fail-on {fail_on}; fix them or "
                   "raise --fail-on.")
    below = len(report.findings) + len([a for a in report.audit if a.severity != "info"])
    return 0, (f"Exit status 0: nothing at or above --fail-on {fail_on}"
               + (f" ({below} less severe finding(s) listed)." if below else "."))


def run_check(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None,
              check_file: Callable[..., AlignmentReport] | None = None) -> int:
    """Run the ``check`` command; returns the exit status.

    ``check_file(path, batch_size=, target=, tf32=) -> AlignmentReport`` replaces the framework's loader
    (tests).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    path = Path(args.model)
    if path.is_dir():
        return _fail(err, f"{path} is a directory: give a saved model file (.keras or .h5), for example "
                          "`lossscale-callbacks check model.keras --batch-size 64`")
    if not path.exists():
        return _fail(err, f"{path}: no such file")
    if not path.is_file():
        return _fail(err, f"{path} is not a regular file: give a saved model file (.keras or .h5)")
    try:
        if check_file is None:
            framework = framework_of_file(path)
            with _quiet_native_stderr():
                check_file = load_checker(framework).check_model_file
    except (ValueError, ImportError) as exc:
        return _fail(err, str(exc))
    try:
        report = check_file(str(path), batch_size=args.batch_size, target=args.target, tf32=_TF32[args.tf32])
    except Exception as exc:  # a corrupt or unloadable model file is bad input, not a crash
        return _fail(err, f"{path} is not a model this check can read ({type(exc).__name__}: {exc})")
    status, line = _status_line(report, args.fail_on)
    if args.json:
        print(report.to_json(), file=out)
    else:
        print(f"{report.header()} (from {path.name})", file=out)
        print(report, file=out)
        print(line, file=out)
    return status
