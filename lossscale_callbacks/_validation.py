"""One place for argument and state checks, so every way in refuses bad input with the same words.

Arguments: :func:`check_int`, :func:`check_number`, :func:`check_bool`, :func:`check_choice`,
:func:`check_known` (the keys of a dict, the names of a list; a policy argument:
:func:`lossscale_callbacks._policy.check_policy`). Each raises ``ValueError`` naming the argument,
the value and what is allowed.

States: :func:`validate_state` is the one gate for a loss-scale state coming in from outside
the update rule (a constructor, a checkpoint, ``load_state_dict``, ``assign_state``, a stock
scaler's dict, ``update(new_scale)``). It checks every field before anything is returned, so a
caller that assigns only what it returns can never be left half-loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lossscale_callbacks._state import STATE_FIELDS, LossScaleState

INT64_MAX = 2**63 - 1  # the one bound of every count (steps, skips, counters): an int64
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_REAL_TYPES = (int, float, np.integer, np.floating)


def _is_real(value: Any) -> bool:
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, _REAL_TYPES)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else ``ValueError``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value: Any, minimum: int = 1, maximum: int = 2**31 - 1, *,
              allow_integral_float: bool = False) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``.

    Args:
        allow_integral_float: accept a float with an integral value (``2.0``), as tf.keras does
            for step counts.
    """
    if allow_integral_float and _is_real(value) and isinstance(value, (float, np.floating)) \
            and math.isfinite(value) and float(value).is_integer():
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {value!r} "
                         f"({type(value).__name__})")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return int(value)


