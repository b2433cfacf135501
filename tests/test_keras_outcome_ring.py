"""The device ring of step outcomes of the Keras ``LossScaleOptimizer`` (the skip truth's per-step record on
Keras), in this process (TensorFlow): each skipped step listed once with its scale, read with the state in one
host copy, bounded, started afresh when a state is assigned, never saved. The ops it adds to a step on every
backend are counted in ``tests/test_keras_ledger.py`` (its check script runs each backend)."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.keras import LossScaleOptimizer  # noqa: E402


def _skip_at(opt, var, steps, bad):
    for step in range(1, steps + 1):
        factor = float("inf") if step in bad else 1.0
        opt.minimize(lambda f=factor: var * var * f, var_list=[var])


def test_read_state_and_outcomes_lists_each_skipped_step_once_with_its_scale():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), policy=DynamicPolicy(initial_scale=256.0))
    var = keras.Variable(1.0)
    _skip_at(opt, var, 6, {2, 5})
    state, outcomes = opt.read_state_and_outcomes()
    assert [(o.step, o.cause, o.scale) for o in outcomes.outcomes] == [(2, "overflow", 256.0),
                                                                       (5, "overflow", 128.0)]
    assert (outcomes.first_step, outcomes.last_step, outcomes.applied, int(state.steps)) == (1, 6, 4, 6)
    _skip_at(opt, var, 2, {1})  # step 7 skipped
    _, later = opt.read_state_and_outcomes()
    assert [(o.step, o.scale) for o in later.outcomes] == [(7, 64.0)] and later.first_step == 7
    _, empty = opt.read_state_and_outcomes()
    assert empty.outcomes == () and empty.steps == 0


def test_the_state_and_the_outcomes_come_in_one_host_copy(monkeypatch):
    pytest.importorskip("tensorflow")
    from tensorflow.python.framework import ops as tf_framework_ops

    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), policy=DynamicPolicy(initial_scale=256.0))
    var = keras.Variable(1.0)
    _skip_at(opt, var, 3, {2})
    copies = []
    numpy_of, to_numpy = tf_framework_ops._EagerTensorBase._numpy, keras.ops.convert_to_numpy
    monkeypatch.setattr(tf_framework_ops._EagerTensorBase, "_numpy",
                        lambda self: copies.append("numpy") or numpy_of(self))
    monkeypatch.setattr(keras.ops, "convert_to_numpy", lambda x: copies.append("convert") or to_numpy(x))
    state, outcomes = opt.read_state_and_outcomes()
    assert len(copies) == 1 and [o.step for o in outcomes.outcomes] == [2] and int(state.steps) == 3


def test_more_skips_than_the_ring_holds_are_counted_and_the_newest_listed():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), policy=DynamicPolicy(initial_scale=2.0**20),
                             outcome_capacity=2)
    var = keras.Variable(1.0)
    _skip_at(opt, var, 5, {1, 2, 3, 4})
    _, outcomes = opt.read_state_and_outcomes()
    assert [o.step for o in outcomes.outcomes] == [3, 4]
    assert outcomes.counts["overflow"] == 4 and outcomes.missed == 2


def test_an_assigned_state_starts_the_record_afresh():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), policy=DynamicPolicy(initial_scale=256.0))
    var = keras.Variable(1.0)
    _skip_at(opt, var, 3, {2})
    opt.assign_state({"steps": 10, "skipped_steps": 0})  # e.g. a state carried over or loaded
    _skip_at(opt, var, 2, {2})  # step 12 skipped
    _, outcomes = opt.read_state_and_outcomes()
    assert [o.step for o in outcomes.outcomes] == [12] and outcomes.first_step == 11


def test_outcome_capacity_is_checked():
    with pytest.raises(ValueError, match="outcome_capacity"):
        LossScaleOptimizer(keras.optimizers.SGD(0.01), outcome_capacity=0)


def test_the_ring_is_not_saved_with_the_model(tmp_path):
    """A saved model holds the state, not the record: Keras' own layout and our counters only."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(np.ones((8, 2), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=0)
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    import h5py

    with h5py.File(path) as saved:
        names: list[str] = []
        saved.visit(names.append)
    assert not [n for n in names if "outcome" in n]
