"""The forward trace of ``LossScaleCallback(diagnose=...)`` on TensorFlow, JAX and torch, one process per
backend (``tests/keras_scripts/trace_checks.py``): known-answer models under ``mixed_float16`` on the CPU."""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("keras")

from keras_backend_runs import BACKENDS, results_per_backend

KERAS_CHECKS = "trace_checks.py"  # run with the other modules' scripts, one process a backend


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return results_per_backend(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dense_output_crossing_65504_is_named_at_its_step(results, backend):
    dense = results(backend)["cases"]["dense"]
    assert (dense["producer"], dense["producer_step"], dense["passed_on"]) == ("grow", 16, ["norm", "head"])
    # the traced steps before it: grow's output 4000 t at step t - 1, exact in float16
    assert dense["steps"] == [12, 13, 14, 15, 16]
    assert [row[0] for row in dense["maxima"]] == [52000.0, 56000.0, 60000.0, 64000.0, "inf"]
    assert dense["maxima"][-1][1:] == ["nan", "nan"]
    assert dense["traced_total"] == 20 and not dense["armed"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ordinary_step_of_fit_carries_nothing_of_the_trace(results, backend):
    """At the default schedule the trace is in 3 of 250 steps (0, 100, 200) and nowhere else: on TensorFlow
    and JAX ``fit`` runs a train function compiled without it (the trace's code ran only to compile the
    traced one, which JAX traces twice; no ``cond``: the host chose the step), on torch the host skips it
    step by step."""
    schedule = results(backend)["schedule"]
    assert schedule["traced"] == 3, schedule
    assert schedule["cond"] == 0, schedule
    expected = {"tensorflow": 1, "jax": 2, "torch": 3}[backend]
    assert schedule["step_vector"] == schedule["fold"] == expected, schedule


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overflow_at_an_untraced_step_is_named_at_the_next(results, backend):
    sampled = results(backend)["cases"]["dense_every_5"]
    # step 16 (not due) overflowed and was skipped: step 17 was traced because of it
    assert (sampled["producer"], sampled["producer_step"], sampled["armed"]) == ("grow", 17, True)
    assert sampled["steps"] == [0, 5, 10, 15, 17]
    assert [row[0] for row in sampled["maxima"][:4]] == [4000.0, 24000.0, 44000.0, 64000.0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_t5_feed_forward_producer_is_wo_not_the_norm(results, backend):
    t5 = results(backend)["cases"]["t5"]
    assert (t5["producer"], t5["producer_step"]) == ("wo", 0)
    assert t5["passed_on"] == ["add", "norm", "head"]
    assert t5["maxima"][0][:2] == [pytest.approx(0.601, abs=1e-3), "inf"] and t5["maxima"][0][3] == "nan"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_scores_overflowing_before_softmax_name_the_attention_layer(results, backend):
    attention = results(backend)["cases"]["attention"]
    # query/key/value are finite; the scores are made inside `attn`, the softmax only passes them on
    assert attention["producer"] == "attn"
    assert attention["passed_on"] == ["attn/softmax", "flat", "head"]
    finite = dict(zip(attention["layers"], attention["maxima"][0], strict=True))
    assert all(isinstance(finite[f"attn/{n}"], float) for n in ("query", "key", "value"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_that_fits_has_no_producer(results, backend):
    fits = results(backend)["cases"]["fits"]
    assert fits["producer"] is None and fits["producer_counts"] == {} and fits["passed_on"] == []
    assert fits["layers"] == ["hidden", "out"]
    assert all(isinstance(v, float) and 0 < v < 65504 for row in fits["maxima"] for v in row)
    # every 3rd step (step 0 is in the first interval), plus a step after an untraced skip
    assert {3, 6, 9} <= set(fits["steps"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch missing")
def test_torch_trace_adds_no_host_read_per_step(results):
    reads = results("torch")["host_reads"]
    # the step's own read of the skip flag (one per step), with the trace on every step or without
    assert reads == {"4/False": 4, "4/every_step": 4, "8/False": 8, "8/every_step": 8}


def _tensorboard(run: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[str]]]:
    """The scalar series and the texts of a run (TensorFlow's writer stores both as tensors)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(run, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    series = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts: dict[str, list[str]] = {}
    for tag in acc.Tags()["tensors"]:
        values = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
        if all(v.dtype == object for _, v in values):
            texts[tag] = [(v.item() if v.ndim == 0 else v.flat[0]).decode(errors="replace")
                          for _, v in values]
        elif all(v.ndim == 0 for _, v in values):
            series[tag] = [(s, float(v)) for s, v in values]
    return series, texts


PRODUCER = ("Layer `wo` produced the first non-finite activation (Inf) at step 0: its inputs were finite, "
            "its output was not (`add`, `norm`, `head` passed it on). Keep `wo` in float32.")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_words_in_the_summary_tensorboard_wandb_and_report(results, backend):
    pytest.importorskip("tensorboard")
    board = results(backend)["dashboards"]
    assert "Layer `wo` produced a non-finite activation from finite inputs" in board["summary"]
    assert "Keep these layers in float32: `wo`." in board["summary"]
    series, texts = _tensorboard(board["tensorboard"])
    assert any(PRODUCER in text for text in texts["loss_scale/activations"])
    assert any("Keep these layers in float32: `wo`" in text for text in texts["loss_scale/advice"])
    assert sum(v for _, v in series["loss_scale/activation_producer/wo"]) >= 1
    # wi's outputs are about 0.6 (float16 rounding differs a little by backend)
    wi = series["loss_scale/activation_headroom/wi"][0][1]
    assert math.log2(65504 / 0.62) < wi < math.log2(65504 / 0.57)
    report = subprocess.run([sys.executable, "-m", "lossscale_callbacks._cli", "report",
                             board["tensorboard"]], capture_output=True, text=True, timeout=120)
    assert "Layer `wo` produced a non-finite activation from finite inputs" in report.stdout, report.stdout
    from lossscale_callbacks.wandb import _reader as reader
    (run,) = glob.glob(os.path.join(board["wandb"], "offline-run-*"))
    reader.wait_until_finished(run)
    assert sum(v for _, v in reader.read_run(run)["loss_scale/activation_producer/wo"]) >= 1
    tables = [row for tag, _, _, rows in reader.read_tables(run) for row in rows if "advice" in tag]
    assert any("Keep these layers in float32: `wo`" in str(row) for row in tables), reader.read_tables(run)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "torch"])
def test_the_hosts_schedule_stays_inside_fit(backend, tmp_path):
    """The host picks the traced steps only while one of the callback's train functions runs: with
    ``steps_per_execution=4`` the device schedules them (the host would trace whole executions), a custom
    loop traces on the device's schedule, a ``fit`` cut short leaves nothing switched on, and on JAX a traced
    train function made mid-epoch under ``DataParallel`` finds its variables (it failed before)."""
    from keras_backend_runs import run_backend_script

    result = run_backend_script("fit_schedule_edges.py", backend, str(tmp_path))
    assert result["steps_per_execution"] == [0, 10, 20, 30]
    assert result["interrupted"] == {"trace": False, "wiring": False}
    if backend == "tensorflow":
        assert result["custom_loop"] == [1, 1, 1]
    else:
        assert result["data_parallel"] >= 1