def check_number(name: str, value: Any, low: float = -math.inf, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite ``float`` inside the interval between ``low`` and ``high``."""
    if not _is_real(value):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    number = float(value)
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if not math.isfinite(number):
        where = "" if math.isinf(low) and math.isinf(high) else f" in {interval}"
        raise ValueError(f"{name} must be a finite number{where}, got {value!r}")
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if below or above:
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return number


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices`` (compared with ``==``, bools by identity)."""
    for choice in choices:
        if value is choice or (not isinstance(value, bool) and not isinstance(choice, bool)
                               and type(value) is type(choice) and value == choice):
            return value
    raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_known(name: str, given: Iterable[Any], allowed: Sequence[Any], *, what: str = "key") -> None:
    """Refuse every item of ``given`` (a dict's keys, a list's names) that is not in ``allowed``.

    Raises:
        ValueError: naming all the unknown items at once, and the allowed ones.

    Example:
        >>> check_known("state_dict", {"scale": 1.0, "scael": 2.0}, ("scale", "steps"))
        Traceback (most recent call last):
        ...
        ValueError: state_dict: unknown key(s) ['scael']; allowed: ['scale', 'steps']
    """
    unknown = sorted({str(item) for item in given if item not in allowed})
    if unknown:
        raise ValueError(f"{name}: unknown {what}(s) {unknown}; allowed: {list(allowed)}")


def _field(values: Any, name: str) -> Any:
    if isinstance(values, Mapping):
        return values[name]
    return getattr(values, name)


def host_number(value: Any) -> Any:
    """A one-element array or tensor as its Python number (a device tensor is read); else ``value``.

    NumPy and JAX arrays say their element count in ``size``; a torch tensor's ``size`` is a method
    (its shape), so its count is ``numel()``; a TensorFlow tensor or a Keras variable has no
    ``item()``, its ``numpy()`` reads it. A torch ``GradScaler`` accepts ``scale`` as a tensor, so
    every state door must too.

    Example:
        >>> host_number(np.array([2.0])), host_number(np.int64(3)), host_number("x")
        (2.0, 3, 'x')
    """
    if isinstance(value, (int, float)):
        return value
    if not hasattr(value, "item") and callable(getattr(value, "numpy", None)):
        value = value.numpy()
    if not hasattr(value, "item"):
        return value
    size = getattr(value, "size", None)
    if callable(size) and callable(getattr(value, "numel", None)):
        size = value.numel()
    return value.item() if size == 1 else value


def validate_state(policy: Any, values: LossScaleState | Mapping[str, Any], *, source: str = "state"
                   ) -> LossScaleState:
    """Check a whole loss-scale state against ``policy``; return it as host numbers, or raise.

    Rules: every field is present; ``scale`` is a finite float32 number inside
    ``[policy.min_scale, policy.max_scale]`` (so > 0); the counters are integers >= 0 that fit
    int64; ``growth_counter < policy``'s growth interval (the rule resets it on reaching the
    interval); ``hysteresis_left <= policy``'s hysteresis; ``skipped_steps <= steps``. Nothing is
    returned unless everything holds, so a caller that writes only the returned values is
    all-or-nothing.

    Args:
        policy: the policy the state will run under.
        values: a :class:`LossScaleState` or a mapping with the five field names; host numbers
            (Python or NumPy scalars, 0-d arrays).
        source: what the state came from, for the message (``"load_state_dict"``...).

    Raises:
        ValueError: naming the field, the value, the allowed range and ``source``.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy
        >>> validate_state(DynamicPolicy(), {"scale": 1024.0, "growth_counter": 3,
        ...                "hysteresis_left": 1, "skipped_steps": 2, "steps": 10}).scale
        1024.0
        >>> validate_state(DynamicPolicy(), {"scale": 0.0, "growth_counter": 0,
        ...                "hysteresis_left": 1, "skipped_steps": 0, "steps": 0})
        Traceback (most recent call last):
        ...
        ValueError: state: scale must be a finite number in [1, 1.67772e+07] (the policy's ...), got 0.0
    """
    if not isinstance(values, (Mapping, LossScaleState)):
        raise ValueError(f"{source}: a loss-scale state must be a LossScaleState or a dict with the keys "
                         f"{list(STATE_FIELDS)}, got {type(values).__name__}")
    missing = [f for f in STATE_FIELDS if isinstance(values, Mapping) and f not in values]
    if missing:
        raise ValueError(f"{source}: the state lacks {missing}; a loss-scale state has {list(STATE_FIELDS)}")
    constants = policy.constants
    raw_scale = host_number(_field(values, "scale"))
    bounds = f"[{constants.min_scale:g}, {constants.max_scale:g}] (the policy's min_scale and max_scale)"
    if not _is_real(raw_scale) or not math.isfinite(float(raw_scale)):
        raise ValueError(f"{source}: scale must be a finite number in {bounds}, got {raw_scale!r}")
    if abs(float(raw_scale)) > _FLOAT32_MAX:
        raise ValueError(f"{source}: scale must be a finite number in {bounds}, got {raw_scale!r}")
    scale = float(np.float32(raw_scale))
    if not constants.min_scale <= scale <= constants.max_scale \
            and scale != float(np.float32(constants.min_scale)) \
            and scale != float(np.float32(constants.max_scale)):
        raise ValueError(f"{source}: scale must be a finite number in {bounds}, got {raw_scale!r}")
    counters: dict[str, int] = {}
    for name in STATE_FIELDS[1:]:
        value = host_number(_field(values, name))
        if _is_real(value) and isinstance(value, (float, np.floating)) and math.isfinite(value) \
                and float(value).is_integer():
            value = int(value)  # counters stored in float64 checkpoints (GradScaler's tracker)
        counters[name] = check_int(f"{source}: {name}", value, 0, INT64_MAX)
    if counters["growth_counter"] >= constants.growth_interval:
        # The rule resets the counter when it reaches the interval: a larger one was never saved by a run.
        raise ValueError(f"{source}: growth_counter must be in [0, {constants.growth_interval - 1}] (below "
                         f"the policy's growth_interval), got {counters['growth_counter']}")
    if counters["hysteresis_left"] > constants.hysteresis:
        raise ValueError(f"{source}: hysteresis_left must be in [0, {constants.hysteresis}] (the policy's "
                         f"hysteresis), got {counters['hysteresis_left']}")
    if counters["skipped_steps"] > counters["steps"]:
        raise ValueError(f"{source}: skipped_steps ({counters['skipped_steps']}) cannot exceed steps "
                         f"({counters['steps']})")
    return LossScaleState(scale, counters["growth_counter"], counters["hysteresis_left"],
                          counters["skipped_steps"], counters["steps"])
