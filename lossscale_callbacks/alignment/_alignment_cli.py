"""``lossscale-callbacks check MODEL.keras --batch-size N [--json] [--target GPU]``: the alignment check.

Loads the model file (without compiling it), traces one training step at the given batch size (shapes
only: no batch is allocated, so ``--batch-size 1000000000`` costs what 8 does) and prints a header (model,
target, precision, batch size, TF32), the findings table and a line explaining the exit status (or the
whole report as JSON). Exit status: 0 when nothing is at least as severe as ``--fail-on`` (default
``high``), 1 when something is, 2 when the file cannot be checked. TensorFlow's own start-up logging
is silenced. Needs Keras and its TensorFlow backend (``pip install "lossscale-callbacks[keras]"
tensorflow``); a missing one is named with that command before anything is loaded. What a file may
cost is bounded first (:mod:`lossscale_callbacks.alignment._check_limits`): ``--max-unzipped-mib``,
``--batch-size`` up to 2**31 - 1, and ``--recursion-limit`` for deeply nested models. Each stage
(the import of TensorFlow, Keras' load, the trace, the rules) is said on stderr as it starts and
ends (``--progress``; by default when stderr is a terminal), and a ``Time:`` line says the seconds
each took.

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
import functools
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from lossscale_callbacks._cli import fail, integer, positive_number, quiet_native_stderr
from lossscale_callbacks._extras import MissingExtraError, install_hint
from lossscale_callbacks.alignment._check_limits import (
    DEFAULT_MAX_UNZIPPED_MIB,
    DEFAULT_RECURSION_LIMIT,
    MAX_BATCH_SIZE,
    ArchiveTooLargeError,
    ModelTooDeepError,
    run_deep,
)
from lossscale_callbacks.alignment._checkers import framework_of_file, load_checker
from lossscale_callbacks.alignment._report import AlignmentReport
from lossscale_callbacks.alignment._targets import TARGETS

_TF32 = {"auto": None, "on": True, "off": False}
_NEEDS = (f'Keras and its TensorFlow backend: {install_hint("keras")} tensorflow (tensorflow-cpu on a '
          "machine without a GPU)")


def _require_keras_and_tensorflow() -> None:
    """Name the install command when Keras or TensorFlow is missing (nothing is imported to find out)."""
    missing = [name for name in ("keras", "tensorflow") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(f"check needs {_NEEDS}; not installed: {', '.join(missing)}")


def _fail(err: TextIO, message: str) -> int:
    return fail("check", message, err)


def add_check_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``check`` command to an ``argparse`` subparsers object; ``args.handler(args)`` runs it."""
    parser = subparsers.add_parser(
        "check", help="check a saved model's shapes against the Tensor Core rules "
                      "(needs the [keras] extra and TensorFlow)",
        description="Trace one training step of a saved Keras model and report the layer dimensions that "
                    "keep Tensor Cores from running at full speed, and mixed-precision problems. Needs "
                    f"{_NEEDS}.",
        epilog="Exit status: 0 nothing at or above --fail-on; 1 something is; 2 the file cannot be checked "
               "(missing, not a model, too big to inflate, nested too deeply).")
    parser.add_argument("model", help="a saved Keras model (.keras)")
    parser.add_argument("--batch-size", default=8,
                        type=integer("--batch-size", 1, MAX_BATCH_SIZE, ": TensorFlow computes some "
                                      "shapes of the traced step in 32-bit integers"),
                        help="training batch size (a GEMM dimension too), up to 2**31 - 1; default 8")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--target", choices=sorted(TARGETS), default=None,
                        help="GPU whose recommendations (128-byte alignment, SM count) apply")
    parser.add_argument("--tf32", choices=sorted(_TF32), default="auto",
                        help="whether float32 runs as TF32 (default: TensorFlow's own setting)")
    parser.add_argument("--fail-on", choices=("high", "medium", "low", "never"), default="high",
                        help="lowest severity that makes the exit status 1 (default high)")
    parser.add_argument("--max-unzipped-mib", type=positive_number("--max-unzipped-mib"),
                        default=DEFAULT_MAX_UNZIPPED_MIB, metavar="MIB",
                        help="refuse a .keras archive that would inflate to more than this (config, metadata "
                             f"and weights together; default {DEFAULT_MAX_UNZIPPED_MIB} MiB): raise it for a "
                             "bigger model")
    parser.add_argument("--recursion-limit", default=DEFAULT_RECURSION_LIMIT,
                        type=integer("--recursion-limit", 100),
                        metavar="FRAMES", help="Python frames the check may use to load and trace the model "
                        f"(Keras recurses a few per layer of a chain; default {DEFAULT_RECURSION_LIMIT})")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="say each stage (load, trace, rules) on stderr as it starts and ends, with its "
                             "seconds (default auto: when stderr is a terminal)")
    parser.set_defaults(handler=run_check)
    return parser


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

    ``check_file(path, batch_size=, target=, tf32=, max_unzipped_mib=) -> AlignmentReport`` replaces the
    framework's loader (tests).

    Raises:
        MissingExtraError: Keras or TensorFlow is not installed (nothing is loaded then).
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
    say, imported = _progress(args, err), None
    try:
        if check_file is None:
            check_file, imported = _load_check_file(path, say)
    except MissingExtraError:
        raise  # the console script says it in one line; main() callers get the ImportError
    except (ValueError, ImportError) as exc:
        return _fail(err, str(exc))
    check = functools.partial(check_file, str(path), batch_size=args.batch_size, target=args.target,
                              tf32=_TF32[args.tf32], max_unzipped_mib=args.max_unzipped_mib,
                              **({"progress": say} if say and imported is not None else {}))
    try:
        report = run_deep(check, args.recursion_limit)
    except ArchiveTooLargeError as exc:
        return _fail(err, f"{exc}; --max-unzipped-mib sets the limit")
    except ModelTooDeepError as exc:
        return _fail(err, f"{path}: loading and tracing the model needs more than --recursion-limit "
                          f"{exc.limit} Python frames (it is nested too deeply for that); raise it, for "
                          f"example --recursion-limit {exc.limit * 4}")
    except Exception as exc:  # a corrupt or unloadable model file is bad input, not a crash
        return _fail(err, f"{path} is not a model this check can read ({type(exc).__name__}: {exc})")
    status, line = _status_line(report, args.fail_on)
    if args.json:
        print(report.to_json(), file=out)
    else:
        print(f"{report.header()} (from {path.name})", file=out)
        print(report, file=out)
        seconds = report.context.get("seconds")
        if seconds:
            print(_time_line({"import": imported, **seconds}), file=out)
        print(line, file=out)
    return status


