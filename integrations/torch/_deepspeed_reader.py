"""Reading DeepSpeed's own fp16 loss scaler in the core's state shape.

DeepSpeed (``fp16: {"enabled": true}``, ZeRO stages 0-3) scales the loss itself with a
``DynamicLossScaler`` that lives on the engine's optimizer as ``optimizer.loss_scaler``; the engine
counts skipped steps in ``engine.skipped_steps``. Everything there is a Python number: DeepSpeed
already synchronised to decide the overflow, so reading it costs no device sync.

The attributes read (DeepSpeed 0.19; the names have been stable since the fp16 optimizer's
first release): ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_window``,
``scale_factor``, ``min_scale`` (``min_loss_scale`` on the static ``LossScaler``),
``delayed_shift``, ``cur_hysteresis``, ``dynamic``; and ``skipped_steps``, ``global_steps`` on
the engine.
"""

from __future__ import annotations

from typing import Any

from lossscale_callbacks import DynamicPolicy, FixedPolicy
from lossscale_callbacks.integration import Policy

_MAX_SCALE = 2.0**24  # DeepSpeed has no ceiling; ours is only the nominal top of the dashboard bounds


def _loss_scaler(source: Any) -> Any:
    """The engine's, optimizer's or given loss scaler: looked up on every read, since DeepSpeed
    replaces ``optimizer.loss_scaler`` when it loads a checkpoint."""
    for holder in (source, getattr(source, "optimizer", None)):
        scaler = getattr(holder, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "cur_scale"):
            return scaler
    if hasattr(source, "cur_scale"):
        return source
    return None


def has_deepspeed_scaler(source: Any) -> bool:
    """Whether ``source`` (an engine, its optimizer, or a loss scaler) has a DeepSpeed loss scaler."""
    return _loss_scaler(source) is not None


class DeepSpeedScalerReader:
    """Reads a DeepSpeed engine's loss scaler (or a bare ``DynamicLossScaler``) like our scaler's state.

    With an engine, skipped steps and steps are the engine's own counts. With a bare loss scaler,
    call :meth:`after_optimizer_step` after each step: it counts an overflow when the scaler's last
    overflow is the step just taken (host numbers, no device read).

    The growth counter counts good steps toward the next growth the way DeepSpeed does: it grows
    the scale after ``scale_window + 1`` good steps following an overflow (the first one does not
    count), then every ``scale_window``; so the counter is ``max(cur_iter - last_overflow_iter - 2,
    0) % scale_window`` and the scale grows on the good step after it reached
    ``scale_window - 1``. ``hysteresis_left`` is ``cur_hysteresis``.

    Args:
        source: a ``deepspeed.DeepSpeedEngine``, its optimizer, or a ``DynamicLossScaler``.

    Example:
        >>> from types import SimpleNamespace
        >>> recorded = SimpleNamespace(cur_scale=1024.0, cur_iter=5, last_overflow_iter=1,
        ...     scale_window=1000, scale_factor=2.0, min_scale=1.0, delayed_shift=1,
        ...     cur_hysteresis=1, dynamic=True)
        >>> reader = DeepSpeedScalerReader(recorded)
        >>> reader.read()["scale"], reader.read()["growth_counter"]
        (1024.0, 2)
    """

    def __init__(self, source: Any) -> None:
        if _loss_scaler(source) is None:
            raise ValueError("source: expected a DeepSpeed engine, its optimizer or a loss scaler (an object "
                             f"with `loss_scaler` or `cur_scale`), got {type(source).__name__}")
        self.source = source
        self._engine = source if hasattr(source, "skipped_steps") else None
        self.steps = 0
        self.skipped_steps = 0

    @property
    def loss_scaler(self) -> Any:
        scaler = _loss_scaler(self.source)
        if scaler is None:
            raise RuntimeError("the DeepSpeed loss scaler is gone from the engine's optimizer")
        return scaler

    def policy(self) -> Policy:
        """The scaler's settings as a core policy (for the dashboards' bounds and the health rules)."""
        s = self.loss_scaler
        scale = float(s.cur_scale)
        if not getattr(s, "dynamic", False):
            return FixedPolicy(scale=scale)
        min_scale = float(getattr(s, "min_scale", getattr(s, "min_loss_scale", 1.0)) or 1.0)
        factor = float(s.scale_factor)
        return DynamicPolicy(initial_scale=max(scale, min_scale), growth_interval=int(s.scale_window),
                             growth_factor=factor, backoff_factor=1.0 / factor,
                             hysteresis=int(s.delayed_shift), min_scale=min(min_scale, scale),
                             max_scale=max(_MAX_SCALE, scale))

    def after_optimizer_step(self, steps: int = 1) -> None:
        """Count ``steps`` steps; without an engine, count an overflow on the last one. No device read."""
        self.steps += steps
        if self._engine is None:
            s = self.loss_scaler
            if getattr(s, "dynamic", False) and s.last_overflow_iter == s.cur_iter - 1:
                self.skipped_steps += 1

    def read(self) -> dict[str, Any]:
        """Scale, growth counter, hysteresis and the counts, as host numbers."""
        s = self.loss_scaler
        dynamic = bool(getattr(s, "dynamic", False))
        good_since_overflow = int(s.cur_iter) - int(s.last_overflow_iter) - 1 if dynamic else 0
        if self._engine is not None:
            skipped, steps = int(self._engine.skipped_steps), int(self._engine.global_steps)
        else:
            skipped, steps = self.skipped_steps, self.steps
        return {"scale": float(s.cur_scale),
                "growth_counter": max(good_since_overflow - 1, 0) % int(s.scale_window) if dynamic else 0,
                "hysteresis_left": int(getattr(s, "cur_hysteresis", 1)) if dynamic else 1,
                "skipped_steps": skipped, "steps": steps}


__all__ = ["DeepSpeedScalerReader", "has_deepspeed_scaler"]
