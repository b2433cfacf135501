"""The ``--quick`` option every benchmark script takes.

A quick run uses tiny sizes and one or two rounds, so the whole script (its arms, its ratios, its
table) runs in a few seconds: the test suite runs every benchmark this way
(``tests/test_benchmarks_quick.py``) so that none stops working unnoticed, and ``dev.py gpu --dry-run``
checks the arguments it would pass. The figures of a quick run are computed exactly as in a full run,
from far too little work to mean anything; the banner says so.

    python benchmarks/torch_overhead.py --quick
"""

from __future__ import annotations

import argparse
from typing import Any

BANNER = "quick mode: tiny sizes, one or two rounds; these figures show that the script runs, not timings"


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, **quick: Any) -> argparse.Namespace:
    """Parse ``argv`` with ``--quick`` and ``--check-args`` added to ``parser``.

    Under ``--quick`` the values in ``quick`` replace the parser's defaults; a value given on the
    command line still wins. ``--check-args`` prints the parsed arguments and exits with status 0
    without running anything: the GPU command's dry run uses it to check every command it would run.

    Args:
        parser: the script's parser, without the two options.
        argv: the arguments (``None``: ``sys.argv[1:]``).
        **quick: destination name -> value in a quick run; each must be one of the parser's options.

    Returns:
        The parsed arguments, ``args.quick`` among them.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> _ = parser.add_argument("--rounds", type=int, default=11)
        >>> parse_args(parser, ["--quick"], rounds=1).rounds
        quick mode: tiny sizes, one or two rounds; these figures show that the script runs, not timings
        1
    """
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 1-2 rounds, a few seconds: checks that the script runs and "
                             "prints its figures (the test suite runs this); the numbers mean nothing")
    parser.add_argument("--check-args", action="store_true",
                        help="parse the arguments, print them and exit without running anything")
    args = parser.parse_args(argv)
    unknown = sorted(name for name in quick if not hasattr(args, name))
    if unknown:
        raise ValueError(f"quick values for options the parser lacks: {unknown}")
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    if args.check_args:
        print(f"arguments parse: {vars(args)}")
        parser.exit(0)
    if args.quick:
        print(BANNER, flush=True)
    return args
