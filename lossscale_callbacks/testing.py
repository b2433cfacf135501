"""Test oracles: the references that tests hold every backend and integration to. Not used in training.

This module is for test suites (ours, and a backend's that wants to prove itself against the core); the
library never imports it. It imports NumPy and the core only, never a framework.

* **Conformance**: every backend must reproduce the NumPy reference of the update rule bit for bit. A
  backend test takes :func:`conformance_cases`, runs each case's ``finite`` sequence through its own ops
  (eagerly, inside ``tf.function``, under XLA, on a CUDA stream ...), stacks the state after every step
  into host arrays, and hands them to :func:`assert_conforms`.
* **Forensics**: :func:`reference_headroom` and :func:`reference_histogram` compute in NumPy what the
  integrations' ``diagnose=True`` computes on the device.

Example:
    >>> from lossscale_callbacks import initial_state, next_state
    >>> def run_numpy(case):
    ...     state, states = initial_state(case.policy), []
    ...     for finite in case.finite:
    ...         state = next_state(case.policy, state, finite)
    ...         states.append(state)
    ...     return stack_states(states)
    >>> for case in conformance_cases(num_random=2, max_len=50):
    ...     assert_conforms(case, run_numpy(case))
    >>> reference_histogram([np.array([1.0, 3.0])], 1.0)[40:42]  # 2^0 and 2^1 bins
    (1, 1)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy, Policy
from lossscale_callbacks._state import STATE_FIELDS, LossScaleState
from lossscale_callbacks._update import initial_state, next_state
from lossscale_callbacks.forensics._gradients import FP16_MIN_SUBNORMAL, HISTOGRAM_EXPONENTS, LayerHeadroom

__all__ = [
    "ConformanceCase",
    "assert_conforms",
    "conformance_cases",
    "reference_headroom",
    "reference_histogram",
    "reference_run",
    "stack_states",
]


@dataclasses.dataclass(frozen=True)
class ConformanceCase:
    """One policy, one sequence of step outcomes, and the reference state after every step.

    ``expected`` holds one array per state field, each of length ``len(finite)``; row ``t`` is
    the state after step ``t``.
    """

    name: str
    policy: Policy
    finite: np.ndarray
    expected: LossScaleState


def stack_states(states: Sequence[LossScaleState]) -> LossScaleState:
    """Turn a list of per-step states (host values) into one array per field."""
    return LossScaleState(*(np.stack([np.asarray(getattr(s, f)) for s in states]) for f in STATE_FIELDS))


def reference_run(policy: Policy, finite: Sequence[bool]) -> LossScaleState:
    """The NumPy reference: the state after every step of ``finite``, stacked."""
    state = initial_state(policy)
    states = []
    for flag in finite:
        state = next_state(policy, state, bool(flag))
        states.append(state)
    return stack_states(states)


def _pattern(rng: np.random.Generator, length: int, kind: str) -> np.ndarray:
    if kind == "bernoulli":
        return rng.random(length) >= rng.choice([0.001, 0.01, 0.1, 0.5, 0.9])
    if kind == "bursts":
        finite = np.ones(length, dtype=bool)
        for start in rng.integers(0, length, size=max(1, length // 200)):
            finite[start:start + int(rng.integers(1, 40))] = False
        return finite
    if kind == "clean":
        return np.ones(length, dtype=bool)
    if kind == "overflowing":
        return np.zeros(length, dtype=bool)
    raise ValueError(f"kind must be one of bernoulli, bursts, clean, overflowing; got {kind!r}")


def _random_policy(rng: np.random.Generator) -> Policy:
    if rng.random() < 0.15:
        return FixedPolicy(float(rng.choice([1.0, 0.75, 128.0, 3.0e4])))
    min_scale = float(rng.choice([1.0, 2.0**-14, 0.1, 1.0e-30]))
    max_scale = float(rng.choice([2.0**24, 2.0**16, 1.0e6, 3.0e37]))
    growth = float(rng.choice([2.0, 1.5, 1.0001, 3.0, 10.0]))
    if max_scale * growth >= 2.0**127:
        growth = 2.0
    initial = float(np.clip(2.0 ** rng.uniform(-10, 40), min_scale, max_scale))
    return DynamicPolicy(
        initial_scale=initial,
        growth_interval=int(rng.choice([1, 2, 3, 7, 50, 2000])),
        growth_factor=growth,
        backoff_factor=float(rng.choice([0.5, 0.25, 0.9, 0.999, 1.0e-3])),
        hysteresis=int(rng.choice([1, 1, 2, 3, 10])),
        min_scale=min_scale,
        max_scale=max_scale,
    )


def conformance_cases(seed: int = 0, num_random: int = 24, max_len: int = 2000) -> list[ConformanceCase]:
    """Hand-picked edge cases plus ``num_random`` seeded random policies and sequences.

    The edge cases reach ``max_scale`` by growth, ``min_scale`` by backoff, use factors that
    are not powers of two (so float32 rounding must match), hysteresis, and a fixed scale.
    """
    rng = np.random.default_rng(seed)
    specs: list[tuple[str, Policy, np.ndarray]] = [
        ("defaults_bursts", DynamicPolicy(growth_interval=20), _pattern(rng, max_len, "bursts")),
        ("grow_to_max", DynamicPolicy(initial_scale=1.0, growth_interval=1, max_scale=3.0e37),
         _pattern(rng, 200, "clean")),
        ("odd_factors_to_cap", DynamicPolicy(initial_scale=3.0, growth_interval=1, growth_factor=1.7,
                                             max_scale=1000.0), _pattern(rng, 50, "clean")),
        ("backoff_to_min", DynamicPolicy(initial_scale=2.0**20, min_scale=0.1, backoff_factor=0.3),
         _pattern(rng, 60, "overflowing")),
        ("hysteresis_3", DynamicPolicy(initial_scale=2.0**10, growth_interval=5, hysteresis=3),
         _pattern(rng, max_len, "bursts")),
        ("fixed_scale", FixedPolicy(512.0), _pattern(rng, 300, "bernoulli")),
        ("fixed_unit_scale", FixedPolicy(1.0), _pattern(rng, 100, "bernoulli")),
    ]
    kinds = ["bernoulli", "bursts", "bernoulli", "clean", "overflowing"]
    for i in range(num_random):
        length = int(rng.integers(1, max_len + 1))
        specs.append((f"random_{i}", _random_policy(rng), _pattern(rng, length, kinds[i % len(kinds)])))
    return [ConformanceCase(name, policy, finite, reference_run(policy, finite))
            for name, policy, finite in specs]


def _bits(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype == np.float32:
        return array.view(np.uint32)
    return array.astype(np.int64)


def assert_conforms(case: ConformanceCase, actual: LossScaleState) -> None:
    """Raise ``AssertionError`` at the first step where ``actual`` differs from the reference in any bit.

    ``actual`` holds one host array per field (see :func:`stack_states`); counters may use
    any integer dtype, the scale must be float32.
    """
    for field in STATE_FIELDS:
        got = np.asarray(getattr(actual, field)).reshape(-1)
        want = np.asarray(getattr(case.expected, field)).reshape(-1)
        if got.shape != want.shape:
            raise AssertionError(f"{case.name}: {field} has {got.shape[0]} steps, expected {want.shape[0]}")
        if field == "scale" and got.dtype != np.float32:
            raise AssertionError(f"{case.name}: scale must be float32, got {got.dtype}")
        mismatch = np.nonzero(_bits(got) != _bits(want))[0]
        if mismatch.size:
            t = int(mismatch[0])
            raise AssertionError(
                f"{case.name} ({case.policy}): {field} differs first at step {t} "
                f"(finite={bool(case.finite[t])}): got {got[t]!r}, reference {want[t]!r}"
            )


def reference_headroom(grads: Mapping[str, np.ndarray], scale: float) -> tuple[LayerHeadroom, ...]:
    """NumPy reference for the headroom of ``{layer: unscaled gradient values}`` at ``scale``.

    The integrations compute the same on the device (``diagnose=True``); tests compare them with this.
    """
    out = []
    for layer, values in grads.items():
        # float32, as the device computes it (exact for the power-of-two scales of dynamic scaling)
        scaled = np.abs(np.asarray(values, dtype=np.float32)).ravel() * np.float32(scale)
        biggest = float(scaled.max()) if scaled.size else 0.0
        if scaled.size and not np.all(np.isfinite(scaled)):
            biggest = math.nan if np.isnan(scaled).any() else math.inf
        under = int(np.count_nonzero((scaled > 0) & (scaled < FP16_MIN_SUBNORMAL)))
        out.append(LayerHeadroom(layer, biggest, under, int(scaled.size)))
    return tuple(out)


def reference_histogram(values: Iterable[np.ndarray], scale: float) -> tuple[int, ...]:
    """NumPy reference: counts of ``floor(log2 |v * scale|)`` (non-zero, finite values) in
    :data:`HISTOGRAM_EDGES` bins, the outer bins open-ended.

    ``floor(log2 x)`` is the float's binary exponent (``frexp``), exact on every backend.
    """
    lo, hi = HISTOGRAM_EXPONENTS
    counts = np.zeros(hi - lo, dtype=np.int64)
    for v in values:
        scaled = np.abs(np.asarray(v, dtype=np.float32)).ravel() * np.float32(scale)
        scaled = scaled[(scaled > 0) & np.isfinite(scaled)]
        exponent = np.frexp(scaled)[1].astype(np.int64) - 1
        counts += np.bincount(np.clip(exponent, lo, hi - 1) - lo, minlength=hi - lo)
    return tuple(int(c) for c in counts)
