"""Reading Megatron-Core's own loss scaler (``DynamicGradScaler``) in the core's state shape.

Megatron-Core's fp16 optimizers (``MixedPrecisionOptimizer``: ``Float16OptimizerWithFloat16Params``,
the distributed optimizer; a ``ChainedOptimizer`` of them) keep their scaler in ``grad_scaler``: a
``DynamicGradScaler`` or a ``ConstantGradScaler`` (megatron/core/optimizer/grad_scaler.py,
megatron-core 0.16.1; unchanged in its logic to 0.20). Its scale, growth factor, backoff factor and
minimum are one-element float tensors on the GPU; its trackers (``_growth_tracker``,
``_hysteresis_tracker``) and ``growth_interval``, ``hysteresis`` are Python ints. Its rule is the
core's (the scale backs off on the ``hysteresis``-th overflow since the last growth, and on every
overflow after it), so the trackers map one to one: ``growth_counter = _growth_tracker`` and
``hysteresis_left = max(_hysteresis_tracker, 0)`` (Megatron lets it go below zero).

The scaler counts neither steps nor skipped steps (Megatron's ``training.py`` counts them from
``optimizer.step()``'s ``update_successful``): the reader counts steps in
:meth:`~MegatronScalerReader.after_optimizer_step` and an overflow where the hysteresis tracker went
down (it goes down on every overflow and on nothing else), all host ints; or takes ``skipped`` from
the caller. Only :meth:`~MegatronScalerReader.read` reads the scale tensor (the one device read of an
interval), and :meth:`~MegatronScalerReader.policy` the factor tensors (once, at start).
"""

from __future__ import annotations

from typing import Any

from lossscale_callbacks import DynamicPolicy, FixedPolicy
from lossscale_callbacks.integration import Policy

__all__ = ["MegatronScalerReader", "has_megatron_scaler"]

_MAX_SCALE = 2.0**24  # Megatron has no ceiling; ours is only the nominal top of the dashboard bounds


def _is_grad_scaler(value: Any) -> bool:
    # MegatronGradScaler: `_scale` and `inv_scale` (torch's GradScaler has `_scale` but no `inv_scale`).
    return value is not None and hasattr(value, "_scale") and hasattr(type(value), "inv_scale")


def _grad_scaler(source: Any) -> Any:
    """The optimizer's, a chained optimizer's first, or the given scaler: looked up on every read, since a
    checkpoint load may replace it."""
    if _is_grad_scaler(source):
        return source
    for holder in (source, *(getattr(source, "chained_optimizers", None) or ())[:1]):
        scaler = getattr(holder, "grad_scaler", None)
        if _is_grad_scaler(scaler):
            return scaler
    return None


def has_megatron_scaler(source: Any) -> bool:
    """Whether ``source`` (a Megatron-Core optimizer, a chained optimizer, or a grad scaler) has one."""
    return _grad_scaler(source) is not None


def _dynamic(scaler: Any) -> bool:
    return hasattr(scaler, "_hysteresis_tracker") and hasattr(scaler, "_growth_tracker")


class MegatronScalerReader:
    """Reads a Megatron-Core optimizer's grad scaler (or a bare ``DynamicGradScaler``) like our state.

    Call :meth:`after_optimizer_step` after each ``optimizer.step()`` (pass ``skipped=not
    update_successful`` when you have it; without it an overflow is seen where the hysteresis
    tracker went down, which a ``ConstantGradScaler`` does not have) and :meth:`read` at the log
    interval.

    Args:
        source: a Megatron-Core ``MixedPrecisionOptimizer``, a ``ChainedOptimizer`` of them, or a
            ``DynamicGradScaler``/``ConstantGradScaler``.

    Raises:
        ValueError: ``source`` holds no Megatron grad scaler.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> class Recorded(SimpleNamespace):
        ...     inv_scale = property(lambda self: 1 / self._scale)
        >>> recorded = Recorded(_scale=torch.tensor([1024.0]), _growth_tracker=2, _hysteresis_tracker=2,
        ...     growth_interval=1000, hysteresis=2, growth_factor=torch.tensor([2.0]),
        ...     backoff_factor=torch.tensor([0.5]), min_scale=torch.tensor([1.0]))
        >>> reader = MegatronScalerReader(recorded)
        >>> reader.read()["scale"], reader.read()["growth_counter"]
        (1024.0, 2)
    """

    def __init__(self, source: Any) -> None:
        if _grad_scaler(source) is None:
            raise ValueError("source: expected a Megatron-Core optimizer, chained optimizer or grad scaler "
                             "(an object with `grad_scaler`, or `_scale` and `inv_scale`), got "
                             f"{type(source).__name__}")
        self.source = source
        self.steps = 0
        self.skipped_steps = 0
        self._last_hysteresis = self._hysteresis_tracker()

    @property
    def grad_scaler(self) -> Any:
        scaler = _grad_scaler(self.source)
        if scaler is None:
            raise RuntimeError("the Megatron grad scaler is gone from the optimizer")
        return scaler

    def _hysteresis_tracker(self) -> int | None:
        scaler = _grad_scaler(self.source)
        return int(scaler._hysteresis_tracker) if _dynamic(scaler) else None

    def policy(self) -> Policy:
        """The scaler's settings as a core policy (reads its factor tensors: call it once, not per step)."""
        s = self.grad_scaler
        scale = float(s._scale)
        if not _dynamic(s):
            return FixedPolicy(scale=scale)
        min_scale = float(s.min_scale)
        return DynamicPolicy(initial_scale=max(scale, min_scale), growth_interval=int(s.growth_interval),
                             growth_factor=float(s.growth_factor), backoff_factor=float(s.backoff_factor),
                             hysteresis=int(s.hysteresis), min_scale=min(min_scale, scale),
                             max_scale=max(_MAX_SCALE, scale))

    def after_optimizer_step(self, steps: int = 1, skipped: bool | None = None) -> None:
        """Count ``steps`` steps and, on the last, an overflow: ``skipped`` when given, else whether the
        hysteresis tracker went down since the last call. Host ints only, no device read."""
        self.steps += steps
        now = self._hysteresis_tracker()
        if skipped is None:
            skipped = now is not None and self._last_hysteresis is not None and now < self._last_hysteresis
        self.skipped_steps += bool(skipped)
        self._last_hysteresis = now

    def read(self) -> dict[str, Any]:
        """Scale, growth counter, hysteresis and the counts, as host numbers (the scale: one device read)."""
        s = self.grad_scaler
        dynamic = _dynamic(s)
        return {"scale": float(s._scale),
                "growth_counter": int(s._growth_tracker) if dynamic else 0,
                "hysteresis_left": max(int(s._hysteresis_tracker), 0) if dynamic else 0,
                "skipped_steps": self.skipped_steps, "steps": self.steps}
