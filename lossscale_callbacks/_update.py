"""The loss-scale update rule: written once, run by every backend."""

from __future__ import annotations

from typing import Any

from lossscale_callbacks._ops import NUMPY_OPS, Ops
from lossscale_callbacks._policy import Policy, rule_constants
from lossscale_callbacks._state import LossScaleState


def initial_state(policy: Policy, ops: Ops = NUMPY_OPS) -> LossScaleState:
    """The state before the first step: ``policy.initial_scale`` and zeroed counters.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy
        >>> state = initial_state(DynamicPolicy(initial_scale=1024.0))
        >>> float(state.scale), int(state.steps)
        (1024.0, 0)
    """
    constants = rule_constants(policy)
    return LossScaleState(
        scale=ops.scale(policy.initial_scale),
        growth_counter=ops.count(0),
        hysteresis_left=ops.count(constants.hysteresis),
        skipped_steps=ops.count(0),
        steps=ops.count(0),
    )


def next_state(policy: Policy, state: LossScaleState, finite: Any, ops: Ops = NUMPY_OPS) -> LossScaleState:
    """Advance the state by one optimizer step. Pure and branch-free.

    ``finite`` says whether every gradient of this step was finite (already reduced across
    replicas/ranks by the caller when training is distributed). The function only selects
    between precomputed candidates with ``ops.where``: no Python ``if`` looks at a tensor,
    so it traces into ``tf.function``/XLA and enqueues on a CUDA stream without reading
    anything back to the host.

    In pseudocode, with ``h = policy.hysteresis``::

        steps += 1
        if finite:
            growth_counter += 1
            if growth_counter >= growth_interval:          # grow
                scale = min(scale * growth_factor, max_scale)
                growth_counter = 0
                hysteresis_left = h
        else:                                               # overflow: skip the step
            skipped_steps += 1
            growth_counter = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:                        # the h-th overflow since growth
                scale = max(scale * backoff_factor, min_scale)

    After the h-th overflow without growth in between, every further overflow backs off
    too (Megatron-LM's hysteresis). A :class:`~lossscale_callbacks.FixedPolicy` runs the
    same rule with factors of 1 and bounds equal to its scale, so its scale never moves,
    its ``growth_counter`` and ``hysteresis_left`` stay 0, and non-finite steps are still
    skipped and counted.

    All arithmetic on the scale is float32 (constants are rounded to float32 first), so
    every backend produces the same bits. ``max_scale * growth_factor < 2**127`` (checked
    by the policy) keeps the product finite: growth never yields Inf.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy
        >>> policy = DynamicPolicy(initial_scale=8.0, growth_interval=2)
        >>> state = initial_state(policy)
        >>> for finite in [True, True, False]:
        ...     state = next_state(policy, state, finite)
        >>> float(state.scale), int(state.skipped_steps), int(state.steps)
        (8.0, 1, 3)
    """
    c = rule_constants(policy)
    one, zero = ops.count(1), ops.count(0)
    finite = ops.as_bool(finite)
    overflow = ops.logical_not(finite)

    counted = state.growth_counter + one
    grow = ops.logical_and(finite, counted >= ops.count(c.growth_interval))
    hysteresis_after_overflow = ops.maximum(state.hysteresis_left - one, zero)
    backoff = ops.logical_and(overflow, hysteresis_after_overflow <= zero)

    grown = ops.minimum(state.scale * ops.scale(c.growth_factor), ops.scale(c.max_scale))
    backed_off = ops.maximum(state.scale * ops.scale(c.backoff_factor), ops.scale(c.min_scale))

    return LossScaleState(
        scale=ops.where(grow, grown, ops.where(backoff, backed_off, state.scale)),
        growth_counter=ops.where(ops.logical_and(finite, ops.logical_not(grow)), counted, zero),
        hysteresis_left=ops.where(
            grow,
            ops.count(c.hysteresis),
            ops.where(overflow, hysteresis_after_overflow, state.hysteresis_left),
        ),
        skipped_steps=state.skipped_steps + ops.where(overflow, one, zero),
        steps=state.steps + one,
    )
