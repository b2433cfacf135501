import math

import numpy as np
import pytest

from lossscale_callbacks import DynamicPolicy, FixedPolicy
from lossscale_callbacks._policy import policy_from_config

INVALID_DYNAMIC = [
    ("initial_scale", float("inf")),
    ("initial_scale", float("nan")),
    ("initial_scale", 0.0),
    ("initial_scale", -1.0),
    ("initial_scale", True),
    ("initial_scale", "1024"),
    ("initial_scale", None),
    ("growth_interval", 0),
    ("growth_interval", -5),
    ("growth_interval", 2.5),
    ("growth_interval", 2000.0),
    ("growth_interval", True),
    ("growth_interval", 2**31),
    ("growth_factor", 1.0),
    ("growth_factor", 0.5),
    ("growth_factor", float("inf")),
    ("growth_factor", False),
    ("backoff_factor", 0.0),
    ("backoff_factor", 1.0),
    ("backoff_factor", 1.5),
    ("backoff_factor", -0.5),
    ("backoff_factor", float("nan")),
    ("hysteresis", 0),
    ("hysteresis", 1.5),
    ("hysteresis", True),
    ("min_scale", 0.0),
    ("min_scale", 1e-45),  # subnormal in float32
    ("min_scale", float("-inf")),
    ("max_scale", float("inf")),
    ("max_scale", 1e39),  # not representable in float32
]


@pytest.mark.parametrize(("name", "value"), INVALID_DYNAMIC)
def test_invalid_dynamic_argument_names_itself(name, value):
    with pytest.raises(ValueError, match=name):
        DynamicPolicy(**{name: value})


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"min_scale": 4.0, "initial_scale": 2.0}, ("min_scale", "initial_scale")),
        ({"initial_scale": 2.0**30, "max_scale": 2.0**24}, ("initial_scale", "max_scale")),
        ({"max_scale": 3.0e38, "initial_scale": 1.0}, ("max_scale", "growth_factor")),
    ],
)
def test_inconsistent_combinations_name_both_arguments(kwargs, names):
    with pytest.raises(ValueError) as info:
        DynamicPolicy(**kwargs)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("value", [0.0, -2.0, float("inf"), float("nan"), True, "8", 1e39])
def test_invalid_fixed_scale(value):
    with pytest.raises(ValueError, match="scale"):
        FixedPolicy(value)


def test_policies_are_frozen_and_hashable():
    policy = DynamicPolicy()
    with pytest.raises(AttributeError):
        policy.initial_scale = 2.0  # type: ignore[misc]
    assert hash(policy) == hash(DynamicPolicy())


def test_numpy_numbers_are_accepted_and_normalised():
    policy = DynamicPolicy(initial_scale=np.float32(1024), growth_interval=np.int64(10))
    assert type(policy.initial_scale) is float and type(policy.growth_interval) is int


@pytest.mark.parametrize(
    "policy",
    [DynamicPolicy(), DynamicPolicy(1.5, 3, 3.0, 0.25, 4, 0.5, 1e6), FixedPolicy(), FixedPolicy(65536.0)],
)
def test_config_round_trip_through_plain_dicts(policy):
    config = policy.to_config()
    assert all(isinstance(v, (int, float, str)) for v in config.values())
    assert type(policy).from_config(config) == policy
    assert policy_from_config(dict(config)) == policy


def test_unknown_config_keys_are_rejected_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['growth_steps'\]; allowed: \[.*'type'\]"):
        DynamicPolicy.from_config({"growth_steps": 5})
    with pytest.raises(ValueError, match="type"):
        policy_from_config({"type": "adaptive"})
    with pytest.raises(ValueError, match="'fixed'"):
        FixedPolicy.from_config({"type": "dynamic", "scale": 2.0})


def test_defaults_match_the_design():
    policy = DynamicPolicy()
    assert (policy.initial_scale, policy.growth_interval, policy.growth_factor, policy.backoff_factor) == (
        2.0**15, 2000, 2.0, 0.5)
    assert (policy.hysteresis, policy.min_scale, policy.max_scale) == (1, 1.0, 2.0**24)
    assert policy.dynamic and not FixedPolicy().dynamic
    assert math.isclose(FixedPolicy(3.0).initial_scale, 3.0)