def _progress(args: argparse.Namespace, err: TextIO) -> Callable[[str], None] | None:
    """What says each stage on ``err`` when asked for (or when ``err`` is a terminal), else None."""
    wanted = args.progress == "on" or (args.progress == "auto" and getattr(err, "isatty", bool)())
    return (lambda line: print(f"check: {line}", file=err, flush=True)) if wanted else None


def _load_check_file(path: Path, say: Callable[[str], None] | None) -> tuple[Callable, float]:
    """The framework's ``check_model_file`` and the seconds its import took (TensorFlow's start-up
    lines silenced)."""
    framework = framework_of_file(path)
    _require_keras_and_tensorflow()
    if say:
        say("importing Keras and TensorFlow")
    start = time.perf_counter()
    with quiet_native_stderr():
        check_file = load_checker(framework).check_model_file
    return check_file, time.perf_counter() - start


def _time_line(seconds: dict) -> str:
    """Where the check's time went: Keras' own load, the trace of one step, the rules."""
    stages = {"import": "importing Keras and TensorFlow", "load": "loading the model (Keras)",
              "capture": "tracing one step (TensorFlow)", "rules": "the rules"}
    parts = [f"{words} {seconds[key]:.1f} s" for key, words in stages.items() if seconds.get(key) is not None]
    return f"Time: {', '.join(parts)}."
