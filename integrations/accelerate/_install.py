"""Putting a loss scaler into an ``Accelerator`` before ``prepare``: the supported route.

What Accelerate does by itself (``Accelerator.__init__``): with ``mixed_precision="fp16"`` on a GPU
it makes a ``torch.amp.GradScaler`` and sets ``native_amp``; on the CPU it does neither, so the run
trains in float32 without a word. ``GradScalerKwargs`` only passes GradScaler's four settings to
that constructor (and Accelerate looks kwargs handlers up by their exact class), so no handler can
hand it another scaler. Every place that uses the scaler reads two attributes:

* ``accelerator.scaler``: ``prepare`` gives it to each ``AcceleratedOptimizer`` (whose ``step``
  runs ``scaler.step`` and ``scaler.update``), ``backward`` scales the loss with it, and
  ``save_state``/``load_state`` store it as ``scaler.pt``;
* ``accelerator.native_amp``: ``prepare`` wraps the model's forward in fp16 autocast only when it
  is set, ``clip_grad_norm_``/``unscale_gradients`` unscale only when it is set (and
  ``mixed_precision == "fp16"``), and ``accelerator.autocast()`` depends on it too.

:func:`install_loss_scaler` sets exactly these two, after checking that it is still in time
(nothing prepared yet: ``prepare`` hands the scaler to the optimizers and wraps the forward once).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from lossscale_callbacks.integration import Policy, check_bool, check_diagnose, check_policy
from lossscale_callbacks.torch import LossScaler

__all__ = ["check_accelerator", "install_loss_scaler"]

# Data parallel: every rank holds whole gradients, all-reduced before the skip decision, so every
# rank decides alike. DeepSpeed and Megatron-LM scale the loss themselves; FSDP and XLA are not
# supported by this route yet.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def check_accelerator(accelerator: Any) -> Accelerator:
    """``accelerator`` if it is an ``accelerate.Accelerator``, else ``ValueError``."""
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    return accelerator


def _check_fp16_in_time(accelerator: Any) -> None:
    check_accelerator(accelerator)
    if accelerator.mixed_precision != "fp16":
        raise ValueError("install_loss_scaler needs Accelerator(mixed_precision='fp16'), got mixed_precision="
                         f"{accelerator.mixed_precision!r}: loss scaling is for float16 (bfloat16 has "
                         "float32's range and needs none)")
    if accelerator.distributed_type not in _SUPPORTED:
        names = ", ".join(t.value for t in _SUPPORTED)
        raise ValueError(f"install_loss_scaler supports the distributed types {names}; this accelerator runs "
                         f"{accelerator.distributed_type.value} (DeepSpeed and Megatron-LM scale the loss "
                         "themselves; FSDP and XLA are not supported by this route yet)")
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError("install_loss_scaler must run before accelerator.prepare(...): prepare has "
                           "already handed Accelerate's scaler to the optimizers and set up autocast. Call "
                           "it right after Accelerator(...)")


def _check_scaler(scaler: Any, device_type: str) -> None:
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"scaler must be None, a LossScaler or a torch.amp.GradScaler, got "
                         f"{type(scaler).__name__}")
    if not scaler.is_enabled():
        raise ValueError("scaler is disabled (GradScaler(enabled=False), or made for a device that is not "
                         "available); it would scale nothing")
    scaler_device = getattr(scaler, "_device", None)
    if scaler_device is not None and scaler_device != device_type:
        raise ValueError(f"scaler was made for device {scaler_device!r}, but the accelerator runs on "
                         f"{device_type!r}: make it with torch.amp.GradScaler({device_type!r}, ...)")


def install_loss_scaler(accelerator: Accelerator, scaler: torch.amp.GradScaler | None = None, *,
                        policy: Policy | None = None, diagnose: bool | str = False,
                        hold: bool = True) -> torch.amp.GradScaler:
    """Make ``accelerator`` scale the loss with ``scaler`` (default: a new ``LossScaler``); fp16 on CPUs too.

    Call it after ``Accelerator(mixed_precision="fp16")`` and before ``accelerator.prepare``. From
    then on the loop is Accelerate's own: ``accelerator.backward`` scales the loss, the prepared
    optimizer's ``step`` unscales, skips a step with Inf/NaN gradients and updates the scale,
    ``accelerator.clip_grad_norm_`` unscales first, ``accelerator.accumulate`` steps once per cycle,
    every scheduler ``prepare`` wraps is held on skipped steps (``hold``: with a fused optimizer too,
    whose kernel skips where Accelerate's ``step_was_skipped`` cannot see it, accelerate#4242: the
    learning rate follows a device count, no host read), and ``save_state``/``load_state`` carry the
    scaler (its policy and counters with ours). On the CPU
    it also switches on what Accelerate leaves off there (fp16 autocast around the prepared model's
    forward and the unscaling in ``clip_grad_norm_``); see the module docstring for the two
    attributes it sets and why.

    Without ``scaler`` a :class:`~lossscale_callbacks.torch.LossScaler` is made with ``policy``, or
    else with the settings of the accelerator's ``GradScalerKwargs`` handler, or else GradScaler's
    defaults. ``scaler`` may also be a stock ``torch.amp.GradScaler`` (to run Accelerate's own
    scaler where Accelerate makes none, e.g. on the CPU).

    Args:
        accelerator: an ``Accelerator(mixed_precision="fp16")``, not yet used by ``prepare``, running
            on one process or data parallel (``DistributedType`` NO, MULTI_CPU or MULTI_GPU).
        scaler: the scaler to use (enabled, for the accelerator's device type).
        policy: the :class:`~lossscale_callbacks.DynamicPolicy` or
            :class:`~lossscale_callbacks.FixedPolicy` of the new ``LossScaler``.
        diagnose: the new ``LossScaler``'s overflow forensics (``True`` or ``"every_step"``); name
            the layers with ``.watch(model)`` on the returned scaler.
        hold: hold the LR schedulers ``accelerator.prepare`` wraps from now on (``LossScaler.hold``;
            default ``True``; an EMA of yours: ``scaler.hold(ema, optimizer=...)``). Only with our
            scaler: a stock one's followers are flagged by the monitor instead.

    Returns:
        The installed scaler (``accelerator.scaler``).

    Raises:
        ValueError: a bad argument (naming it): not an fp16 accelerator, an unsupported distributed
            type, a disabled scaler or one for another device, ``scaler`` together with ``policy``,
            ``diagnose`` or a ``GradScalerKwargs`` handler.
        RuntimeError: ``accelerator.prepare`` already prepared a model or an optimizer.

    Example:
        >>> from accelerate import Accelerator
        >>> from lossscale_callbacks._policy import DynamicPolicy
        >>> accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        >>> scaler = install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=1024.0))
        >>> accelerator.scaler is scaler, accelerator.native_amp, scaler.get_scale()
        (True, True, 1024.0)
    """
    _check_fp16_in_time(accelerator)
    check_diagnose(diagnose)
    check_bool("hold", hold)
    handler = accelerator.scaler_handler
    settings = handler.to_kwargs() if handler is not None else {}
    if scaler is not None:
        given = [name for name, value in (("policy", policy), ("diagnose", diagnose), ("GradScalerKwargs",
                                                                                      settings)) if value]
        if given:
            raise ValueError(f"pass either scaler or {', '.join(given)}, not both: they configure the "
                             "LossScaler that install_loss_scaler makes when no scaler is given")
        _check_scaler(scaler, accelerator.device.type)
    else:
        if policy is not None:
            check_policy("policy", policy)
            if settings:
                raise ValueError(f"pass either policy or a GradScalerKwargs handler ({settings}), not both")
            settings = {"policy": policy}
        scaler = LossScaler(accelerator.device.type, diagnose=diagnose, **settings)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    if hold and isinstance(scaler, LossScaler):
        _hold_prepared_schedulers(accelerator, scaler)
    return scaler


def _hold_prepared_schedulers(accelerator: Accelerator, scaler: LossScaler) -> None:
    """Every scheduler ``accelerator.prepare`` wraps from now on is held by ``scaler`` (the wrapper's
    ``step`` calls the user's scheduler's, which the hold made hold on skipped steps)."""
    prepare_scheduler = accelerator.prepare_scheduler

    def prepare_and_hold(scheduler: Any) -> Any:
        prepared = prepare_scheduler(scheduler)
        inner = getattr(prepared, "scheduler", prepared)
        if all(f.obj is not inner for f in scaler.held):
            scaler.hold(inner)
        return prepared

    accelerator.prepare_scheduler = prepare_and_hold
