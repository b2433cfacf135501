"""A stock ``torch.amp.GradScaler`` (or ``ShardedGradScaler``) in the core's terms: skips and checkpoints.

``GradScaler`` keeps only a scale and a growth tracker and does not count skipped steps. A skipped
step is recognised on the device after each optimizer step: ``update()`` resets the tracker to 0
on an overflow and lowers the scale, while a growth also resets the tracker but raises the scale.
So "tracker is 0 and the scale did not grow" is an overflow, counted into a device tensor with
no host sync; the counts are read only at the log interval. Used by
:class:`~lossscale_callbacks.torch.ScalerReader`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lossscale_callbacks import DynamicPolicy, LossScaleState
from lossscale_callbacks.integration import INT64_MAX, check_int, validate_state
from lossscale_callbacks.torch._grad_scaler_compat import GRAD_SCALER_KEYS

__all__ = ["GRAD_SCALER_STATE_KEYS", "StockSkipCounter", "check_stock_state"]

# What GradScaler.state_dict() holds (ShardedGradScaler's is the same).
GRAD_SCALER_STATE_KEYS = frozenset(GRAD_SCALER_KEYS)
_COUNT_KEYS = frozenset({"steps", "skipped_steps"})
# GradScaler has no bounds: any normal positive float32 scale is one it can hold and resume from.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


class StockSkipCounter:
    """Counts the skipped steps of a ``torch.amp.GradScaler`` on the device.

    Call :meth:`after_optimizer_step` after every optimizer step (after ``scaler.update()``, before
    the next one): a few tiny device ops, no host sync. :meth:`read` is the one host read of an
    interval.

    Args:
        scaler: the ``GradScaler`` (or ``ShardedGradScaler``) to follow.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> StockSkipCounter(scaler).read(steps=0).scale
        1024.0
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._skipped: torch.Tensor | None = None
        self._prev_scale: torch.Tensor | None = None
        self._restored_skipped = 0

    def after_optimizer_step(self) -> None:
        """Count whether the last optimizer step overflowed, on the device. No host sync.

        ``GradScaler`` keeps no history: only the last update's overflow can be seen, so call this
        after every optimizer step.
        """
        scale = self.scaler._get_scale_async()
        tracker = getattr(self.scaler, "_growth_tracker", None)
        if scale is None or tracker is None:
            return
        if self._skipped is None:
            self._skipped = torch.zeros((), dtype=torch.int64, device=scale.device)
            # The scale before the first update is the configured (or restored) initial scale.
            self._prev_scale = torch.full((), float(self.scaler._init_scale), dtype=torch.float32,
                                          device=scale.device)
        assert self._prev_scale is not None
        overflow = torch.logical_and(tracker == 0, torch.logical_not(scale > self._prev_scale))
        self._skipped.add_(overflow.to(torch.int64))
        self._prev_scale.copy_(scale)

    def read(self, steps: int) -> LossScaleState:
        """Scale, growth tracker and skipped steps as host numbers, with ``steps`` counted by the caller.
        One host sync (none before the scaler's first step)."""
        scale = self.scaler._get_scale_async()
        if scale is None:
            # Not stepped yet: the configured or checkpoint-restored values GradScaler will start from.
            tracker = int(getattr(self.scaler, "_init_growth_tracker", 0))
            return LossScaleState(float(self.scaler._init_scale), tracker, 1, self._restored_skipped, steps)
        skipped = self._skipped if self._skipped is not None else torch.zeros((), device=scale.device)
        values = torch.stack([scale.double(), self.scaler._growth_tracker.double(),
                              skipped.double()]).cpu().tolist()
        return LossScaleState(values[0], int(values[1]), 1, self._restored_skipped + int(values[2]), steps)

    def restore(self, skipped_steps: int) -> None:
        """Count on from ``skipped_steps`` (a checkpoint); load the scaler's own state first."""
        self._skipped = None  # the device count restarts at the restored scale; the host offset adds the rest
        self._prev_scale = None
        self._restored_skipped = skipped_steps


def _stock_policy(scaler_state: Mapping[str, Any]) -> DynamicPolicy:
    """GradScaler's settings as a policy whose bounds are all the scales GradScaler can resume from."""
    growth = scaler_state["growth_factor"]
    try:
        ceiling = 2.0 ** (126 - math.ceil(math.log2(float(growth))))
    except (TypeError, ValueError, OverflowError):
        ceiling = 2.0**24  # the policy below refuses the factor itself, naming it
    try:
        return DynamicPolicy(initial_scale=1.0, growth_interval=scaler_state["growth_interval"],
                             growth_factor=growth, backoff_factor=scaler_state["backoff_factor"],
                             min_scale=_FLOAT32_TINY, max_scale=max(ceiling, 1.0))
    except ValueError as exc:
        raise ValueError(f"the GradScaler state's {exc}") from None


def check_stock_state(scaler_state: Any, counts: Any, *, source: str = "load_state_dict") -> LossScaleState:
    """A ``GradScaler`` state dict and the counts kept beside it, through the core's state gate.

    ``scaler_state`` must hold exactly ``GradScaler.state_dict()``'s keys, with settings GradScaler
    accepts; its scale must be a normal positive float32 number (a NaN, zero or negative scale, which
    would skip every later step, is refused), its growth tracker an integer >= 0. ``counts`` is
    ``{"steps": int, "skipped_steps": int}`` with ``skipped_steps <= steps``.

    Returns:
        The state as the core sees it (hysteresis 1: GradScaler backs off on every overflow).

    Raises:
        ValueError: naming the key or field and what is allowed.

    Example:
        >>> check_stock_state({"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        ...                    "growth_interval": 2000, "_growth_tracker": 3},
        ...                   {"steps": 10, "skipped_steps": 1}).scale
        1024.0
    """
    expected = (("scaler", scaler_state, GRAD_SCALER_STATE_KEYS), ("stock", counts, _COUNT_KEYS))
    for name, value, keys in expected:
        if not isinstance(value, Mapping):
            raise ValueError(f"{source}: {name} must be a dict with the keys {sorted(keys)}, got {value!r}")
        if set(value) != keys:
            raise ValueError(f"{source}: {name} must have exactly the keys {sorted(keys)}; missing "
                             f"{sorted(keys - set(value))}, unknown {sorted(set(value) - keys)}")
    policy = _stock_policy(scaler_state)
    for name in ("steps", "skipped_steps"):
        check_int(f"{source}: stock's {name}", counts[name], 0, INT64_MAX)
    values = {"scale": scaler_state["scale"], "growth_counter": scaler_state["_growth_tracker"],
              "hysteresis_left": 1, **counts}
    return validate_state(policy, values, source=f"{source} (torch.amp.GradScaler)")
