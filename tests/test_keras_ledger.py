"""The ledger of bad steps in Keras ``fit`` and the optimizer's device ring of step outcomes behind it.

The acceptance scenario runs on TensorFlow, JAX and torch (``tests/keras_scripts/ledger_checks.py``, one
process a backend with the session's other check scripts): with NumPy inputs (``shuffle=False``) and a
shuffled ``tf.data`` pipeline, the ledger holds exactly the steps whose batch held sample 37 or 301, each with
its epoch and batch index (and its rows, for NumPy), the cause and scale from the ring, ``fc2`` as the layer
that produced the overflow, and the one-off fault at step 50; the ops the ring adds to a step are counted.
The ring itself: ``tests/test_keras_outcome_ring.py``."""

from __future__ import annotations

import pytest

keras = pytest.importorskip("keras")

from keras_backend_runs import BACKENDS, results_per_backend  # noqa: E402

from lossscale_callbacks.keras import LossScaleCallback  # noqa: E402
from lossscale_callbacks.keras._ledger import NO_REPLAY  # noqa: E402
from lossscale_callbacks.keras._outcome_ring import OPS_PER_STEP  # noqa: E402

KERAS_CHECKS = "ledger_checks.py"  # run with the other modules' scripts, one process a backend
INJECT_AT, FP16_MAX = 50, 65504.0
# The steps whose batch holds sample 37 or 301: rows in order (batch 4 holds 37, batch 37 holds 301; 64
# an epoch), and tf.data's shuffle with seed 0 (one order for the 3 epochs), the same on every backend.
KNOWN = {"numpy": [5, 38, 69, 102, 133, 166], "tf_data": [30, 32, 94, 96, 158, 160]}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return results_per_backend(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inputs", ["numpy", "tf_data"])
def test_keras_fit_ledger_holds_exactly_the_bad_samples_steps_with_epoch_batch_and_fc2(results, backend,
                                                                                       inputs):
    r = results(backend)
    assert r["maxima"]["fc1"] < FP16_MAX < r["maxima"]["fc2"]  # the scenario's premise
    run = r["runs"][inputs]
    expected = {int(step): tuple(v) for step, v in run["expected"].items()}
    assert sorted(expected) == KNOWN[inputs]  # the order fit took, read from the data: the known answer
    entries = {e["step"]: e for e in run["entries"]}
    assert sorted(entries) == sorted([*expected, INJECT_AT]) and run["steps"] == 192
    for k, step in enumerate(sorted(entries)):
        entry = entries[step]
        assert entry["cause"] == "overflow" and entry["applied"] is False
        assert entry["scale"] == 1024.0 / 2**k  # each skip halved the scale: the scale the step used
        assert entry["replay"] is None and entry["replay_note"] == NO_REPLAY
        (micro,) = entry["micro_batches"]
        assert (micro["epoch"], micro["batch"]) == ((step - 1) // 64, (step - 1) % 64)
        if step == INJECT_AT:
            assert entry["producing_layer"] == ("poison" if inputs == "numpy" else None)  # not a sample's
            continue
        epoch, batch, bad = expected[step]
        assert (micro["epoch"], micro["batch"]) == (epoch, batch)
        if inputs == "numpy":  # fit(..., shuffle=False) with unshuffled=(512, 8): the batch's rows; traced
            assert micro["samples"] == list(range(batch * 8, batch * 8 + 8))
            assert set(bad) <= set(micro["samples"])
            assert entry["producing_layer"] == "fc2"
        else:  # a shuffled pipeline, no forensics: the epoch and batch index are the identity
            assert micro["samples"] is None and entry["producing_layer"] is None
    assert "Ledger: " in run["summary"]
    if inputs == "numpy":  # in words: fc2 on the samples' steps, the one-off fault's own layer
        assert ("Steps 5, 38, 69, 102, 133 and 166 were bad (overflow), first non-finite in layer `fc2`; "
                f"not replayed ({NO_REPLAY})") in run["summary"]
        assert f"Step {INJECT_AT} was bad (overflow), first non-finite in layer `poison`" in run["summary"]
    else:
        assert "Steps 30, 32, 50, 94, 96, 158 and 160 were bad (overflow); not replayed" in run["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_outcome_ring_adds_a_few_ops_to_a_step_and_no_host_read(results, backend):
    """Counted on the ring's step alone: TensorFlow graph ops, JAX jaxpr equations, torch aten ops; none of
    them reads back to the host (the ledger reads nothing else in the step: its callback hooks count steps on
    the host)."""
    ops = results(backend)["ring_ops"]
    assert 0 < ops <= OPS_PER_STEP[backend], ops
    assert results(backend)["ring_host_reads"] == 0


def test_the_callback_checks_its_ledger_arguments():
    with pytest.raises(ValueError, match="ledger must be"):
        LossScaleCallback(ledger=3)
    with pytest.raises(ValueError, match="unshuffled"):
        LossScaleCallback(ledger=True, unshuffled=(512,))
    with pytest.raises(ValueError, match="give ledger= too"):
        LossScaleCallback(unshuffled=(512, 8))
    with pytest.raises(ValueError, match="replay=True is not available in Keras fit: keras: a callback"):
        LossScaleCallback(ledger=True, replay=True)
