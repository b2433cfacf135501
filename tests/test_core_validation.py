"""The one state gate: every field checked against the policy, nothing returned unless all hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lossscale_callbacks import DynamicPolicy, FixedPolicy, LossScaleState
from lossscale_callbacks._policy import rule_constants
from lossscale_callbacks._validation import check_choice, check_int, check_number, validate_state

GOOD = {"scale": 1024.0, "growth_counter": 3, "hysteresis_left": 1, "skipped_steps": 2, "steps": 10}


def with_(**changes):
    return {**GOOD, **changes}


def test_a_good_state_comes_back_as_host_numbers():
    state = validate_state(DynamicPolicy(), with_(scale=np.float32(1024.0), steps=np.int64(10)))
    assert state == LossScaleState(1024.0, 3, 1, 2, 10)
    assert type(state.scale) is float and type(state.steps) is int


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, -math.inf, 0.5, 2.0**25, 1e-60, 1e300,
                                   "1024", None])
def test_scales_outside_the_policy_bounds_are_refused(scale):
    with pytest.raises(ValueError,
                       match=r"load_state_dict: scale must be a finite number in \[1, 1.67772e\+07\]"):
        validate_state(DynamicPolicy(), with_(scale=scale), source="load_state_dict")


@pytest.mark.parametrize("field", ["growth_counter", "hysteresis_left", "skipped_steps", "steps"])
@pytest.mark.parametrize("value", [-1, 1.5, math.nan, "3", None, True, 2**63])
def test_counters_must_be_non_negative_integers(field, value):
    with pytest.raises(ValueError, match=field):
        validate_state(DynamicPolicy(), with_(**{field: value}))


def test_integral_float_counters_are_accepted():
    # GradScaler keeps its growth tracker as a float32 tensor; a checkpoint may hold 3.0.
    assert validate_state(DynamicPolicy(), with_(growth_counter=3.0)).growth_counter == 3


def test_cross_field_rules():
    with pytest.raises(ValueError, match=r"skipped_steps \(11\) cannot exceed steps \(10\)"):
        validate_state(DynamicPolicy(), with_(skipped_steps=11))
    with pytest.raises(ValueError, match=r"hysteresis_left must be in \[0, 2\]"):
        validate_state(DynamicPolicy(hysteresis=2), with_(hysteresis_left=3))
    with pytest.raises(ValueError, match=r"hysteresis_left must be in \[0, 0\]"):
        validate_state(FixedPolicy(1024.0), with_(hysteresis_left=1, growth_counter=0))


@pytest.mark.parametrize("policy, counter", [(DynamicPolicy(growth_interval=2000), 10**6),
                                             (DynamicPolicy(growth_interval=2000), 2000),
                                             (DynamicPolicy(growth_interval=1), 1),
                                             (FixedPolicy(1024.0), 1)])
def test_a_growth_counter_the_rule_never_reaches_is_refused(policy, counter):
    # The rule resets the counter when it reaches growth_interval: no run saves a larger one.
    with pytest.raises(ValueError, match=r"growth_counter must be in \[0, \d+\] \(below the policy's "
                                         r"growth_interval\), got " + str(counter)):
        validate_state(policy, with_(growth_counter=counter, hysteresis_left=0))
    assert validate_state(policy, with_(growth_counter=counter - 1 if counter == 2000 else 0,
                                        hysteresis_left=0)).scale == 1024.0


def test_missing_fields_and_wrong_types_are_named():
    with pytest.raises(ValueError, match=r"lacks \['steps'\]"):
        validate_state(DynamicPolicy(), {k: v for k, v in GOOD.items() if k != "steps"})
    with pytest.raises(ValueError, match="must be a LossScaleState or a dict"):
        validate_state(DynamicPolicy(), [1024.0, 0, 1, 0, 0])


def test_float32_rounding_of_the_bounds_is_not_an_error():
    # 0.1 is not a float32; the scale the rule reaches by backoff is float32(0.1) > 0.1.
    policy = DynamicPolicy(initial_scale=1.0, min_scale=0.1, max_scale=1e6)
    assert validate_state(policy, with_(scale=float(np.float32(0.1)))).scale == float(np.float32(0.1))
    assert validate_state(policy, with_(scale=0.1)).scale == float(np.float32(0.1))


@given(scale=st.floats(allow_nan=True, allow_infinity=True, width=64),
       counters=st.lists(st.integers(-5, 2**64), min_size=4, max_size=4))
def test_accepted_states_always_satisfy_every_rule(scale, counters):
    policy = DynamicPolicy(hysteresis=3)
    values = dict(zip(GOOD, [scale, *counters], strict=True))
    try:
        state = validate_state(policy, values)
    except ValueError:
        return
    c = rule_constants(policy)
    assert math.isfinite(state.scale) and c.min_scale <= state.scale <= c.max_scale
    assert all(0 <= v < 2**63 for v in state[1:])
    assert state.growth_counter < c.growth_interval
    assert state.hysteresis_left <= 3 and state.skipped_steps <= state.steps


def test_argument_checks_name_the_argument_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"log_every must be an integer in \[1, 2147483647\], got 0"):
        check_int("log_every", 0)
    assert check_int("steps", 2.0, allow_integral_float=True) == 2
    with pytest.raises(ValueError, match="steps must be an integer"):
        check_int("steps", 2.5, allow_integral_float=True)
    with pytest.raises(ValueError, match=r"backoff_factor must be in \(0, 1\), got 1.0"):
        check_number("backoff_factor", 1.0, 0.0, 1.0, low_open=True, high_open=True)
    with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\], got 'c'"):
        check_choice("mode", "c", ["a", "b"])
    assert check_choice("sync", True, [True, False, "auto"]) is True
    with pytest.raises(ValueError, match="sync must be one of"):
        check_choice("sync", 1, [True, False, "auto"])


def test_policies_share_one_interface():
    dynamic, fixed = DynamicPolicy(growth_interval=7), FixedPolicy(8.0)
    assert dynamic.constants.growth_interval == 7 and fixed.constants.growth_factor == 1.0
    assert dynamic.replace(hysteresis=2).hysteresis == 2
    with pytest.raises(ValueError, match="growth_factor cannot be set on a FixedPolicy"):
        fixed.replace(growth_factor=2.0)
    with pytest.raises(ValueError, match="growth_interval must be an integer"):
        dynamic.replace(growth_interval=0)
    with pytest.raises(ValueError, match="policy must be a DynamicPolicy or FixedPolicy"):
        rule_constants(object())
