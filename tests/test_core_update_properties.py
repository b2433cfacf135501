"""Property tests: the core's update rule against the plain-Python oracle in tests/oracle.py."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_for
from update_strategies import dynamic_policies, expand, runs

from lossscale_callbacks import DynamicPolicy, FixedPolicy, initial_state, next_state

FLOAT32_MAX = float(np.finfo(np.float32).max)


def host(state):
    return (float(state.scale), int(state.growth_counter), int(state.hysteresis_left),
            int(state.skipped_steps), int(state.steps))


@settings(max_examples=200, deadline=None)
@given(policy=dynamic_policies(), run_list=runs)
def test_rule_matches_oracle_at_every_step(policy, run_list):
    state, oracle = initial_state(policy), oracle_for(policy)
    assert host(state) == oracle.values()
    for t, finite in enumerate(expand(run_list)):
        state = next_state(policy, state, finite)
        oracle.step(finite)
        assert host(state) == oracle.values(), f"step {t}"
        assert np.asarray(state.scale).dtype == np.float32


@settings(max_examples=200, deadline=None)
@given(policy=dynamic_policies(), run_list=runs)
def test_invariants(policy, run_list):
    state = initial_state(policy)
    min_scale, max_scale = np.float32(policy.min_scale), np.float32(policy.max_scale)
    clean_run = 0
    for finite in expand(run_list):
        before = host(state)
        state = next_state(policy, state, finite)
        scale, counter, hysteresis_left, skipped, steps = host(state)
        assert math.isfinite(scale) and min_scale <= scale <= max_scale
        assert 0 <= counter < policy.growth_interval
        assert 0 <= hysteresis_left <= policy.hysteresis
        assert steps == before[4] + 1
        assert skipped == before[3] + (0 if finite else 1)
        assert skipped <= steps
        clean_run = clean_run + 1 if finite else 0
        if finite and clean_run % policy.growth_interval == 0:
            # growth exactly after growth_interval clean steps (capped at max_scale)
            assert counter == 0 and scale == min(np.float32(before[0] * np.float32(policy.growth_factor)),
                                                 max_scale)
            assert hysteresis_left == policy.hysteresis
        elif finite:
            assert scale == before[0] and counter == before[1] + 1
        else:
            assert counter == 0


@settings(max_examples=200, deadline=None)
@given(policy=dynamic_policies(), clean=st.integers(0, 30), overflows=st.integers(1, 12))
def test_backoff_happens_on_the_hysteresis_th_overflow_since_growth(policy, clean, overflows):
    state = initial_state(policy)
    for _ in range(clean):
        state = next_state(policy, state, True)
    # hysteresis_left is full after any number of clean steps (initial value, refilled on growth),
    # so the k-th overflow in a row backs off exactly when k >= hysteresis
    for k in range(1, overflows + 1):
        before = float(state.scale)
        state = next_state(policy, state, False)
        backed = max(np.float32(before * np.float32(policy.backoff_factor)), np.float32(policy.min_scale))
        assert float(state.scale) == (backed if k >= policy.hysteresis else before)
        assert int(state.hysteresis_left) == max(policy.hysteresis - k, 0)


@settings(max_examples=200, deadline=None)
@given(scale=st.sampled_from([1.0, 0.5, 128.0, 3.0e4, 1.0e30]), run_list=runs)
def test_fixed_policy_keeps_scale_and_still_counts_skips(scale, run_list):
    policy = FixedPolicy(scale)
    state, oracle = initial_state(policy), oracle_for(policy)
    for finite in expand(run_list, limit=3000):
        state = next_state(policy, state, finite)
        oracle.step(finite)
    assert host(state) == oracle.values()
    assert float(state.scale) == np.float32(scale)


def test_rule_is_elementwise_over_batches_of_states():
    policy = DynamicPolicy(initial_scale=8.0, growth_interval=2)
    state = initial_state(policy)
    flags = np.array([[True, False], [True, True], [False, True]])
    for row in flags:
        state = next_state(policy, state, row)
    singles = []
    for column in flags.T:
        s = initial_state(policy)
        for flag in column:
            s = next_state(policy, s, flag)
        singles.append(host(s))
    batched = [tuple(float(np.broadcast_to(f, (2,))[i]) for f in state) for i in range(2)]
    assert batched == [tuple(float(v) for v in single) for single in singles]


def test_concrete_trajectory():
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=3, hysteresis=2)
    state = initial_state(policy)
    trajectory = []
    for finite in [False, False, False, True, True, True, False, True]:
        state = next_state(policy, state, finite)
        trajectory.append(float(state.scale))
    assert trajectory == [2.0**15, 2.0**14, 2.0**13, 2.0**13, 2.0**13, 2.0**14, 2.0**14, 2.0**14]
    assert int(state.skipped_steps) == 4 and int(state.steps) == 8 and int(state.growth_counter) == 1
