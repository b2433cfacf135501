import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_for
from update_strategies import dynamic_policies, expand, fixed_policies, runs

from lossscale_callbacks.testing import assert_conforms, conformance_cases, reference_run

CASES = conformance_cases()


def test_cases_cover_the_edges():
    names = {case.name for case in CASES}
    assert {"grow_to_max", "backoff_to_min", "hysteresis_3", "fixed_scale", "odd_factors_to_cap"} <= names
    by_name = {case.name: case for case in CASES}
    assert by_name["grow_to_max"].expected.scale[-1] == np.float32(3.0e37)
    assert by_name["backoff_to_min"].expected.scale[-1] == np.float32(0.1)
    assert sum(len(case.finite) for case in CASES) > 10_000


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_expected_states_agree_with_the_independent_oracle(case):
    oracle = oracle_for(case.policy)
    for t, finite in enumerate(case.finite):
        oracle.step(bool(finite))
        row = tuple(np.asarray(field)[t] for field in case.expected)
        assert (float(row[0]), *map(int, row[1:])) == oracle.values(), f"{case.name} step {t}"


def test_cases_are_deterministic():
    again = conformance_cases()
    assert [c.name for c in again] == [c.name for c in CASES]
    for a, b in zip(again, CASES, strict=True):
        assert a.policy == b.policy and np.array_equal(a.finite, b.finite)


def test_assert_conforms_catches_a_one_ulp_difference():
    case = next(c for c in CASES if c.name == "odd_factors_to_cap")
    actual = reference_run(case.policy, case.finite)
    assert_conforms(case, actual)
    scale = actual.scale.copy()
    scale[5] = np.nextafter(scale[5], np.float32(np.inf))
    with pytest.raises(AssertionError, match="scale differs first at step 5"):
        assert_conforms(case, actual._replace(scale=scale))
    with pytest.raises(AssertionError, match="float32"):
        assert_conforms(case, actual._replace(scale=actual.scale.astype(np.float64)))
    with pytest.raises(AssertionError, match="steps"):
        assert_conforms(dataclasses.replace(case), actual._replace(steps=actual.steps[:-1]))


@settings(max_examples=60, deadline=None)
@given(policy=st.one_of(dynamic_policies(hysteresis=st.integers(1, 4)), fixed_policies), run_list=runs)
def test_the_reference_agrees_with_the_oracle_on_generated_policies(policy, run_list):
    """The reference that every backend's fast paths are held to, on the policies their tests generate."""
    finite = expand(run_list, limit=2000)
    if not finite:
        return
    expected, oracle = reference_run(policy, finite), oracle_for(policy)
    for t, flag in enumerate(finite):
        oracle.step(flag)
        assert (float(expected.scale[t]), *(int(np.asarray(f)[t]) for f in expected[1:])) == oracle.values()
