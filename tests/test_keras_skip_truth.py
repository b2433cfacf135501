"""Skip truth on Keras (TensorFlow, JAX, torch): a skipped step does not count in ``iterations``, so a
``LearningRateSchedule`` and ``use_ema`` are held on every path of ours (the runs are
``tests/keras_scripts/skip_checks.py``, one process a backend with the session's other check scripts)."""

from __future__ import annotations

import pytest

pytest.importorskip("keras")

from keras_backend_runs import BACKENDS, results_per_backend

KERAS_CHECKS = "skip_checks.py"  # run with the other modules' scripts, one process a backend


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return results_per_backend(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["fit", "loop"])
def test_an_inf_at_steps_3_17_42_of_100_leaves_iterations_97_and_holds_the_schedule_and_the_ema(
        results, backend, path):
    r = results(backend)
    run, ref = r[path]["injected"], r[path]["reference"]
    assert (run["steps"], run["skipped"]) == (100, 3)
    assert run["iterations"] == run["inner_iterations"] == ref["iterations"] == 97
    # the schedule is read at the applied count, not at the 100 attempted steps
    assert run["learning_rate"] == ref["learning_rate"] == r["applied_rate"] != r["attempted_rate"]
    # use_ema: the moving averages (written into the model at the end) and the weights are the reference's
    assert run["ema"] == ref["ema"] and run["weights"] == ref["weights"]
    if path == "fit":
        assert run["optimizer"] == "LossScaleOptimizer"  # the callback installed ours in compile's place


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_outcome_code_is_the_core_function_on_every_backend(results, backend):
    """step_code, rule_finite and is_applied (the core's, written once against Ops) give the NumPy
    reference's answers on Keras' ops (and tf's) for every input."""
    from lossscale_callbacks.skips._outcomes import CODES, is_applied, rule_finite, step_code

    reference = [[int(step_code(n, s, skip)), bool(rule_finite(n, skip))]
                 for skip in (True, False) for n in (False, True) for s in (False, True)]
    for ops in results(backend)["codes"].values():
        assert ops["table"] == reference
        assert ops["applied"] == [bool(is_applied(c)) for c in CODES]
