"""The Keras precision audit (``audit_keras_precision``, ``keep_keras_layers_in_float32``) on TensorFlow, JAX
and torch, one process per backend (``tests/keras_scripts/audit_checks.py``), on the known-answer models of
the trace."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("keras")

from keras_backend_runs import BACKENDS, results_per_backend

KERAS_CHECKS = "audit_checks.py"  # run with the other modules' scripts, one process a backend


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return results_per_backend(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_audit_names_a_verified_keep_list(results, backend):
    r = results(backend)
    t5, attention = r["t5"]["audit"], r["attention"]["audit"]
    # wo overflows; its float32 output overflows again when cast into the float16 residual add
    assert (t5["fits"], t5["keep"], t5["verified"]) == (False, ["wo", "add"], True)
    assert (attention["fits"], attention["keep"], attention["verified"]) == (False, ["attn"], True)
    # its softmax saturates: the gradients' spread is at float16's 40 binades (bfloat16 advised, or not)
    assert "keep_keras_layers_in_float32(model, ['wo', 'add'])" in t5["markdown"]
    assert "Layer `wo` reaches |1.6" in t5["markdown"] and "float16 does not fit as it is." in t5["markdown"]
    # the audit puts every layer's dtype policy back
    assert t5["policies"] == attention["policies"] == ["float32"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_that_fits_gets_no_keep_list(results, backend):
    fits = results(backend)["fits"]["audit"]
    assert (fits["fits"], fits["keep"]) == (True, [])
    assert "float16 fits: no layer needs float32." in fits["markdown"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["t5", "attention"])
def test_the_keep_list_trains_float16_to_the_float32_loss(results, backend, model):
    r = results(backend)[model]
    assert math.isnan(r["unkept"]["loss"])  # NaN without the keep list
    kept, reference = r["kept"]["loss"], r["float32"]["loss"]
    # from the advised scale (the default 2^15 where the audit advises bfloat16 too): a few backoffs at most
    assert kept is not None and math.isfinite(kept) and r["kept"]["skipped"] <= 8
    assert abs(kept - reference) <= 0.05 * reference


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_advised_scale_is_within_one_backoff_of_where_the_scale_settles(results, backend):
    t5 = results(backend)["t5"]
    advised, settled = t5["audit"]["initial_scale"], t5["settled"]["scale"]
    assert abs(math.log2(advised) - math.log2(settled)) <= 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "lossscale_callbacks._cli", "audit", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow missing")
def test_the_audit_command_on_a_saved_keras_model(results):
    out = results("tensorflow")["out"]
    t5 = _cli(os.path.join(out, "t5.keras"), "--data", os.path.join(out, "t5.npz"))
    assert t5.returncode == 1, t5.stderr[-3000:]
    assert "float16 does not fit as it is." in t5.stdout
    assert "keep_keras_layers_in_float32(model, ['wo', 'add'])" in t5.stdout
    fits = _cli(os.path.join(out, "fits.keras"), "--json")  # no samples: standard-normal inputs
    assert fits.returncode == 0, fits.stderr[-3000:]
    # TensorFlow's C++ start-up lines are silenced, as report and check silence them
    assert "absl::InitializeLog" not in t5.stderr + fits.stderr and "oneDNN" not in t5.stderr + fits.stderr
    found = json.loads(fits.stdout.strip().splitlines()[-1])
    assert found["fits"] is True and found["advice"]["keep_float32"] == []
    missing = _cli(os.path.join(out, "nothing.keras"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
