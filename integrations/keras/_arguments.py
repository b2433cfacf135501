"""The arguments of the Keras ``LossScaleOptimizer``: the seed's loss-scale settings, the inner optimizer, and
what Keras 3 configs may carry.

One job: turn what a caller (or a saved config) passes into a core policy and a checked inner optimizer, or
refuse it with the words tf.keras and Keras 3 use. Which inner optimizers are wrapped already is recorded
here, in a registry of this module, not on the user's optimizer.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import keras

from lossscale_callbacks import DynamicPolicy, FixedPolicy
from lossscale_callbacks.integration import Policy, check_int, check_number, check_policy

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
# Keras 3 releases up to 3.3 wrote these base-optimizer settings into every LossScaleOptimizer
# config; a saved model still carries them (at these values), so they are accepted and ignored.
BASE_OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}

# The inner optimizers a LossScaleOptimizer of ours wraps: two wrappers would step and checkpoint the
# same slots. Weak, so a discarded optimizer leaves no trace.
_CLAIMED: weakref.WeakSet[keras.optimizers.Optimizer] = weakref.WeakSet()


class LossScaleOptimizerArgumentError(ValueError, TypeError):
    """A bad argument to :class:`~lossscale_callbacks.keras.LossScaleOptimizer`.

    Both a ``ValueError`` (this project's convention, and Keras 3's) and a ``TypeError`` (what
    tf.keras raises for a non-bool ``dynamic``, a nested or a non-optimizer ``inner_optimizer``),
    so code written against either catches it.
    """


def resolve_policy(dynamic: bool = True, initial_scale: float | None = None,
                   dynamic_growth_steps: int | None = None, policy: Policy | None = None) -> Policy:
    """The core policy behind the seed's ``dynamic``/``initial_scale``/``dynamic_growth_steps``.

    ``dynamic_growth_steps`` may be an integral float (``2.0``), as tf.keras accepts.

    Raises:
        LossScaleOptimizerArgumentError: for the combinations the seed forbids (a fixed scale
            without ``initial_scale``, ``dynamic_growth_steps`` with ``dynamic=False``), a non-bool
            ``dynamic``, ``policy`` together with the seed arguments, an ``initial_scale`` that is
            not a positive finite number or a ``dynamic_growth_steps`` that is not an integer >= 1
            (each message names the argument).

    Example:
        >>> policy = resolve_policy(initial_scale=1024, dynamic_growth_steps=100)
        >>> policy.initial_scale, policy.growth_interval
        (1024.0, 100)
        >>> resolve_policy(dynamic=False, initial_scale=128)
        FixedPolicy(scale=128.0)
    """
    if not isinstance(dynamic, bool):
        # tf.keras' wording: a float or string here usually meant LossScaleOptimizerV1's loss_scale.
        raise LossScaleOptimizerArgumentError(
            f'"dynamic" argument to LossScaleOptimizer.__init__ must be a bool, but got: {dynamic!r} '
            "(pass initial_scale and dynamic_growth_steps by keyword)")
    try:
        if dynamic_growth_steps is not None:
            dynamic_growth_steps = check_int("dynamic_growth_steps", dynamic_growth_steps, 1, 2**31 - 1,
                                             allow_integral_float=True)
        if initial_scale is not None:
            initial_scale = check_number("initial_scale", initial_scale, 0.0, math.inf, low_open=True)
        check_policy("policy", policy)
    except ValueError as exc:
        raise LossScaleOptimizerArgumentError(str(exc)) from None
    if policy is not None:
        return _checked_explicit_policy(dynamic, initial_scale, dynamic_growth_steps, policy)
    if dynamic:
        return DynamicPolicy(
            initial_scale=DEFAULT_INITIAL_SCALE if initial_scale is None else initial_scale,
            growth_interval=DEFAULT_GROWTH_STEPS if dynamic_growth_steps is None else dynamic_growth_steps,
        )
    if initial_scale is None:
        raise LossScaleOptimizerArgumentError(
            '"initial_scale" must be specified if "dynamic" is False (it is the fixed loss scale); or leave '
            "loss scaling to the inner optimizer: set `loss_scale_factor` on it instead")
    if dynamic_growth_steps is not None:
        raise LossScaleOptimizerArgumentError(
            f'"dynamic_growth_steps" must be None if "dynamic" is False, but got: {dynamic_growth_steps}')
    return FixedPolicy(initial_scale)


def _checked_explicit_policy(dynamic: bool, initial_scale: float | None, dynamic_growth_steps: int | None,
                             policy: Policy) -> Policy:
    if initial_scale is not None or dynamic_growth_steps is not None:
        raise LossScaleOptimizerArgumentError(
            "pass either policy or initial_scale/dynamic_growth_steps, not both; got "
            f"policy={policy!r}, initial_scale={initial_scale!r}, "
            f"dynamic_growth_steps={dynamic_growth_steps!r}"
        )
    if not dynamic and policy.dynamic:
        raise LossScaleOptimizerArgumentError(
            f"dynamic=False contradicts policy={policy!r}; pass a FixedPolicy instead")
    return policy


def check_base_optimizer_kwargs(kwargs: dict[str, Any]) -> None:
    """Keras 3's rule: base-optimizer arguments only at their defaults (old configs carry them).

    Raises:
        LossScaleOptimizerArgumentError: naming the first base-optimizer argument that is not at its
            default, or every unknown argument.
    """
    kwargs = dict(kwargs)
    for name, default in BASE_OPTIMIZER_DEFAULTS.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value != default or (default is None and value is not None):
            raise LossScaleOptimizerArgumentError(
                f"LossScaleOptimizer does not support `{name}`. Instead, set `{name}` on the "
                "`inner_optimizer`.")
    if kwargs:
        raise LossScaleOptimizerArgumentError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. It takes "
            "inner_optimizer, dynamic, initial_scale, dynamic_growth_steps, policy and name; settings of "
            "the update (learning rate, clipping, EMA, weight decay...) belong on the `inner_optimizer`.")


def claim_inner_optimizer(inner: Any) -> keras.optimizers.Optimizer:
    """Check ``inner`` and record that a LossScaleOptimizer of ours wraps it from now on.

    Raises:
        LossScaleOptimizerArgumentError: ``inner`` is not a Keras optimizer, is a loss scale
            optimizer itself, or is wrapped by one of ours already (tf.keras' messages).
    """
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise LossScaleOptimizerArgumentError(
            f"LossScaleOptimizer cannot wrap another LossScaleOptimizer, but got: {inner!r}")
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise LossScaleOptimizerArgumentError(
            f'"inner_optimizer" must be an instance of `keras.optimizers.Optimizer`, but got: {inner!r}')
    if inner in _CLAIMED:
        raise LossScaleOptimizerArgumentError(
            '"inner_optimizer" is already wrapped by a LossScaleOptimizer. An optimizer can only be '
            "wrapped by a single LossScaleOptimizer")
    _CLAIMED.add(inner)
    return inner


def release_inner_optimizer(inner: keras.optimizers.Optimizer) -> None:
    """Forget that a LossScaleOptimizer of ours wrapped ``inner``: its wrapper is being replaced."""
    _CLAIMED.discard(inner)
