"""``Fp8ScaleCallback`` on Keras' fp8 layers, on TensorFlow, JAX and torch (acceptance 1 and 3 of the fp8
issue, and 4 for TensorBoard): ``tests/keras_scripts/fp8_checks.py`` trains under each backend (one process a
backend, shared with the other Keras modules' scripts); its TensorBoard files are read back here with
TensorBoard's own reader, and ``lossscale-callbacks report`` is run on them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("keras")

from keras_backend_runs import BACKENDS, results_per_backend

KERAS_CHECKS = "fp8_checks.py"  # run with the other modules' scripts, one process a backend


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return results_per_backend(request, tmp_path_factory)


def _points(series: dict, field: str) -> dict[int, float]:
    return {int(s): v for s, v in series.get(f"fp8/d2/input/{field}", [])}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_outlier_at_step_30_is_counted_there_only_and_caught_up_at_step_32(results, backend):
    run = results(backend)["outlier"]
    series, recount = run["series"], {int(k): v for k, v in run["recount"].items()}
    # Counted at every step (count_every=1), read every 10: the interval ending at 30 holds the clipped
    # values, all of them at step 30, as many as the count made from the layer's own variables.
    saturated = _points(series, "saturated")
    assert saturated[30] == recount[30] > 500, (saturated, recount)
    assert all(recount[s] == 0 for s in recount if s != 30)
    assert saturated[10] == saturated[20] == saturated[40] == 0
    assert _points(series, "saturated_steps") == {10: 0, 20: 0, 30: 1, 40: 0}
    assert _points(series, "first_saturated_step") == {30: 30}
    # The scale, rebuilt for every step from the histories, and the one Keras read before each step:
    # unchanged through step 31, coarse from step 32 (its history holds step 30's amax from then on).
    scale = _points(series, "scale")
    witness = {int(k): v for k, v in run["witness_scale"].items()}
    assert sorted(scale) == list(range(1, 41))
    for step, keras_scale in witness.items():
        assert scale[step] == pytest.approx(1 / keras_scale, rel=1e-5), step
    assert scale[31] == pytest.approx(scale[30], rel=0.01) and scale[32] < scale[31] / 20
    assert witness[32] > 20 * witness[31]
    amax = _points(series, "amax")
    assert amax[30] > 40 * amax[29]
    print(f"{backend}: {saturated[30]} of d2's 2048 input values clipped at step 30 (recount {recount[30]}), "
          f"scale {scale[31]:.4g} at step 31, {scale[32]:.4g} at step 32")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_read_counts_its_own_interval_with_nothing_else_reading_the_model(results, backend):
    """The counts start again from zero after each read. On JAX that write goes into ``fit``'s live state
    (``_variable_reads``), and was lost there before (the state Keras shows is a copy): the next read then
    repeated the clipped values. Nothing else reads the model here, so nothing syncs that state."""
    assert results(backend)["no_gradient_warnings"] == []  # the tallies' own are filtered out
    series = results(backend)["unwitnessed"]["series"]
    saturated = _points(series, "saturated")
    assert saturated[20] > 500 and saturated[10] == saturated[30] == saturated[40] == 0, saturated
    assert _points(series, "saturated_steps") == {10: 0, 20: 1, 30: 0, 40: 0}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_waits_for_no_step_because_of_the_monitor_unless_a_rule_stops_it_there(results, backend):
    """Without a ``"stop"`` rule the monitor has no batch-end hook, so on JAX and torch Keras runs those
    hooks in its worker thread and dispatches the next step without waiting for this one's logs (the read
    after step 30 runs when step 31 starts, and still finds step 30's clipped values); TensorFlow's Keras
    waits either way. With ``health="stop"`` the monitor reads at each step's end and ``fit`` stops right
    after step 30, the step the saturation was found at."""
    waits = results(backend)["waits"]
    warn, stop = waits["warn"], waits["stop"]
    assert warn["on_main"] == ([True] if backend == "tensorflow" else [False])
    assert warn["steps"] == 40 and ["fp8_saturation", 30] in warn["verdicts"], warn
    assert stop["on_main"] == [True]
    assert stop["steps"] == 30 and stop["verdicts"][0][1] == 30, stop


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_begun_on_exhausted_data_is_no_step(results, backend):
    """With data of unknown length (a generator of 25 batches) Keras begins a 26th batch that runs no step.
    Counted by its start, it made the last reads one step late: every history looked replaced after step 20
    and the last interval was not rebuilt. The callback counts the train function's returns instead.

    TensorFlow's Keras half-runs that batch: ``optimizer.iterations`` counts it (26, without any callback)
    and the kernels' amax histories move once more, the inputs' and gradients' do not; the weights' then
    read as replaced, and a later ``fit`` starts from Keras' count (left as Keras has them)."""
    run = results(backend)["generator"]
    assert run["counting_kept"]  # the second fit runs the counting function the first traced
    (first, optimizer, ended), second = run["steps"]
    assert first == ended == 25, run
    assert run["scale_steps"][:25] == list(range(1, 26))
    if backend == "tensorflow":
        assert optimizer == 26 and second == [41, 42, 40]
        assert run["replaced"][0] and all("/weight/" in name for name in run["replaced"][0])
    else:
        assert run["replaced"][0] == []
        assert optimizer == 25 and second == [40, 40, 40]
        assert run["replaced"][1] == [] and run["scale_steps"] == list(range(1, 41))
    assert run["verdicts"] == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_coarse_scale_finding_names_d2_and_the_history_and_a_short_history_ends_it(results, backend):
    run = results(backend)
    coarse = [v for v in run["outlier"]["verdicts"] if v[0] == "fp8_coarse_scale" and "`d2`'s input" in v[2]]
    (_, step, words), = coarse
    assert step == 40 and "1024-step history" in words and "step 30" in words and "until step 1055" in words
    assert "amax_history_length" in words
    # With an 8-step history, read every 5 steps: the finding fires at 35 and is gone by step 40.
    short = run["short"]
    ratio = _points(short["series"], "history_ratio")
    assert ratio[35] > 20 and ratio[40] < 2
    assert _points(short["series"], "coarse_until") == {35: 39}
    found = [v for v in short["verdicts"] if v[0] == "fp8_coarse_scale" and "`d2`'s input" in v[2]]
    assert [v[1] for v in found] == [35] and "8-step history" in found[0][2]
    assert "Health:" in run["outlier"]["summary"] and "`d2`'s input" in run["outlier"]["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_of_step_20_loaded_after_step_30_is_stale_before_the_first_step_on_it(results, backend):
    stale = results(backend)["stale"]
    (step, ratio), = stale["stale"]  # the read at the start of the next fit, before any step on it
    assert ratio > 4
    found = [v for v in stale["verdicts"] if v[0] == "fp8_stale_history" and "`d2`'s input" in v[2]]
    assert len(found) == 1 and "after step 30" in found[0][2] and "PR #567" in found[0][2]
    assert found[0][1] == step  # the step count the load brought back (its optimizer's)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensorboard_holds_the_metrics_and_report_says_the_findings(results, backend):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    run = os.path.join(results(backend)["out"], "tb")
    acc = EventAccumulator(run, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    values = {}
    for tag in acc.Tags()["tensors"]:
        values[tag] = {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors(tag)}
    for tag in acc.Tags()["scalars"]:
        values[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    assert float(values["fp8/d2/input/saturated"][30]) == results(backend)["outlier"]["series"][
        "fp8/d2/input/saturated"][2][1]
    assert sorted(values["fp8/d2/input/scale"]) == list(range(1, 41))
    assert float(values["fp8/d2/input/coarse_until"][40]) == 1055
    done = subprocess.run([sys.executable, "-m", "lossscale_callbacks._cli", "report", run],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "no loss scaling logged" in text and "9 tensors of 3 layers" in text
    assert "`d2`'s input saturated at step 30" in text and "coarser than its values need" in text
    assert "1024-step history" in text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch missing")
def test_the_ops_a_step_adds_on_the_torch_backend_are_counted(results):
    ops = results("torch")["ops"]
    # An ordinary step adds nothing: the layers run as they are and the tally, without a gradient, is left
    # by the optimizer (on JAX alone an identity passes it on: an unconnected variable's gradient is zero).
    added, counted = ops["ordinary"] - ops["bare"], ops["counted"] - ops["bare"]
    assert added == 0, ops
    assert 0 < counted <= 120 * 3, ops
    print(f"Keras on torch, 3 fp8 Dense layers: {ops['bare']} aten ops a step, +{added} on an ordinary "
          f"step, +{counted} on a counted one")


@pytest.mark.slow
@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "torch"])
def test_the_ops_a_traced_step_adds_on_tensorflow_and_jax_are_counted(results, backend):
    ops = results(backend)["ops"]
    added, counted = ops["ordinary"] - ops["bare"], ops["counted"] - ops["bare"]
    if backend == "tensorflow":
        # The ordinary step's graph is the step without the monitor: the tally has no gradient, no op.
        assert added == 0, ops
    else:
        # JAX passes each layer's tally on (its gradient would be zero otherwise): a copy, at most, a layer.
        assert 0 <= added <= 2 * 3, ops
    assert counted > 3 * 10, ops
    print(f"Keras on {backend}, 3 fp8 Dense layers: {ops['bare']} ops a step, +{added} on an ordinary step, "
          f"+{counted} on a counted one")
