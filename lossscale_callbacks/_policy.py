"""Loss-scaling policies: the immutable, validated settings of the update rule.

A policy says *how* the loss scale moves; it holds no running values (those live in
:class:`~lossscale_callbacks.LossScaleState`). Policies are frozen, validated on
construction and round-trip through plain dicts, so they can be stored in a model's
config or a checkpoint and rebuilt anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from lossscale_callbacks._validation import check_int, check_known, check_number

_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Below this a float32 scale is subnormal; XLA and some GPU kernels flush subnormals to
# zero, which would break bit-identical results across backends.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
# The rule computes scale * growth_factor before capping at max_scale; keeping that product
# below 2**127 means it is always finite in float32 (whose max is just under 2**128).
_GROWTH_CEILING = 2.0**127


def _number(name: str, value: Any) -> float:
    return check_number(name, value)


def _scale(name: str, value: Any) -> float:
    value = check_number(name, value)
    if not _FLOAT32_TINY <= value <= _FLOAT32_MAX:
        raise ValueError(
            f"{name} must be a normal positive float32 value in [{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}], "
            f"got {value!r}"
        )
    return value


def _positive_int(name: str, value: Any) -> int:
    return check_int(name, value, 1, 2**31 - 1)


@dataclasses.dataclass(frozen=True)
class DynamicPolicy:
    """Dynamic loss scaling: grow the scale after a run of clean steps, back off on overflow.

    Args:
        initial_scale: scale of the first step. Start high: a scale that is too high is lowered
            in a few skipped steps, one that is too low is raised only every ``growth_interval``.
            The default, 2**15, is Keras' and tf.keras' (so a Keras run starts where it did);
            torch's ``GradScaler`` starts at 2**16: pass ``initial_scale=2**16`` to start there.
        growth_interval: consecutive finite steps after which the scale is multiplied by
            ``growth_factor``. Integer >= 1.
        growth_factor: multiplier on growth, > 1.
        backoff_factor: multiplier on overflow, in (0, 1).
        hysteresis: the scale backs off on the ``hysteresis``-th overflow since the last
            growth (Megatron-LM's semantics); 1 backs off on every overflow. Integer >= 1.
        min_scale: the scale never backs off below this. ``<= initial_scale``.
        max_scale: the scale never grows above this. ``>= initial_scale``.

    Raises:
        ValueError: an argument outside its range, named with the range allowed
            (``growth_factor must be in (1, 65536], got 0.5``).

    Example:
        >>> policy = DynamicPolicy(initial_scale=2**12, growth_interval=100, hysteresis=2)
        >>> DynamicPolicy.from_config(policy.to_config()) == policy
        True
    """

    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "initial_scale", _scale("initial_scale", self.initial_scale))
        set_(self, "min_scale", _scale("min_scale", self.min_scale))
        set_(self, "max_scale", _scale("max_scale", self.max_scale))
        set_(self, "growth_interval", _positive_int("growth_interval", self.growth_interval))
        set_(self, "hysteresis", _positive_int("hysteresis", self.hysteresis))
        growth = _number("growth_factor", self.growth_factor)
        if not 1.0 < growth <= 2.0**16:
            raise ValueError(f"growth_factor must be in (1, 65536], got {growth!r}")
        set_(self, "growth_factor", growth)
        backoff = _number("backoff_factor", self.backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff!r}")
        set_(self, "backoff_factor", backoff)
        if self.min_scale > self.initial_scale:
            raise ValueError(
                f"min_scale must be <= initial_scale, got min_scale={self.min_scale!r} > "
                f"initial_scale={self.initial_scale!r}"
            )
        if self.max_scale * growth >= _GROWTH_CEILING:
            raise ValueError(
                f"max_scale * growth_factor must be < 2**127 so that growth can never produce Inf in "
                f"float32, got max_scale={self.max_scale!r}, growth_factor={growth!r}"
            )
        if self.initial_scale > self.max_scale:
            raise ValueError(
                f"initial_scale must be <= max_scale, got initial_scale={self.initial_scale!r} > "
                f"max_scale={self.max_scale!r}"
            )

    @property
    def dynamic(self) -> bool:
        return True

    @property
    def constants(self) -> RuleConstants:
        """The numbers the update rule runs on (see :class:`RuleConstants`)."""
        return RuleConstants(self.growth_interval, self.growth_factor, self.backoff_factor,
                             self.hysteresis, self.min_scale, self.max_scale)

    def replace(self, **changes: Any) -> DynamicPolicy:
        """A copy with some fields changed, validated like a new policy.

        Example:
            >>> DynamicPolicy().replace(growth_interval=100).growth_interval
            100
        """
        return _replace(self, changes)

    def to_config(self) -> dict[str, Any]:
        """Plain-dict form, with the policy's type under ``"type"``."""
        return {"type": "dynamic", **dataclasses.asdict(self)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DynamicPolicy:
        return _from_config(cls, "dynamic", config)


@dataclasses.dataclass(frozen=True)
class FixedPolicy:
    """A constant loss scale. Non-finite steps are still skipped and counted.

    Args:
        scale: the loss scale, a normal positive float32 value (1.0 disables scaling but
            keeps the skip-on-overflow protection, which is what bf16 training wants).

    Raises:
        ValueError: ``scale`` is not a normal positive float32 value.

    Example:
        >>> FixedPolicy(128.0).to_config()
        {'type': 'fixed', 'scale': 128.0}
    """

    scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _scale("scale", self.scale))

    @property
    def dynamic(self) -> bool:
        return False

    @property
    def initial_scale(self) -> float:
        return self.scale

    @property
    def min_scale(self) -> float:
        return self.scale

    @property
    def max_scale(self) -> float:
        return self.scale

    @property
    def constants(self) -> RuleConstants:
        """The rule's numbers for a constant scale.

        Growing or backing off by 1 within ``[scale, scale]`` keeps the scale; hysteresis 0
        keeps ``hysteresis_left`` at 0 and ``growth_interval`` 1 keeps ``growth_counter`` at 0.
        """
        return RuleConstants(1, 1.0, 1.0, 0, self.scale, self.scale)

    def replace(self, **changes: Any) -> FixedPolicy:
        """A copy with ``scale`` changed; the growth settings of a dynamic policy are refused.

        Example:
            >>> FixedPolicy(8.0).replace(growth_interval=10)
            Traceback (most recent call last):
            ...
            ValueError: growth_interval cannot be set on a FixedPolicy (allowed: ['scale']); use a ...
        """
        return _replace(self, changes)

    def to_config(self) -> dict[str, Any]:
        return {"type": "fixed", "scale": self.scale}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FixedPolicy:
        return _from_config(cls, "fixed", config)


Policy = DynamicPolicy | FixedPolicy
_POLICY_TYPES: dict[str, type] = {"dynamic": DynamicPolicy, "fixed": FixedPolicy}


def _from_config(cls: type, type_name: str, config: Mapping[str, Any]) -> Any:
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    config = dict(config)
    given_type = config.pop("type", type_name)
    if given_type != type_name:
        raise ValueError(f"config['type'] must be {type_name!r} for {cls.__name__}, got {given_type!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    check_known(f"{cls.__name__} config", config, [*allowed, "type"])
    return cls(**config)


def policy_from_config(config: Mapping[str, Any]) -> Policy:
    """Rebuild any policy from :meth:`to_config` output.

    Example:
        >>> policy_from_config({"type": "fixed", "scale": 8.0})
        FixedPolicy(scale=8.0)
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    type_name = config.get("type")
    if type_name not in _POLICY_TYPES:
        raise ValueError(f"config['type'] must be one of {sorted(_POLICY_TYPES)}, got {type_name!r}")
    return _POLICY_TYPES[type_name].from_config(config)


@dataclasses.dataclass(frozen=True)
class RuleConstants:
    """The numbers the update rule needs, in one shape for every policy.

    A :class:`FixedPolicy` is a dynamic rule whose factors are 1 and whose bounds are the
    scale itself, so one branch-free rule serves both; its ``growth_counter`` and
    ``hysteresis_left`` stay 0.
    """

    growth_interval: int
    growth_factor: float
    backoff_factor: float
    hysteresis: int
    min_scale: float
    max_scale: float


def is_policy(value: Any) -> bool:
    """Whether ``value`` is a loss-scale policy: a :class:`DynamicPolicy` or a :class:`FixedPolicy`.

    The library's one answer to that question (argument checks, the update rule, the plugins'
    "is this third argument a policy?" hints all ask here); an object that merely looks like a policy
    is not one, since the update rule needs the validated numbers only these classes guarantee.

    Example:
        >>> is_policy(FixedPolicy(8.0)), is_policy({"type": "fixed", "scale": 8.0})
        (True, False)
    """
    return isinstance(value, (DynamicPolicy, FixedPolicy))


def check_policy(name: str, value: Any, allow_none: bool = True) -> Policy | None:
    """``value`` if it is a policy (or ``None`` when ``allow_none``), else a ``ValueError`` naming ``name``.

    Example:
        >>> check_policy("policy", "dynamic")
        Traceback (most recent call last):
        ...
        ValueError: policy must be None, a DynamicPolicy or FixedPolicy, got 'dynamic'
    """
    if value is None and allow_none:
        return None
    if not is_policy(value):
        allowed = ("None, " if allow_none else "") + "a DynamicPolicy or FixedPolicy"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def rule_constants(policy: Policy) -> RuleConstants:
    """``policy.constants``, with a ``ValueError`` for anything that is not a policy."""
    return check_policy("policy", policy, allow_none=False).constants


def _replace(policy: Any, changes: Mapping[str, Any]) -> Any:
    allowed = [f.name for f in dataclasses.fields(policy)]
    for name in changes:
        if name not in allowed:
            hint = "; use a DynamicPolicy" if isinstance(policy, FixedPolicy) else ""
            raise ValueError(f"{name} cannot be set on a {type(policy).__name__} (allowed: {allowed}){hint}")
    return dataclasses.replace(policy, **changes)
