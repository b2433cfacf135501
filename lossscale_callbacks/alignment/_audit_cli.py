"""``lossscale-callbacks audit MODEL.keras [--data SAMPLES.npz] [--batches N] [--batch-size N] [--json]``.

The precision audit of a saved Keras model (:func:`lossscale_callbacks.keras.audit_keras_precision`): a few
forward and backward passes in float32, then in float16 with a growing keep-in-float32 set; prints
whether float16 fits, the layers to keep in float32 with the code for it, and a starting loss scale (or
the whole result as JSON). The model runs on the Keras backend of ``KERAS_BACKEND``. Exit status: 0
when float16 fits as it is, 1 when the advice asks for a change, 2 when the file cannot be audited.
The archive is bounded before it is read (``--max-unzipped-mib``), as by ``check``.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="lossscale-callbacks")
    >>> _ = add_audit_parser(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["audit", "model.keras", "--batches", "3"])
    >>> args.model, args.batches, args.batch_size, args.data, args.json
    ('model.keras', 3, 8, None, False)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import TextIO

from lossscale_callbacks._cli import fail, integer, positive_number, quiet_native_stderr
from lossscale_callbacks._extras import require
from lossscale_callbacks.alignment._check_limits import DEFAULT_MAX_UNZIPPED_MIB, ArchiveTooLargeError


def add_audit_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``audit`` command to an ``argparse`` subparsers object; ``args.handler(args)`` runs it."""
    parser = subparsers.add_parser(
        "audit", help="can a saved Keras model train in float16? what to keep in float32, where to start",
        description="Run a few sample batches of a saved Keras model in float32 and in float16: whether "
                    "float16 fits, which layers to keep in float32 (and the code), a starting loss scale.",
        epilog="Exit status: 0 float16 fits as it is; 1 the advice asks for a change; 2 the file cannot be "
               "audited.")
    parser.add_argument("model", help="a saved Keras model (.keras)")
    parser.add_argument("--data", default=None, help="sample batches: an .npz file with an array 'x' (and "
                        "'y' for the compiled loss); default: standard-normal inputs")
    parser.add_argument("--batches", type=integer("--batches", 1, 1000), default=2,
                        help="sample batches to run (default 2)")
    parser.add_argument("--batch-size", type=integer("--batch-size", 1, 2**20), default=8,
                        help="rows per sample batch (default 8)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--max-unzipped-mib", type=positive_number("--max-unzipped-mib"),
                        default=DEFAULT_MAX_UNZIPPED_MIB, metavar="MIB",
                        help="refuse an archive that would inflate to more than this "
                             f"(default {DEFAULT_MAX_UNZIPPED_MIB})")
    parser.set_defaults(handler=run_audit)
    return parser


def run_audit(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the ``audit`` command; returns the exit status.

    Raises:
        MissingExtraError: Keras is not installed (nothing is loaded then).
    """
    out, err = out or sys.stdout, err or sys.stderr
    path = Path(args.model)
    if not path.is_file():
        return fail("audit", f"{path}: no such file (give a saved model, .keras)", err)
    with quiet_native_stderr():  # TensorFlow's C++ start-up lines, as check and report silence them
        require("keras", "keras", feature="lossscale-callbacks audit")
        audit = importlib.import_module("lossscale_callbacks.keras._audit")
    try:
        result = audit.audit_model_file(str(path), data=args.data, batches=args.batches,
                                        batch_size=args.batch_size, max_unzipped_mib=args.max_unzipped_mib)
    except ArchiveTooLargeError as exc:
        return fail("audit", f"{exc}; --max-unzipped-mib sets the limit", err)
    except Exception as exc:  # a corrupt or unloadable file, or samples that do not fit: bad input
        return fail("audit", f"{path} could not be audited ({type(exc).__name__}: {exc})", err)
    if args.json:
        print(json.dumps(result.to_dict(), default=str), file=out)
    else:
        print(f"Precision audit of {path.name}", file=out)
        print(result.markdown(), file=out)
    return 0 if result.advice.fits else 1
