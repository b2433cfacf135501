"""The arguments every precision plugin of this package takes, checked once (Trainer and Fabric alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lossscale_callbacks import FixedPolicy
from lossscale_callbacks.integration import (
    STATE_FIELDS,
    Policy,
    check_choice,
    check_known,
    check_policy,
    is_policy,
    policy_from_config,
)
from lossscale_callbacks.torch import LossScaler
from lossscale_callbacks.torch.integration import GRAD_SCALER_KEYS

PRECISIONS = ("16-mixed", "bf16-mixed")
BF16_POLICY = FixedPolicy(1.0)
# What LossScaler.state_dict() writes (and a torch GradScaler's subset of it).
SCALER_STATE_KEYS = ("policy", *STATE_FIELDS, *GRAD_SCALER_KEYS)


def autocast_available(device: str) -> bool:
    try:
        return torch.amp.is_autocast_available(torch.device(device).type)
    except (RuntimeError, ValueError):
        return False


def default_device(device: str | None) -> str:
    """The autocast device type: the one given, else ``"cuda"`` when available, else ``"cpu"``."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_scaling(owner: str, precision: str, device: str | None, scaler: Any, policy: Policy | None,
                    sync_found_inf: bool | str) -> tuple[str | None, LossScaler]:
    """Check a plugin's ``precision``/``device``/``scaler``/``policy``; return the device and the scaler.

    ``device=None`` stays ``None`` (the plugin follows the model's device); a given one must be a
    device type with autocast. A given scaler must be our ``LossScaler`` (a stock GradScaler belongs
    in Lightning's own plugins, which ``LossScaleMonitor`` reads too) and excludes ``policy``;
    ``"bf16-mixed"`` keeps the scale at 1 (``FixedPolicy(1.0)``).

    Raises:
        ValueError: naming the argument and what is allowed.
    """
    check_choice("precision", precision, PRECISIONS)
    if is_policy(scaler):
        raise ValueError(f"{owner}'s third argument is the scaler, as in Lightning's precision plugins; pass "
                         f"the policy by keyword: {owner}(policy={scaler!r})")
    check_policy("policy", policy)
    check_choice("sync_found_inf", sync_found_inf, (True, False, "auto"))
    if device is not None and (not isinstance(device, str) or not autocast_available(device)):
        raise ValueError("device must be None or a device type string with autocast support such as "
                         f"'cpu' or 'cuda', got {device!r}")
    if scaler is not None:
        if not isinstance(scaler, LossScaler):
            raise ValueError(
                "scaler must be a lossscale_callbacks.torch.LossScaler, got "
                f"{type(scaler).__name__}; for a stock torch.amp.GradScaler use Lightning's own "
                "MixedPrecision(precision, device, scaler=...) (LossScaleMonitor reads it too)")
        if policy is not None:
            raise ValueError(f"pass either scaler or policy, not both; got scaler={scaler!r} and "
                             f"policy={policy!r} (give the policy to the scaler: LossScaler(policy=...))")
        if sync_found_inf != "auto":
            scaler.sync_found_inf = sync_found_inf
        if precision == "bf16-mixed" and scaler.policy != BF16_POLICY:
            raise ValueError("precision='bf16-mixed' keeps the loss scale at 1: the scaler's policy "
                             f"must be FixedPolicy(1.0), got {scaler.policy!r}")
        return device, scaler
    if precision == "bf16-mixed":
        if policy is not None and policy != BF16_POLICY:
            raise ValueError("precision='bf16-mixed' keeps the loss scale at 1: policy must be None "
                             f"or FixedPolicy(1.0), got {policy!r}")
        policy = BF16_POLICY
    return device, LossScaler(policy=policy, enabled=True, sync_found_inf=sync_found_inf)


def split_plugin_state(owner: str, precision: str, state_dict: Any, own_keys: tuple[str, ...] = (), *,
                       where: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check a plugin's checkpoint before anything loads; split it into the scaler's part and the plugin's.

    The scaler's part still goes through the scaler's own all-or-nothing state check when it is
    loaded; what is checked here is what the scaler cannot know: the dict's shape, keys nobody
    writes, and a scaling policy offered to a ``"bf16-mixed"`` plugin.

    Args:
        owner: the plugin's class name, for messages.
        precision: the plugin's precision.
        state_dict: what the plugin's ``state_dict()`` (or a ``torch.amp.GradScaler``'s) wrote.
        own_keys: the plugin's own keys besides the scaler's (``"lr_scheduler_lag"``).
        where: what the messages say was called (default: ``<owner>.load_state_dict``).

    Returns:
        The scaler's part and the plugin's own part (the ``own_keys`` present).

    Raises:
        ValueError: not a dict; an unknown key; a ``"bf16-mixed"`` plugin given a checkpoint whose
            policy scales (one saved by a ``"16-mixed"`` run, or a GradScaler's).

    Example:
        >>> saved = {"scale": 8.0, "lr_scheduler_lag": 2}
        >>> split_plugin_state("LossScalePlugin", "16-mixed", saved, own_keys=("lr_scheduler_lag",))
        ({'scale': 8.0}, {'lr_scheduler_lag': 2})
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a dict ({owner}.state_dict()), got {type(state_dict).__name__}")
    allowed = (*SCALER_STATE_KEYS, *own_keys)
    check_known(where or f"{owner}.load_state_dict", state_dict, allowed)
    if precision == "bf16-mixed" and state_dict:
        saved = state_dict.get("policy")
        policy = policy_from_config(saved) if saved is not None else "a torch GradScaler's"
        if policy != BF16_POLICY:
            raise ValueError("precision='bf16-mixed' keeps the loss scale at 1, but the checkpoint's "
                             f"policy is {policy}; resume it with precision='16-mixed'")
    own = {k: state_dict[k] for k in own_keys if k in state_dict}
    return {k: v for k, v in state_dict.items() if k not in own_keys}, own
