"""Runs the scripts of ``tests/keras_scripts`` under one Keras backend in a process of their own (Keras
picks its backend at import) and returns the JSON line each prints after ``RESULT``; shared by the
multi-backend tests. The check scripts of a session share one process a backend (``results_per_backend``).

JAX gets two host CPU devices (``XLA_FLAGS``) for ``keras.distribution.DataParallel``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import background
import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "keras_scripts")
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(importlib.util.find_spec(b) is None,
                                                     reason=f"{b} is not installed"))
            for b in ("tensorflow", "jax", "torch")]


def run_backend_script(script: str, backend: str, out: str) -> dict:
    """``keras_scripts/<script>`` under ``KERAS_BACKEND=<backend>`` in a process of its own: its results,
    ``out`` (where its files went, a folder under ``out``) added."""
    return run_backend_scripts([script], backend, out)[script]


# (backend, script) -> its results, for the whole session: every module's fixture shares the processes.
_RESULTS: dict[tuple[str, str], dict] = {}


def _scripts_asked_for(items: list) -> list[str]:
    """The check scripts of the tests this session runs (each module names its own as ``KERAS_CHECKS``)."""
    return sorted({item.module.KERAS_CHECKS for item in items
                   if getattr(getattr(item, "module", None), "KERAS_CHECKS", None)})


def start_in_background(items: list, tmp_path_factory) -> None:
    """One background run a backend that the session's Keras check tests ask for (``tests/background.py``):
    every check script they ask for, in one process."""
    scripts = _scripts_asked_for(items)
    for index, item in enumerate(items):
        backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
        if (not getattr(item.module, "KERAS_CHECKS", None) or not isinstance(backend, str)
                or background.submitted(("keras", backend)) or importlib.util.find_spec(backend) is None):
            continue
        out = str(tmp_path_factory.mktemp(backend))
        argv, env, timeout = _command(scripts, backend, out)
        background.submit(("keras", backend), argv, env=env, timeout=timeout, order=index)
        if background.submitted(("keras", backend)):  # not with LOSSSCALE_TEST_LANES=0: run when asked for
            _BACKGROUND[backend] = out


# backend -> the folder of its run started in the background
_BACKGROUND: dict[str, str] = {}


def results_per_backend(request: pytest.FixtureRequest, tmp_path_factory) -> object:
    """A function ``backend -> results`` of the requesting module's ``KERAS_CHECKS`` script.

    One process a backend (``keras_scripts/run_checks.py``) runs every check script that the session's
    tests ask for under it: Keras and the backend are imported once a backend, not once a script (the four
    scripts on three backends: 205 -> 158 s here). It starts at the start of the session and runs while
    the other tests run (``start_in_background``); else the first time a backend is asked for. Selecting
    one module's tests runs only its script.
    """
    script = request.module.KERAS_CHECKS

    def get(backend: str) -> dict:
        if (backend, script) not in _RESULTS and backend in _BACKGROUND:  # (a failed run fails every time)
            parsed = _parse(background.wait(("keras", backend)), _BACKGROUND[backend])
            _RESULTS.update(((backend, name), result) for name, result in parsed.items())
        if (backend, script) not in _RESULTS:
            scripts = [s for s in _scripts_asked_for(request.session.items) if (backend, s) not in _RESULTS]
            out = tmp_path_factory.mktemp(backend)
            for name, result in run_backend_scripts(scripts or [script], backend, str(out)).items():
                _RESULTS[backend, name] = result
        return _RESULTS[backend, script]

    return get


def _command(scripts: list[str], backend: str, out: str) -> tuple[list[str], dict, int]:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return [sys.executable, os.path.join(SCRIPTS, "run_checks.py"), out, *scripts], env, 300 * len(scripts)


def _parse(proc, out: str) -> dict[str, dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, name, payload = line.split(" ", 2)
            results[name] = {**json.loads(payload), "out": os.path.join(out, os.path.splitext(name)[0])}
    return results


def run_backend_scripts(scripts: list[str], backend: str, out: str) -> dict[str, dict]:
    """``scripts`` in one process under ``KERAS_BACKEND=<backend>`` (``keras_scripts/run_checks.py``), each
    one's files in ``out/<its name>``: script -> its results, ``out`` (that folder) added."""
    argv, env, timeout = _command(scripts, backend, out)
    return _parse(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout), out)
