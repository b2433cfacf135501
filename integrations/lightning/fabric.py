"""Lightning Fabric: precision plugins with the core's loss scaling, and a monitor for the loss scale.

``Fabric(plugins=[LossScaleFabricPlugin()])`` (DDP, one device, ...) or
``Fabric(strategy="fsdp", plugins=[LossScaleFabricFSDPPlugin()])``; then
``monitor = FabricLossScaleMonitor(fabric, log_every=100)`` and ``monitor.step()`` after each
``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from lossscale_callbacks.integration import LoggingArgs, Policy, Snapshot, logging_args
from lossscale_callbacks.lightning._loggers import logger_sink
from lossscale_callbacks.lightning._settings import default_device, resolve_scaling, split_plugin_state
from lossscale_callbacks.torch import LossScaler
from lossscale_callbacks.torch.integration import ScalerStepMonitor

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

try:
    from lightning.fabric.plugins.precision import FSDPPrecision as _FabricFSDPPrecision
    from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixedPrecision
except ImportError as exc:  # pragma: no cover - lightning without fabric
    raise ImportError("lossscale_callbacks.lightning.fabric needs the `lightning` package "
                      "(Lightning Fabric)") from exc


class _FabricLossScaling:
    """What both Fabric plugins add to Fabric's own: checked arguments and a checked ``load_state_dict``.
    Mixed in before Fabric's class, whose ``__init__`` is not called (it would refuse a scaler for
    bf16, and FSDPPrecision's would build a ShardedGradScaler)."""

    def _init_scaling(self, precision: str, device: str | None, scaler: Any, policy: Policy | None,
                      sync_found_inf: bool | str) -> None:
        device, scaler = resolve_scaling(type(self).__name__, precision, device, scaler, policy,
                                         sync_found_inf)
        self.precision = precision
        self.device = default_device(device)
        self.scaler = scaler

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler from ``state_dict()`` (or a ``GradScaler``'s). All or nothing.

        The keys and the precision are checked first, then the scaler's own state check runs.

        Raises:
            ValueError: naming the field: not a dict, an unknown key, an invalid scaler state, or a
                ``"bf16-mixed"`` plugin given a state whose policy scales. Nothing has changed then.
        """
        scaler_state, _ = split_plugin_state(type(self).__name__, self.precision, state_dict)
        self.scaler.load_state_dict(scaler_state)


class LossScaleFabricPlugin(_FabricLossScaling, _FabricMixedPrecision):
    """Fabric's ``MixedPrecision`` with a :class:`~lossscale_callbacks.torch.LossScaler`, fp16 on the CPU too.

    Fabric's own ``MixedPrecision(scaler=...)`` accepts our scaler too; this plugin adds what the
    Trainer plugin has: checked arguments, bf16 that still skips and counts non-finite steps, a
    policy by keyword, an all-or-nothing :meth:`load_state_dict` that refuses a scaling state for
    bf16. ``fabric.backward`` scales, ``optimizer.step()`` unscales, skips or applies and
    updates the scale; ``fabric.clip_gradients`` unscales first.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type (default: ``"cuda"`` when available, else ``"cpu"``).
        scaler: a ``LossScaler`` to use; default: a new one with ``policy``.
        policy: the loss-scale policy (GradScaler's settings by default).
        sync_found_inf: passed to the scaler (``"auto"``: all-reduced for sharded parameters).

    Raises:
        ValueError: ``precision`` is not one of the two, ``scaler`` and ``policy`` are both given, or
            another argument is invalid (named).

    Example:
        >>> plugin = LossScaleFabricPlugin(device="cpu")
        >>> plugin.precision, plugin.scaler.get_scale()
        ('16-mixed', 65536.0)
    """

    def __init__(self, precision: str = "16-mixed", device: str | None = None,
                 scaler: LossScaler | None = None, policy: Policy | None = None, *,
                 sync_found_inf: bool | str = "auto") -> None:
        self._init_scaling(precision, device, scaler, policy, sync_found_inf)
        self._desired_input_dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16


class LossScaleFabricFSDPPlugin(_FabricLossScaling, _FabricFSDPPrecision):
    """Fabric's ``FSDPPrecision`` (what ``strategy="fsdp"`` requires) with a :class:`LossScaler`.

    The overflow flag is all-reduced across ranks (``sync_found_inf=True``): each rank holds a shard
    of every gradient, and all must skip the same steps. Autocast runs on the device type (Fabric's
    own ``FSDPPrecision`` always says ``"cuda"``). See
    :class:`~lossscale_callbacks.lightning.LossScaleFSDPPlugin` for the Trainer.

    Example:
        >>> plugin = LossScaleFabricFSDPPlugin(device="cpu")
        >>> plugin.scaler.sync_found_inf
        True
    """

    def __init__(self, precision: str = "16-mixed", device: str | None = None,
                 scaler: LossScaler | None = None, policy: Policy | None = None, *,
                 sync_found_inf: bool | str = True) -> None:
        self._init_scaling(precision, device, scaler, policy, sync_found_inf)
        # Inputs and new tensors stay float32: FSDP's MixedPrecision casts the parameters.
        self._desired_input_dtype = torch.float32

    def forward_context(self) -> AbstractContextManager:
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        return torch.autocast(self.device, dtype=dtype)


class FabricLossScaleMonitor(ScalerStepMonitor):
    """The loss scale of a Fabric run on the Fabric's loggers, like ``LossScaleMonitor`` for the Trainer.

    Reads the scaler of the Fabric's precision plugin (ours, or a stock ``GradScaler``/
    ``ShardedGradScaler``, whose skipped steps it counts on the device) through
    :class:`~lossscale_callbacks.torch.ScalerReader`, once every ``log_every`` optimizer
    steps, and runs the core's :class:`~lossscale_callbacks.LoggingLoop`: metrics to
    ``fabric.loggers`` and the sinks (from rank 0), health rules on every rank, the summary at the end.

    Its step count is the scaler's: our scaler counts its own steps, and a stock scaler's count is
    kept here and saved beside its state; :meth:`step` before the scaler has scaled any loss (before
    ``fabric.setup`` and ``fabric.backward``) is an error, not a phantom step, and a checkpoint whose
    count disagrees with its scaler's is refused. Fabric does not checkpoint its precision plugin,
    so :meth:`state_dict` carries the scaler too: ``fabric.save(path, {"loss_scale": monitor})``
    resumes the scale, its counters and the step count (a stock scaler's skipped steps too).

    Args:
        fabric: the launched ``lightning.fabric.Fabric``.
        log_every: optimizer steps between reads (>= 1); the library's one name for the interval.
        **logging: the logging arguments, handed to the :class:`~lossscale_callbacks.LoggingLoop`
            as given (``tensorboard=``, ``wandb=``, ``sinks=``, ``health=``, ``echo=``; see its
            Args); a ``"stop"`` health rule sets :attr:`should_stop` on every rank:
            break out of the loop then.

    Raises:
        ValueError: ``fabric`` is not a Fabric with an enabled loss scaler; an argument is invalid.
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra installed.

    Example:
        >>> monitor = FabricLossScaleMonitor(fabric, log_every=50)      # doctest: +SKIP
        >>> for batch in loader:                                        # doctest: +SKIP
        ...     fabric.backward(loss); optimizer.step(); monitor.step()
        >>> monitor.finish()                                            # doctest: +SKIP
    """

    _FIRST_STEP_NEEDS = "once fabric.setup(model, optimizer) and fabric.backward(loss) ran"

    def __init__(self, fabric: Any, log_every: int = 100, **logging: Unpack[LoggingArgs]) -> None:
        precision = getattr(getattr(fabric, "strategy", None), "precision", None)
        scaler = getattr(precision, "scaler", None)
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            raise ValueError("fabric must be a lightning.fabric.Fabric whose precision plugin has an enabled "
                             "loss scaler: Fabric(plugins=[LossScaleFabricPlugin()]) or precision='16-mixed' "
                             f"on a GPU; got {type(fabric).__name__}")
        self.fabric = fabric
        self.precision = precision
        writer = bool(fabric.is_global_zero)
        super().__init__(scaler, log_every=log_every, writer=writer,
                         **logging_args("FabricLossScaleMonitor", logging),
                         run_sinks=[logger_sink(lg) for lg in fabric.loggers] if writer else [])

    def step(self) -> Snapshot | None:
        """Call after each optimizer step: counts it, and reads the scaler when an interval ends.

        Returns the interval's :class:`~lossscale_callbacks.extend.Snapshot` when it read the
        scaler (one host sync), else ``None`` (no sync).

        Raises:
            RuntimeError: the scaler has not scaled a loss yet, so no optimizer step was taken.
        """
        return self._count_step()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; everything checked before anything changes.

        Pass ``fabric.load(path, {"model": ..., "optimizer": ...})["loss_scale"]``: Fabric's FSDP
        loader puts saved entries back into ``state`` instead of calling this, other strategies call
        it; the remainder has it everywhere. The scaler's state goes through the core's state gate
        (a stock GradScaler's too, before it reaches the GradScaler); unknown keys, a ``steps`` that
        disagrees with the scaler's, and a scaling (fp16) state for a ``"bf16-mixed"`` plugin are
        refused. The logging loop then judges against the loaded policy, from the loaded step on.

        Raises:
            ValueError: naming the key or field; nothing was loaded.
        """
        self._check_for_the_plugin(state)
        super().load_state_dict(state)

    def _check_for_the_plugin(self, state: Any) -> None:
        """The plugin's own checkpoint rules for the scaler's part: keys it never writes, and a scaling
        (fp16) state offered to a ``"bf16-mixed"`` plugin, refused with what to do."""
        saved = state.get("scaler") if isinstance(state, Mapping) else None
        if isinstance(saved, Mapping):
            split_plugin_state(type(self.precision).__name__, getattr(self.precision, "precision", ""), saved,
                               where=f"{type(self).__name__}.load_state_dict: state['scaler']")


__all__ = ["FabricLossScaleMonitor", "LossScaleFabricFSDPPlugin", "LossScaleFabricPlugin"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
