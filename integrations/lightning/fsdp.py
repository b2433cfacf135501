"""``LossScaleFSDPPlugin``: the core's loss scaling under ``Trainer(strategy="fsdp")``."""

from __future__ import annotations

import torch

from lossscale_callbacks.lightning._compat import bases
from lossscale_callbacks.lightning.plugin import _LossScaling
from lossscale_callbacks.policy import Policy
from lossscale_callbacks.torch.scaler import LossScaler


class LossScaleFSDPPlugin(_LossScaling, *bases("plugins.precision", "FSDPPrecision")):  # type: ignore[misc]
    """Mixed precision under Lightning's ``FSDPStrategy`` with the core's loss scaling.

    Lightning's ``FSDPStrategy`` accepts only ``FSDPPrecision`` plugins; this is one (of every
    installed Lightning namespace), with a :class:`~lossscale_callbacks.torch.LossScaler` in place
    of torch's ``ShardedGradScaler``. Each rank holds a shard of every gradient, so an Inf in one
    rank's shard is invisible to the others: the scaler all-reduces (MAX) its overflow flag before
    the skip decision (``sync_found_inf=True``, one scalar per step, no host sync), and every rank
    skips the same steps and keeps the same scale. FSDP casts parameters for the forward and backward
    pass as ``FSDPPrecision`` does (``MixedPrecision(param_dtype=float16)`` for ``"16-mixed"``); the
    plugin also runs autocast on the device type (``FSDPPrecision``'s own always says ``"cuda"``), so
    fp16 runs on the CPU as well. The scaler's state is saved in Lightning's checkpoints (also FSDP's
    sharded ones), and a checkpoint of Lightning's own ``FSDPPrecision`` (its ``ShardedGradScaler``)
    is taken over when resuming. ``LossScaleMonitor`` logs it like any of our scalers.

    Gradient clipping by norm is refused, as by ``FSDPPrecision`` (it needs FSDP's sharded
    ``clip_grad_norm_``); by value works.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"`` (the scale fixed at 1: skipped, counted
            non-finite steps).
        device: the autocast device type; default: the type of the device the Trainer puts the model on.
        scaler: a :class:`~lossscale_callbacks.torch.LossScaler` to use; default: a new one with
            ``policy`` and ``sync_found_inf``.
        policy: the loss-scale policy of the scaler the plugin makes (GradScaler's settings by default).
        sync_found_inf: the scaler's all-reduce of the overflow flag; ``True`` by default here (sharded
            gradients need it).
        hold_lr_schedulers: see :class:`~lossscale_callbacks.lightning.LossScalePlugin`.

    Raises:
        ValueError: as :class:`~lossscale_callbacks.lightning.LossScalePlugin`.

    Example:
        >>> plugin = LossScaleFSDPPlugin(device="cpu")
        >>> plugin.precision, plugin.scaler.sync_found_inf
        ('16-mixed', True)
    """

    _STOCK_KEY = "FSDPPrecision"

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str | None = None,
        scaler: LossScaler | None = None,
        policy: Policy | None = None,
        *,
        sync_found_inf: bool | str = True,
        hold_lr_schedulers: bool = False,
    ) -> None:
        self._init_scaling(precision, device, scaler, policy, sync_found_inf, hold_lr_schedulers)
        # What FSDPPrecision.__init__ sets besides the scaler: inputs and new tensors stay float32
        # (FSDP's MixedPrecision casts the parameters; autocast the ops).
        self._desired_input_dtype = torch.float32


__all__ = ["LossScaleFSDPPlugin"]
