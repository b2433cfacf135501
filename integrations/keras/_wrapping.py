"""Putting our ``LossScaleOptimizer`` in the place of a model's optimizer (``LossScaleCallback`` does it)."""

from __future__ import annotations

import keras
import numpy as np

from lossscale_callbacks._policy import DynamicPolicy, Policy
from lossscale_callbacks.keras._arguments import release_inner_optimizer
from lossscale_callbacks.keras._optimizer import LossScaleOptimizer


def wrap(optimizer: keras.optimizers.Optimizer, policy: Policy | None = None) -> LossScaleOptimizer:
    """Our optimizer around ``optimizer``; Keras' own LossScaleOptimizer is unwrapped and its scale kept.

    The wrapper replaces the previous one in the model, so an inner optimizer that an earlier, discarded
    LossScaleOptimizer of ours wrapped (a recompiled model) is wrapped again. Called by
    :class:`~lossscale_callbacks.keras.LossScaleCallback`; build it inside the model's distribution
    strategy scope.

    Example:
        >>> keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=256.0)
        >>> ours = wrap(keras_lso)
        >>> ours.inner_optimizer is keras_lso.inner_optimizer, ours.initial_scale
        (True, 256.0)
    """
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        release_inner_optimizer(optimizer)
        return LossScaleOptimizer(optimizer, policy=policy)
    keras_lso = optimizer
    if policy is None:
        policy = DynamicPolicy(initial_scale=float(keras_lso.initial_scale),
                               growth_interval=int(keras_lso.dynamic_growth_steps))
    release_inner_optimizer(keras_lso.inner_optimizer)
    ours = LossScaleOptimizer(keras_lso.inner_optimizer, policy=policy)
    if not keras_lso.built:
        return ours
    # One host read, once per installation: if Keras' optimizer has trained, carry its running
    # scale and counter over, clipped into the policy's bounds (Keras' scale has neither
    # bound). Untouched, it only holds its initial scale, and the policy's initial scale wins.
    scale = float(keras_lso.dynamic_scale.numpy())
    counter = int(keras_lso.step_counter.numpy())
    applied = int(keras_lso.inner_optimizer.iterations.numpy())
    if applied or counter or scale != float(np.float32(keras_lso.initial_scale)):
        constants = policy.constants
        ours.assign_state({
            "scale": min(max(scale, constants.min_scale), constants.max_scale),
            "growth_counter": min(counter, constants.growth_interval - 1) if policy.dynamic else 0,
            "steps": applied,
        })
    return ours
