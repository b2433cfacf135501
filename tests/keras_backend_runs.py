"""Runs a script of ``tests/keras_scripts`` under one Keras backend in its own process (Keras picks its
backend at import) and returns the JSON line it prints after ``RESULT``; shared by the multi-backend tests.

JAX gets two host CPU devices (``XLA_FLAGS``) for ``keras.distribution.DataParallel``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "keras_scripts")
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(importlib.util.find_spec(b) is None,
                                                     reason=f"{b} is not installed"))
            for b in ("tensorflow", "jax", "torch")]


def run_backend_script(script: str, backend: str, out: str) -> dict:
    """``KERAS_BACKEND=<backend> python keras_scripts/<script> <out>``: its results, ``out`` added."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "out": str(out)}


def results_per_backend(script: str, tmp_path_factory) -> object:
    """A function ``backend -> results`` that runs ``script`` once per backend and keeps what it said."""
    cache: dict[str, dict] = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            cache[backend] = run_backend_script(script, backend, str(tmp_path_factory.mktemp(backend)))
        return cache[backend]

    return get
