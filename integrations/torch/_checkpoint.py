"""What a ``LossScaler`` accepts as a state from outside, checked whole before anything changes.

Three doors: ``load_state_dict`` with a ``LossScaler`` state dict, ``load_state_dict`` with a
``torch.amp.GradScaler`` state dict, and unpickling. Each is parsed here into a validated
``(policy, state)`` pair (the state through the core's one gate,
:func:`lossscale_callbacks._validation.validate_state`) or refused with a ``ValueError`` that names
the key; the scaler then installs the pair in one place. Unknown keys are refused, so a typo or a
dict meant for something else is never half-used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lossscale_callbacks import LossScaleState
from lossscale_callbacks.integration import (
    STATE_FIELDS,
    Policy,
    SpikeRule,
    check_bool,
    check_choice,
    check_diagnose,
    check_int,
    check_known,
    host_number,
    policy_from_config,
    validate_state,
)
from lossscale_callbacks.torch._grad_scaler_compat import (
    GRAD_SCALER_KEYS,
    from_grad_scaler_state_dict,
    is_grad_scaler_state_dict,
)

SYNC_CHOICES = (True, False, "auto")
# A LossScaler state dict also carries GradScaler's keys, so that GradScaler and code written for it
# can read it; they mirror the policy and the state.
_MIRRORS = ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
STATE_DICT_KEYS = ("policy", *STATE_FIELDS, *_MIRRORS)
PICKLE_KEYS = ("enabled", "device", "policy", "state", "sync_found_inf", "process_group", "diagnose",
               "headroom_every")
# Keys added later: a pickle of an earlier release lacks them and gets their defaults.
OPTIONAL_PICKLE_KEYS = {"outcome_capacity": 64, "spike": None, "skip_nonfinite": True}


def check_process_group(name: str, value: Any) -> Any:
    """``value`` if it is ``None`` or a ``torch.distributed`` process group, else ``ValueError``."""
    available = torch.distributed.is_available()
    group_type = getattr(torch.distributed, "ProcessGroup", None) if available else None
    if value is None or (group_type is not None and isinstance(value, group_type)):
        return value
    raise ValueError(f"{name} must be None or a torch.distributed process group, got {value!r}")


def check_device_type(name: str, value: Any) -> str | None:
    """``value`` if it is ``None`` or a device type string (``"cuda"``, ``"cpu"``...), else ``ValueError``."""
    if value is None:
        return None
    try:
        valid = isinstance(value, str) and torch.device(value).type == value
    except (RuntimeError, TypeError):
        valid = False
    if not valid:
        raise ValueError(f"{name} must be None or a device type such as 'cuda' or 'cpu', got {value!r}")
    return value


def parse_policy(config: Any, source: str) -> Policy:
    """The policy of a state dict or pickle; its errors name ``policy`` and the policy's field."""
    try:
        return policy_from_config(config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{source}: policy: {exc}") from None


def _same_number(value: Any, expected: float) -> bool:
    value = host_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return float(value) == float(expected)


def _check_mirrors(state_dict: Mapping[str, Any], policy: Policy, host: LossScaleState) -> None:
    c = policy.constants
    mirrored = {"growth_factor": ("policy's growth_factor", c.growth_factor),
                "backoff_factor": ("policy's backoff_factor", c.backoff_factor),
                "growth_interval": ("policy's growth_interval", c.growth_interval),
                "_growth_tracker": ("growth_counter", host.growth_counter)}
    for key, (source, want) in mirrored.items():
        if key in state_dict and not _same_number(state_dict[key], want):
            raise ValueError(
                f"load_state_dict: {key}={state_dict[key]!r} disagrees with the {source} ({want!r}); in a "
                "LossScaler state dict GradScaler's keys mirror 'policy' and the state: change the policy or "
                "the state fields instead, or drop the GradScaler keys")


def parse_state_dict(current: Policy, state_dict: Any) -> tuple[Policy, LossScaleState]:
    """The ``(policy, state)`` a ``load_state_dict`` argument asks for, all checked; nothing is changed here.

    Args:
        current: the scaler's policy (a GradScaler dict replaces only its factors and interval).
        state_dict: a ``LossScaler.state_dict()`` or a ``torch.amp.GradScaler.state_dict()``.

    Raises:
        RuntimeError: an empty dict (saved from a disabled scaler), as GradScaler raises.
        ValueError: anything else that is not a valid state for the policy, naming the key.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
    if not state_dict:
        raise RuntimeError("The source state dict is empty, possibly because it was saved "
                           "from a disabled instance of GradScaler.")
    if "policy" in state_dict:
        check_known("load_state_dict", state_dict, STATE_DICT_KEYS)
        policy = parse_policy(state_dict["policy"], "load_state_dict")
        values = {k: state_dict[k] for k in STATE_FIELDS if k in state_dict}
        host = validate_state(policy, values, source="load_state_dict")
        _check_mirrors(state_dict, policy, host)
        return policy, host
    ours = sorted(k for k in state_dict if k in STATE_FIELDS and k not in GRAD_SCALER_KEYS)
    if ours:
        raise ValueError(f"load_state_dict: the state dict has LossScaler's {ours} but no 'policy'; a "
                         f"LossScaler state dict has {list(STATE_DICT_KEYS)}, a torch.amp.GradScaler one "
                         f"{list(GRAD_SCALER_KEYS)}")
    if is_grad_scaler_state_dict(state_dict):
        check_known("load_state_dict (torch.amp.GradScaler state dict)", state_dict, GRAD_SCALER_KEYS)
        return from_grad_scaler_state_dict(current, state_dict)
    raise ValueError("load_state_dict expects a LossScaler state dict (with 'policy' and "
                     f"{list(STATE_FIELDS)}) or a torch.amp.GradScaler one (with {list(GRAD_SCALER_KEYS)}); "
                     f"got the keys {sorted(map(str, state_dict))}")


def parse_pickle(state: Any) -> dict[str, Any]:
    """The checked settings and state of an unpickled ``LossScaler`` (see its ``__getstate__``)."""
    source = "unpickling"
    if not isinstance(state, Mapping):
        raise ValueError(f"{source}: a LossScaler pickle holds a dict, got {type(state).__name__}")
    check_known(source, state, (*PICKLE_KEYS, *OPTIONAL_PICKLE_KEYS))
    missing = [k for k in PICKLE_KEYS if k not in state]
    if missing:
        raise ValueError(f"{source}: the pickle lacks {missing}")
    out = {**OPTIONAL_PICKLE_KEYS, **state}
    check_int(f"{source}: outcome_capacity", out["outcome_capacity"])
    try:
        out["spike"] = None if out["spike"] is None else SpikeRule.from_config(out["spike"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: spike: {exc}") from None
    check_bool(f"{source}: skip_nonfinite", out["skip_nonfinite"])
    out["enabled"] = check_bool(f"{source}: enabled", state["enabled"])
    check_device_type(f"{source}: device", state["device"])
    check_process_group(f"{source}: process_group", state["process_group"])
    out["policy"] = policy = parse_policy(state["policy"], source)
    out["state"] = None if state["state"] is None else validate_state(policy, state["state"], source=source)
    check_choice(f"{source}: sync_found_inf", state["sync_found_inf"], SYNC_CHOICES)
    try:
        check_diagnose(state["diagnose"])
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    check_int(f"{source}: headroom_every", state["headroom_every"])
    if out["enabled"] and out["state"] is None:
        raise ValueError(f"{source}: state must be a loss-scale state for an enabled scaler, got None")
    return out

