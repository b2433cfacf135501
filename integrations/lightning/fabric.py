"""Lightning Fabric: precision plugins with the core's loss scaling, and a monitor for the loss scale.

``Fabric(plugins=[LossScaleFabricPlugin()])`` (DDP, one device, ...) or
``Fabric(strategy="fsdp", plugins=[LossScaleFabricFSDPPlugin()])``; then
``monitor = FabricLossScaleMonitor(fabric)`` and ``monitor.step()`` after each ``optimizer.step()``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from lossscale_callbacks._validation import check_int
from lossscale_callbacks.health import HealthMonitor, HealthSpec
from lossscale_callbacks.lightning._loggers import logger_sink
from lossscale_callbacks.lightning._settings import default_device, resolve_scaling, split_plugin_state
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.metrics import Snapshot
from lossscale_callbacks.policy import Policy
from lossscale_callbacks.sinks import GuardedSink, Sink
from lossscale_callbacks.torch.scaler import LossScaler
from lossscale_callbacks.torch.stock import StockScalerReader

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


class FabricLossScaleMonitor:
    """The loss scale of a Fabric run on the Fabric's loggers, like ``LossScaleMonitor`` for the Trainer.

    Reads the scaler of the Fabric's precision plugin (ours, or a stock ``GradScaler``/
    ``ShardedGradScaler``, whose skipped steps it counts on the device) once every ``every_steps``
    optimizer steps and runs the core's :class:`~lossscale_callbacks.LoggingLoop`: metrics to
    ``fabric.loggers`` and ``sinks`` (from rank 0), health rules on every rank, the summary at the end.

    Args:
        fabric: the launched ``lightning.fabric.Fabric``.
        every_steps: optimizer steps between reads (>= 1).
        health: the health rules (``"warn"``, ``"raise"``, rules, or ``None``).
        sinks: more :class:`~lossscale_callbacks.sinks.Sink` objects.

    Example:
        >>> monitor = FabricLossScaleMonitor(fabric, every_steps=50)    # doctest: +SKIP
        >>> for batch in loader:                                        # doctest: +SKIP
        ...     fabric.backward(loss); optimizer.step(); monitor.step()
        >>> monitor.finish()                                            # doctest: +SKIP
    """

    def __init__(self, fabric: Any, every_steps: int = 100, health: HealthSpec = "warn",
                 sinks: list[Sink] | tuple[Sink, ...] = ()) -> None:
        check_int("every_steps", every_steps)
        HealthMonitor.from_spec(health)
        precision = getattr(fabric.strategy, "precision", None)
        scaler = getattr(precision, "scaler", None)
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            raise ValueError("FabricLossScaleMonitor needs a Fabric whose precision plugin has an enabled "
                             "loss scaler: Fabric(plugins=[LossScaleFabricPlugin()]) or precision='16-mixed' "
                             "on a GPU")
        self.fabric = fabric
        self.scaler = scaler
        self._stock = None if isinstance(scaler, LossScaler) else StockScalerReader(scaler)
        self._steps = 0
        writer = bool(fabric.is_global_zero)
        all_sinks: list[Sink] = []
        if writer:
            all_sinks = [*(logger_sink(lg) for lg in fabric.loggers), *(GuardedSink(s) for s in sinks)]
        self.loop = LoggingLoop(scaler.policy if self._stock is None else None, sinks=all_sinks,
                                health=health, writer=writer, log_every=every_steps)
        self.summary: str | None = None

    def _read(self) -> Any:
        return self.scaler.get_state() if self._stock is None else self._stock.read()

    def step(self) -> Snapshot | None:
        """Call after each optimizer step: counts it, and reads the scaler when an interval ends.

        Returns the interval's :class:`~lossscale_callbacks.metrics.Snapshot` when it read the
        scaler (one host sync), else ``None`` (no sync).
        """
        self._steps += 1
        if self._stock is not None:
            self._stock.after_optimizer_step()  # device ops only, no host sync
        return self.loop.maybe_observe(self._steps, self._read, read_forensics=self._read_forensics)

    def _read_forensics(self) -> Any:
        # A LossScaler(diagnose=True) in the plugin: its forensics join each interval.
        return self.scaler.read_forensics() if self._stock is None else None

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the monitor's counts, for ``fabric.save(path, {"loss_scale": monitor})``.

        Fabric does not checkpoint its precision plugin, so this carries the scaler too: saving the
        monitor is enough to resume the scale, its counters and the step count. One host read.
        """
        state: dict[str, Any] = {"steps": self._steps, "scaler": self.scaler.state_dict()}
        if self._stock is not None:
            state["stock"] = self._stock.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; all checked before anything changes.

        Pass ``fabric.load(path, {"model": ..., "optimizer": ...})["loss_scale"]``: Fabric's FSDP
        loader puts saved entries back into ``state`` instead of calling this, other strategies call
        it; the remainder has it everywhere.
        """
        steps = state.get("steps") if isinstance(state, dict) else None
        if not isinstance(steps, int) or steps < 0 or "scaler" not in state:
            raise ValueError("state: expected FabricLossScaleMonitor.state_dict()'s keys 'steps' "
                             f"(an int >= 0) and 'scaler', got {state!r}")
        if (self._stock is None) != ("stock" not in state):
            raise ValueError("state: saved with a different kind of scaler (ours vs torch's GradScaler)")
        if self._stock is not None:
            StockScalerReader.check_state(state["stock"])
        self.scaler.load_state_dict(state["scaler"])
        if self._stock is not None:
            self._stock.load_state_dict(state["stock"])
        self._steps = steps
        if steps:
            # One read now, not a step: the first interval after resuming covers only its own steps.
            self.loop.baseline(self._read())

    def finish(self) -> str:
        """End of training: one last read, the summary (printed on rank 0, returned everywhere)."""
        self.summary = self.loop.finish(self._read())
        return self.summary


__all__ = ["FabricLossScaleMonitor", "LossScaleFabricFSDPPlugin", "LossScaleFabricPlugin"]
