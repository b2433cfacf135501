"""The Keras ``LossScaleOptimizer`` in configs and saved models: ``get_config``/``from_config``, and what a
``.keras`` file names so that a process without this library can still load it.

Keras rebuilds a model's optimizer from the compile config in ``config.json``. A config naming our class
(module ``lossscale_callbacks.keras._optimizer``) loads only where this library is imported. When the
policy is one Keras' own ``keras.optimizers.LossScaleOptimizer`` can run (:func:`keras_can_hold`), the
compile config names Keras' class instead, with ``registered_name: "LossScaleOptimizer"``: Keras without
this library resolves that to its own class (the weights file holds its layout, see
:mod:`~lossscale_callbacks.keras._state_variables`), and importing ``lossscale_callbacks.keras``
registers our class under that name (:func:`register_keras_name`), so the same file comes back as ours,
state included. Keras writes ``registered_name: None`` for its own class, so only configs written this
way, or hand-written ones without a ``registered_name``, resolve to ours.
"""

from __future__ import annotations

from typing import Any

import keras

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.integration import Policy, policy_from_config
from lossscale_callbacks.keras._arguments import resolve_policy

KERAS_NAME = "LossScaleOptimizer"
# In our config when Keras' own class cannot run the policy: Keras prints the config it cannot load,
# so a process without this library says what it needs.
_NEEDS_KEY = "needs"


def keras_can_hold(policy: Policy) -> bool:
    """Whether Keras' own ``LossScaleOptimizer`` runs ``policy``: dynamic, factors 2 and 1/2, hysteresis 1,
    the default bounds (Keras' class has none: its scale is not clamped to ``[1, 2**24]``).

    Example:
        >>> keras_can_hold(DynamicPolicy(initial_scale=2.0**10, growth_interval=500))
        True
        >>> keras_can_hold(DynamicPolicy(hysteresis=2))
        False
    """
    return policy.dynamic and policy == DynamicPolicy(initial_scale=policy.initial_scale,
                                                      growth_interval=policy.growth_interval)


def optimizer_config(optimizer: Any) -> dict[str, Any]:
    """Keras 3's four keys; ``dynamic``, ``policy`` and what loading needs only when they say more.

    A policy :func:`keras_can_hold` has exactly the config of Keras' own ``LossScaleOptimizer``, so
    either class loads it.
    """
    policy = optimizer.policy
    config: dict[str, Any] = {
        "name": optimizer.name,
        "inner_optimizer": keras.saving.serialize_keras_object(optimizer.inner_optimizer),
        "initial_scale": optimizer.initial_scale,
        "dynamic_growth_steps": optimizer.dynamic_growth_steps,
    }
    if not policy.dynamic:
        config["dynamic"] = False
    if policy != resolve_policy(policy.dynamic, optimizer.initial_scale, optimizer.dynamic_growth_steps):
        config["policy"] = policy.to_config()
    if not keras_can_hold(policy):
        config[_NEEDS_KEY] = (
            "import lossscale_callbacks.keras (pip install \"lossscale-callbacks[keras]\") before "
            f"keras.models.load_model: this loss scale runs {policy}, which "
            "keras.optimizers.LossScaleOptimizer cannot run; or load_model(..., compile=False)")
    return config


def constructor_arguments(config: dict[str, Any], custom_objects: dict[str, Any] | None
                          ) -> tuple[keras.optimizers.Optimizer, dict[str, Any]]:
    """``(inner_optimizer, keyword arguments)`` for the constructor, from :func:`optimizer_config`, from
    Keras' own ``LossScaleOptimizer`` config (any Keras 3 release, whose older configs carry the base
    optimizer's settings at their defaults) or from the configs of earlier releases of this class."""
    config = dict(config)
    config.pop(_NEEDS_KEY, None)
    inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                  custom_objects=custom_objects)
    policy_config = config.pop("policy", None)
    if policy_config is not None:
        # The seed keys are informative copies of the policy.
        for key in ("dynamic", "initial_scale", "dynamic_growth_steps"):
            config.pop(key, None)
        config["policy"] = policy_from_config(policy_config)
    return inner, config


def compile_config_entry(optimizer: Any) -> Any:
    """What a model's compile config holds for ``optimizer``: Keras' class with our registered name when
    :func:`keras_can_hold` its policy (serialized when the model is saved: the inner optimizer as it is
    then), else the optimizer itself.

    Example:
        >>> from lossscale_callbacks.keras._optimizer import LossScaleOptimizer
        >>> entry = compile_config_entry(LossScaleOptimizer(keras.optimizers.SGD(0.1)))
        >>> entry["module"], entry["class_name"], entry["registered_name"]
        ('keras.optimizers', 'LossScaleOptimizer', 'LossScaleOptimizer')
    """
    if not keras_can_hold(optimizer.policy):
        return optimizer
    return {
        "module": "keras.optimizers",
        "class_name": KERAS_NAME,
        "config": {"name": optimizer.name, "inner_optimizer": optimizer.inner_optimizer,
                   "initial_scale": optimizer.initial_scale,
                   "dynamic_growth_steps": optimizer.dynamic_growth_steps},
        "registered_name": KERAS_NAME,
    }


def record_in_compile_config(model: keras.Model, optimizer: Any) -> None:
    """Make ``model.save()`` name ``optimizer`` (see :func:`compile_config_entry`), which replaced the
    optimizer ``model.compile()`` was given; without it ``load_model()`` would rebuild the old one."""
    # Keras keeps compile()'s arguments in model._compile_config (a SerializableDict) and serializes
    # them when the model is saved; there is no public way to change the optimizer there.
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is not None and "optimizer" in getattr(compile_config, "config", {}):
        compile_config.config["optimizer"] = compile_config_entry(optimizer)


def register_keras_name(cls: type) -> type:
    """Register ``cls`` under Keras' own name, so that configs from :func:`compile_config_entry` load as ours.

    ``keras.saving.get_custom_objects()`` is Keras' documented registry of custom objects; a name
    there takes precedence over Keras' built-in class of the same name only where a config names it
    (``registered_name``), which Keras never writes for its own class.
    """
    keras.saving.get_custom_objects()[KERAS_NAME] = cls
    return cls
