"""The core's update rule with TensorFlow ops: bit-identical to NumPy eagerly, in tf.function, under XLA."""

import dataclasses

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from lossscale_callbacks import DynamicPolicy, initial_state, next_state  # noqa: E402
from lossscale_callbacks._state import LossScaleState  # noqa: E402
from lossscale_callbacks.keras._tf_ops import TF_OPS, all_finite, unscale  # noqa: E402
from lossscale_callbacks.testing import assert_conforms, conformance_cases  # noqa: E402

CASES = conformance_cases()


def _run_eager(case):
    state = initial_state(case.policy, TF_OPS)
    rows = []
    for flag in case.finite:
        state = next_state(case.policy, state, tf.constant(bool(flag)), TF_OPS)
        rows.append(state)
    return LossScaleState(*(np.stack([getattr(s, f).numpy() for s in rows]) for f in LossScaleState._fields))


def _run_traced(case, jit_compile):
    policy = case.policy

    @tf.function(jit_compile=jit_compile)
    def run(finite):
        # tf.scan traces the rule once and loops on the device: no per-step host work.
        return tf.scan(lambda state, flag: next_state(policy, state, flag, TF_OPS), finite,
                       initializer=initial_state(policy, TF_OPS))

    states = run(tf.constant(case.finite, dtype=tf.bool))
    return LossScaleState(*(t.numpy() for t in states))


def test_counter_dtype_is_int64_and_scale_float32():
    state = initial_state(DynamicPolicy(), TF_OPS)
    assert state.scale.dtype == tf.float32
    assert {t.dtype for t in state[1:]} == {tf.int64}


# Eagerly each op costs TensorFlow about 50 us: all 28,000 steps took 12 s. The whole cases run traced
# below (tf.function and XLA, the same kernels); eagerly each case's first EAGER_STEPS steps, where a
# difference between the eager and the traced path (a Python bool, a dtype) shows at once.
EAGER_STEPS = 300


def _prefix(case, steps):
    expected = LossScaleState(*(np.asarray(f)[:steps] for f in case.expected))
    return dataclasses.replace(case, finite=case.finite[:steps], expected=expected)


def test_conformance_eager():
    for case in CASES:
        prefix = _prefix(case, EAGER_STEPS)
        assert_conforms(prefix, _run_eager(prefix))


def test_the_eager_prefix_still_fails_a_wrong_rule():
    """The shortened eager check is not blind: a rule whose scale is off by one ulp is caught."""
    case = _prefix(CASES[0], EAGER_STEPS)
    wrong = LossScaleState(*(np.asarray(f) for f in _run_eager(case)))
    wrong = wrong._replace(scale=np.nextafter(wrong.scale, np.float32(np.inf)).astype(np.float32))
    with pytest.raises(AssertionError, match="scale differs first at step 0"):
        assert_conforms(case, wrong)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf_function", "xla"])
def test_conformance_traced(jit_compile):
    for case in CASES:
        assert_conforms(case, _run_traced(case, jit_compile))


def test_all_finite_and_unscale():
    grads = [tf.constant([1.0, 2.0]), None,
             tf.IndexedSlices(tf.constant([[4.0]]), tf.constant([0]), tf.constant([3, 1]))]
    assert bool(all_finite(grads))
    assert not bool(all_finite([*grads, tf.constant([np.inf], tf.float16)]))
    assert not bool(all_finite([tf.constant([np.nan])]))
    assert bool(all_finite([]))
    half = unscale(tf.constant([2.0**14], tf.float16), tf.constant(2.0**20))
    assert half.dtype == tf.float16 and float(half[0]) == 2.0**-6
    sliced = unscale(grads[2], tf.constant(4.0))
    assert isinstance(sliced, tf.IndexedSlices) and float(sliced.values[0, 0]) == 1.0
    assert unscale(None, tf.constant(2.0)) is None
