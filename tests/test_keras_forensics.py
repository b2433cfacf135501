"""Overflow forensics of the Keras integration on TensorFlow, JAX and torch, one process per backend.

``tests/keras_scripts/forensics_checks.py`` does the work under ``KERAS_BACKEND=<backend>`` and prints
its results (JAX gets two host CPU devices for ``keras.distribution.DataParallel``); the TensorBoard
files it writes are read back here, and ``lossscale-callbacks report`` is run on them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from lossscale_callbacks.forensics._gradients import FORENSICS_TAG

pytest.importorskip("keras")
pytest.importorskip("tensorboard")

from keras_backend_runs import BACKENDS, results_per_backend

ORDER = ["poisonable", "dense", "poisonable_1", "dense_1"]  # the model's forward order


KERAS_CHECKS = "forensics_checks.py"  # run with the other modules' scripts, one process a backend


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return results_per_backend(request, tmp_path_factory)


def _tensorboard(run: str) -> tuple[dict[str, list[float]], list[str]]:
    """The scalar series and the forensics texts of a run (TensorFlow's writer stores both as tensors)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(run, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    series = {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts = []
    for tag in acc.Tags()["tensors"]:
        values = [tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors(tag)]
        if tag.startswith(FORENSICS_TAG):
            texts += [v.item().decode() if v.dtype == object else str(v) for v in values]
        elif all(v.dtype != object and v.ndim == 0 for v in values):
            series[tag] = [float(v) for v in values]
    return series, texts


def _no_negative_below(text: str) -> None:
    assert not re.search(r"2\^-[\d.]+ below", text), text


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_names_the_layer_and_the_causes_in_the_summary_tensorboard_and_report(results, backend):
    r = results(backend)
    assert r["backend"] == backend
    summary = r["acceptance"]["summary"]
    # Inf in the kernel gradient of the default-named `poisonable` at 2 steps, a NaN loss at 1 step
    assert summary.startswith("Loss scaling: 10 optimizer steps, 3 skipped")
    assert "The loss itself was non-finite (Inf/NaN) in 1 step" in summary
    assert "2 skipped steps had Inf gradients with a finite loss" in summary
    assert "The overflow started in layer `poisonable` in all 2 skipped steps" in summary
    assert "| `poisonable` | 2 of 2 | 2 of 2 |" in summary
    assert "`dense`" not in summary and "`dense_1`" not in summary
    _no_negative_below(summary)
    tb = os.path.join(r["out"], "tb")
    series, texts = _tensorboard(tb)
    layer_tags = sorted(t for t in series if t.startswith("loss_scale/layer_"))
    assert layer_tags == ["loss_scale/layer_origins/poisonable", "loss_scale/layer_skips/poisonable"]
    assert sum(series["loss_scale/layer_skips/poisonable"]) == 2  # a point at every interval, 2 in all
    assert sum(series["loss_scale/layer_origins/poisonable"]) == 2
    assert any("The overflow started in layer `poisonable`" in t for t in texts)
    proc = subprocess.run([sys.executable, "-m", "lossscale_callbacks._cli", "report", tb],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Skip causes (overflow forensics): 1 non-finite loss, 2 Inf gradients" in proc.stdout
    assert "The overflow started in layer `poisonable` in all 2 skipped steps" in proc.stdout
    _no_negative_below(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_origin_is_the_poisoned_layer_in_forward_order(results, backend):
    origins = results(backend)["origins"]
    # an Inf in the late layer's output gradient: every earlier layer is flagged, the origin is the late one
    late = origins["output"]
    assert late["order"] == ORDER
    assert late["skips"] == {"poisonable": 2, "dense": 2, "poisonable_1": 2}
    assert late["origins"] == {"poisonable_1": 2}
    # an Inf in the first layer's weight gradient only: it is flagged alone, and is the origin
    first = origins["kernel"]
    assert first["skips"] == {"poisonable": 2} and first["origins"] == {"poisonable": 2}
    assert first["causes"]["grad_inf"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_map_to_layers_by_variable(results, backend):
    r = results(backend)["by_variable"]
    assert r["reversed"] == [{"dense_2": 1}, {"dense_2": 1}]  # variables passed last layer first
    assert r["subset"] == [{"dense": 1}, {"dense": 1}]  # only the first layer's variables
    finite = r["subset_finite"]
    assert finite["skips"] == {} and (finite["steps"], finite["skipped"]) == (3, 2)
    assert finite["moved"] == [False, False, True, True, True, True]  # only the variables given


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_freeze_and_recompile_with_the_same_optimizer(results, backend):
    freeze = results(backend)["freeze"]
    if backend == "jax":
        # Keras' JAX trainer passes only the trainable values: its own optimizers refuse this too
        assert freeze["error"].startswith("trainable_variables: expected 8 values")
        assert "compile with a new optimizer" in freeze["error"]
    else:
        # the frozen first layer has no gradient; the late layer's output gradient was poisoned
        assert freeze["totals"]["skips"] == {"dense": 1, "poisonable_1": 1}
        assert freeze["totals"]["origins"] == {"poisonable_1": 1}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_headroom_and_histogram_match_numpy(results, backend):
    room = results(backend)["headroom"]
    assert room["headroom"] and room["histogram"] and room["underflowing"] > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch missing")
def test_torch_backend_forensics_add_no_host_read(results):
    reads = results("torch")["host_reads"]
    # one read per step (the skip flag, as Keras' own optimizer on torch), with forensics or without
    assert reads["False"] == reads["True"] == 6
    assert reads["skips"] == {"dense_1": 1}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax missing")
def test_jax_data_parallel_names_the_origin(results):
    dp = results("jax")["data_parallel"]
    assert dp["devices"] == 2
    # the late layer's output gradient poisoned in one row of the second device's shard
    assert dp["totals"]["skips"] == {"poisonable": 1, "dense": 1, "poisonable_1": 1}
    assert dp["totals"]["origins"] == {"poisonable_1": 1}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_samples_the_headroom_every_headroom_every_steps(results, backend):
    # JAX's fit decides the samples on the host (two train functions), the others on their own schedule.
    assert results(backend)["fit_samples"] == {"sampled": [0, 3, 6]}
