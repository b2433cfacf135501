"""Several check scripts of this folder in one process under one Keras backend.

Keras picks its backend at import, so each backend needs a process of its own; importing Keras and
the backend costs 2 to 4 s a process, paid once here instead of once a script:

    KERAS_BACKEND=jax python run_checks.py OUT_DIR backend_checks.py trace_checks.py ...

Each script runs as its own ``__main__`` (``runpy``) with ``sys.argv = [script, OUT_DIR/<stem>]``, after
the state one script could leave to the next is put back as a fresh process has it: Keras' session
cleared, the float32 dtype policy, seed 0, the warning filters of the start. Its ``RESULT`` line is
printed again as ``RESULT <script> <json>``. A script that raises ends the run, its name printed first.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import time
import warnings

import keras

HERE = os.path.dirname(os.path.abspath(__file__))


def _as_fresh(filters: list) -> None:
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    warnings.resetwarnings()  # "once" and "default" warnings show again, as in a new process
    warnings.filters[:] = filters


def main(out: str, scripts: list[str]) -> None:
    filters = list(warnings.filters)
    argv = list(sys.argv)
    for script in scripts:
        print(f"[run_checks] {script}", file=sys.stderr, flush=True)  # which script a failure is in
        folder = os.path.join(out, os.path.splitext(script)[0])
        os.makedirs(folder, exist_ok=True)
        _as_fresh(filters)
        sys.argv = [os.path.join(HERE, script), folder]
        printed = io.StringIO()
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(printed):
                runpy.run_path(sys.argv[0], run_name="__main__")
        finally:
            sys.argv = argv
            lines = printed.getvalue().splitlines()
            sys.stdout.write("".join(f"{line}\n" for line in lines if not line.startswith("RESULT ")))
        # what each script costs the suite, in the failure output and for whoever trims it
        print(f"[run_checks] {script}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        (line,) = (line for line in lines if line.startswith("RESULT "))
        print(f"RESULT {script} {line[len('RESULT '):]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
