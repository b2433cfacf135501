"""Translating ``torch.amp.GradScaler``'s settings and checkpoints into the core's policy and state.

``GradScaler`` has no scale bounds: its scale may grow until the next growth would be Inf and shrink
until it underflows to 0.0 (about 165 overflows in a row from 2**16). The core's policies keep the
scale inside ``[min_scale, max_scale]``. These helpers say, once, how one maps onto the other.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from lossscale_callbacks import DynamicPolicy, LossScaleState
from lossscale_callbacks.integration import Policy, check_int, check_number, host_number, validate_state

GRAD_SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
}
GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# The bounds a GradScaler-style LossScaler gets, widened to contain init_scale when needed.
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24


class ScaleClampedWarning(UserWarning):
    """A scale from outside (a GradScaler checkpoint or settings) was moved into the policy's bounds."""


def _growth_ceiling(growth_factor: float) -> float:
    # The policy requires max_scale * growth_factor < 2**127: the largest power of two below that.
    return 2.0 ** (126 - math.ceil(math.log2(growth_factor)))


def policy_from_grad_scaler_settings(init_scale: Any = None, growth_factor: Any = None,
                                     backoff_factor: Any = None,
                                     growth_interval: Any = None) -> DynamicPolicy:
    """The :class:`~lossscale_callbacks.DynamicPolicy` behind ``GradScaler(init_scale, growth_factor, ...)``.

    Arguments left at ``None`` take GradScaler's defaults (``2**16``, ``2.0``, ``0.5``, ``2000``).
    The scale is bounded by ``[1, 2**24]``, widened to contain ``init_scale``; the upper bound never
    exceeds what growth can reach without overflowing float32 (an ``init_scale`` above it is lowered
    to it, with a :class:`ScaleClampedWarning`).

    Raises:
        ValueError: an argument outside GradScaler's own limits (``growth_factor > 1``,
            ``0 < backoff_factor < 1``, ``growth_interval >= 1``, a finite ``init_scale > 0``),
            naming the argument.

    Example:
        >>> policy_from_grad_scaler_settings(init_scale=1024.0, growth_interval=100)
        DynamicPolicy(initial_scale=1024.0, growth_interval=100, growth_factor=2.0, backoff_factor=0.5,
                      hysteresis=1, min_scale=1.0, max_scale=16777216.0)
    """
    # host_number: GradScaler takes these as one-element tensors too.
    settings = {k: GRAD_SCALER_DEFAULTS[k] if v is None else host_number(v) for k, v in (
        ("init_scale", init_scale), ("growth_factor", growth_factor),
        ("backoff_factor", backoff_factor), ("growth_interval", growth_interval))}
    init = check_number("init_scale", settings["init_scale"], 0.0, math.inf, low_open=True)
    growth = check_number("growth_factor", settings["growth_factor"], 1.0, 2.0**16, low_open=True)
    backoff = check_number("backoff_factor", settings["backoff_factor"], 0.0, 1.0, low_open=True,
                           high_open=True)
    interval = check_int("growth_interval", settings["growth_interval"], 1, 2**31 - 1)
    ceiling = _growth_ceiling(growth)
    if init > ceiling:
        warnings.warn(f"init_scale={init!r} is above the largest scale that growth by {growth!r} keeps "
                      f"finite in float32; starting from {ceiling!r}", ScaleClampedWarning, stacklevel=3)
        init = ceiling
    return DynamicPolicy(initial_scale=init, growth_interval=interval, growth_factor=growth,
                         backoff_factor=backoff, min_scale=min(DEFAULT_MIN_SCALE, init),
                         max_scale=min(max(DEFAULT_MAX_SCALE, init), ceiling))


def is_grad_scaler_state_dict(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` was written by ``torch.amp.GradScaler`` (not by ``LossScaler``)."""
    return "policy" not in state_dict and all(k in state_dict for k in GRAD_SCALER_KEYS)


def from_grad_scaler_state_dict(base: Policy, state_dict: Mapping[str, Any]) -> tuple[Policy, LossScaleState]:
    """The policy and validated state to resume from a ``GradScaler`` checkpoint; nothing is changed here.

    The factors and interval replace those of ``base`` (which must be dynamic); the scale and growth
    tracker are taken over, the other counters start at zero. A scale outside ``base``'s bounds is
    clamped into them with a :class:`ScaleClampedWarning`; a zero, negative or non-finite scale (a
    GradScaler whose scale underflowed after a long run of overflows) is refused.

    Raises:
        ValueError: ``base`` is fixed, a setting is invalid, or the scale cannot be resumed from.
    """
    if not base.dynamic:
        raise ValueError(f"a torch.amp.GradScaler checkpoint holds a dynamic scale, but this scaler's policy "
                         f"is {base!r}; load it into a LossScaler with a DynamicPolicy")
    policy = base.replace(growth_factor=host_number(state_dict["growth_factor"]),
                          backoff_factor=host_number(state_dict["backoff_factor"]),
                          growth_interval=host_number(state_dict["growth_interval"]))
    raw = host_number(state_dict["scale"])
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError("load_state_dict (torch.amp.GradScaler checkpoint): scale must be a finite number "
                         f"> 0, got {raw!r} ({type(raw).__name__})")
    scale = float(raw)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"the torch.amp.GradScaler checkpoint's scale is {raw!r}: its scale collapsed (GradScaler has no "
            "lower bound, so a long run of overflows drives it to 0). Training from it would apply NaN "
            "gradients. Resume with a fresh scale, e.g. load_state_dict({**checkpoint, 'scale': 65536.0}), "
            "and look for the cause of the overflows (lossscale-callbacks report on the old run)")
    c = policy.constants
    clamped = min(max(scale, c.min_scale), c.max_scale)
    if clamped != scale:
        warnings.warn(f"the torch.amp.GradScaler checkpoint's scale {scale!r} is outside this policy's "
                      f"bounds [{c.min_scale:g}, {c.max_scale:g}]; resuming from {clamped!r}",
                      ScaleClampedWarning, stacklevel=3)
    state = validate_state(policy, {
        "scale": clamped, "growth_counter": state_dict["_growth_tracker"], "hysteresis_left": c.hysteresis,
        "skipped_steps": 0, "steps": 0}, source="load_state_dict (the torch.amp.GradScaler checkpoint's "
                                               "_growth_tracker)")
    return policy, state
