"""Hypothesis strategies for the update rule's tests: policies and step sequences.

Shared by the core's property tests (against the oracle) and the conformance tests of every backend's
fast paths (against the NumPy reference), so that both run on the same kinds of policies: bounds
that are reached, factors that are not powers of two, hysteresis, intervals short enough to grow
within a test and as long as a policy allows.
"""

from __future__ import annotations

from hypothesis import strategies as st

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy

SHORT_INTERVALS = st.integers(1, 60)
HYSTERESIS = st.integers(1, 6)


@st.composite
def dynamic_policies(draw, hysteresis=HYSTERESIS, intervals=SHORT_INTERVALS):
    min_exp = draw(st.integers(-100, 10))
    max_exp = draw(st.integers(max(min_exp, 0), 120))
    min_scale = 2.0**min_exp * draw(st.sampled_from([1.0, 1.3, 0.7]))
    max_scale = 2.0**max_exp * draw(st.sampled_from([1.0, 1.7, 0.9]))
    min_scale, max_scale = min(min_scale, max_scale), max(min_scale, max_scale)
    growth = draw(st.sampled_from([2.0, 1.5, 1.0001, 3.0, 4.0, 7.3]))
    initial = draw(st.floats(min_scale, max_scale, allow_nan=False, allow_infinity=False))
    return DynamicPolicy(
        initial_scale=initial,
        growth_interval=draw(intervals),
        growth_factor=growth,
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.9, 0.999, 0.1, 1e-3])),
        hysteresis=draw(hysteresis),
        min_scale=min_scale,
        max_scale=max_scale,
    )


fixed_policies = st.builds(FixedPolicy, st.sampled_from([1.0, 0.75, 128.0, 3.0e4, 2.0**-20]))

# Runs of equal outcomes let hypothesis reach sequences of up to 10,000 steps cheaply.
runs = st.lists(st.tuples(st.booleans(), st.integers(1, 400)), max_size=60)


def expand(run_list, limit=10_000):
    flags = [flag for flag, length in run_list for _ in range(length)]
    return flags[:limit]
