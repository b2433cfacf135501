"""``LossScalePlugin`` and ``LossScaleFSDPPlugin``: Lightning precision plugins that scale with
:class:`LossScaler`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import LBFGS

from lossscale_callbacks.integration import INT64_MAX, Policy, check_bool, check_int
from lossscale_callbacks.lightning._compat import bases, lightning_module_in, namespace_of, precision_base
from lossscale_callbacks.lightning._settings import (
    autocast_available,
    default_device,
    resolve_scaling,
    split_plugin_state,
)
from lossscale_callbacks.torch import LossScaler
from lossscale_callbacks.torch.integration import GRAD_SCALER_KEYS

_SHARDED_STRATEGIES = ("ModelParallelStrategy",)


def _handles_unscaling(optimizer: Any) -> bool:
    """Fused optimizers unscale inside their kernel (they read ``grad_scale``/``found_inf``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _averaged_models(trainer: Any) -> list[Any]:
    """The EMAs of the Trainer's callbacks (Lightning's ``WeightAveraging``/``EMAWeightAveraging`` make
    theirs in ``setup``, before the plugin is connected)."""
    from torch.optim.swa_utils import AveragedModel

    found = [getattr(cb, "_average_model", None) for cb in getattr(trainer, "callbacks", [])]
    return [ema for ema in found if isinstance(ema, AveragedModel)]


class _LossScaling:
    """What every precision plugin of this package does: the core's scaler, autocast on any device,
    unscaling before clipping, held LR schedulers, checkpoints. Mixed in before Lightning's class."""

    _STOCK_KEY = "MixedPrecision"  # where the stock plugin of the same strategy checkpoints its scaler

    def _init_scaling(self, precision: str, device: str | None, scaler: LossScaler | None,
                      policy: Policy | None, sync_found_inf: bool | str, hold_lr_schedulers: bool) -> None:
        """Validate the arguments and set what Lightning's base ``__init__`` would (it is not called:
        ``MixedPrecision``'s would build a torch GradScaler, ``FSDPPrecision``'s a ShardedGradScaler)."""
        hold_lr_schedulers = check_bool("hold_lr_schedulers", hold_lr_schedulers)
        device, scaler = resolve_scaling(type(self).__name__, precision, device, scaler, policy,
                                         sync_found_inf)
        # None: follow the Trainer's device once it is known (see ``connect``).
        self._device_from_trainer = device is None
        self.precision = precision
        self.device = default_device(device)
        self.scaler = scaler
        self.hold_lr_schedulers = hold_lr_schedulers
        self._lag_restored = 0  # a checkpoint's lr_scheduler_lag, which this run's adds to
        # Settled in connect for one run, undone in teardown: the schedulers and EMAs held.
        self._held: list[Any] = []
        self._sync_turned_on = False

    @property
    def policy(self) -> Policy:
        return self.scaler.policy

    @property
    def lr_scheduler_lag(self) -> int:
        """Scheduler steps held back on skipped optimizer steps (this run's, plus a loaded checkpoint's).

        Brings the held schedulers up to date first (one read where they are held on the device)."""
        held = [f for f in self.scaler.held if f.kind == "scheduler" and any(f.obj is o for o in self._held)]
        if any(f.mode == "device" for f in held):
            self.scaler.sync_held()
        return self._lag_restored + sum(f.held_back() for f in held)

    @lr_scheduler_lag.setter
    def lr_scheduler_lag(self, value: int) -> None:
        self._lag_restored = value

    @property
    def autocast_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast(self.device, dtype=self.autocast_dtype, cache_enabled=False)

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast on the plugin's device type (``FSDPPrecision``'s own always says ``"cuda"``)."""
        with self.autocast_context_manager():
            yield

    # The base hooks call into their own namespace's trainer internals: dispatch them by the
    # namespace of the Trainer in use.

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        tensor = self.scaler.scale(tensor)
        return precision_base(module.trainer).pre_backward(self, tensor, module)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return precision_base(module.trainer).post_backward(self, tensor, module)

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        precision_base(model.trainer)._after_closure(self, model, optimizer)

    def _clip_gradients(self, model: Any, optimizer: Any, clip_val: Any = None,
                        gradient_clip_algorithm: Any = None) -> None:
        trainer = getattr(model, "trainer", None)
        base = precision_base(trainer) if trainer is not None else precision_base(model)
        base._clip_gradients(self, model, optimizer, clip_val, gradient_clip_algorithm)

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0,
                       gradient_clip_algorithm: Any = "norm") -> None:
        """Clip the (already unscaled) gradients.

        Refused for fused optimizers, as in Lightning, unless the scale is fixed at 1 (bf16): they
        unscale inside their kernel, after clipping would have seen scaled gradients.
        """
        constants = self.scaler.policy.constants
        unscaled_anyway = constants.min_scale == constants.max_scale == 1.0
        if clip_val > 0 and _handles_unscaling(optimizer) and not unscaled_anyway:
            raise RuntimeError(
                f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping"
                " because it performs unscaling of gradients internally. HINT: Are you using a 'fused' "
                "optimizer?"
            )
        # Lightning's base Precision clips; MixedPrecision's override would refuse fused optimizers
        # even at a scale fixed at 1 (Lightning 2.6 does; later releases don't).
        base = next(k for k in type(self).__mro__ if k.__name__ == "Precision")
        base.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        """Settle everything about the run, once: Lightning calls this when it sets training up.

        It comes after the model was moved to its device and before the first forward pass (and
        after the callbacks' ``setup``). The autocast device follows the model's (unless one was
        given); ``sync_found_inf="auto"`` is turned on under a sharded strategy; with
        ``hold_lr_schedulers`` the step-interval schedulers and the EMA of a ``WeightAveraging``
        callback are held on skipped steps (``LossScaler.hold``). Nothing of this changes while
        training runs; :meth:`teardown` undoes it.
        """
        if self._device_from_trainer:
            param = next(iter(model.parameters()), None)
            if param is not None and autocast_available(param.device.type):
                self.device = param.device.type
        if isinstance(self.scaler, LossScaler):  # names the layers for LossScaleMonitor(diagnose=True)
            self.scaler.watch(model)
        module = lightning_module_in(model)
        self._settle_sync(module.trainer.strategy if module is not None else None)
        if self.hold_lr_schedulers and isinstance(self.scaler, LossScaler) and self.scaler.is_enabled():
            self._hold(lr_schedulers, optimizers, module.trainer if module is not None else None)
        return super().connect(model, optimizers, lr_schedulers)

    def _hold(self, configs: list[Any], optimizers: list[Any], trainer: Any) -> None:
        """Hold the schedulers Lightning steps after each optimizer step, and a WeightAveraging EMA."""
        held = {id(f.obj) for f in self.scaler.held}
        for config in configs:
            if config.interval == "step" and id(config.scheduler) not in held:
                self._held.append(self.scaler.hold(config.scheduler))
        if trainer is not None and len(optimizers) == 1:  # an EMA follows the one optimizer
            for ema in _averaged_models(trainer):
                if id(ema) not in held:
                    self._held.append(self.scaler.hold(ema, optimizer=optimizers[0]))

    def _settle_sync(self, strategy: Any) -> None:
        # A sharded strategy: each rank checks only its own shards, and the scaler's "auto" recognises
        # FSDP (v1) flat parameters only; all-reduce the overflow flag for this run.
        sharded = any(k.__name__ in _SHARDED_STRATEGIES for k in type(strategy).__mro__)
        if sharded and getattr(self.scaler, "sync_found_inf", None) == "auto":
            self.scaler.sync_found_inf = True
            self._sync_turned_on = True

    def teardown(self) -> None:
        """Lightning calls this when training ends: the user's schedulers and EMAs (their stock methods,
        float learning rates) and ``sync_found_inf`` back."""
        self._lag_restored = self.lr_scheduler_lag if self._held else self._lag_restored
        for obj in self._held:
            self.scaler.release(obj)
        self._held = []
        if self._sync_turned_on:
            self.scaler.sync_found_inf = "auto"
            self._sync_turned_on = False
        super().teardown()

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward + scaled backward), unscale, hooks and clipping, then step and update."""
        if isinstance(optimizer, LBFGS):
            raise ValueError("optimizer: LBFGS is not compatible with loss scaling (AMP); use another "
                             "optimizer")
        closure_result = closure()
        # Automatic optimization skips backward when training_step returns None: nothing to step.
        skip = closure_result is None and model.automatic_optimization
        if not skip and not _handles_unscaling(optimizer):
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return output

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (one host sync) and the LR-schedule lag, for Lightning's checkpoint."""
        state = self.scaler.state_dict()
        if self.hold_lr_schedulers:
            state["lr_scheduler_lag"] = self.lr_scheduler_lag
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a ``GradScaler``'s, see :meth:`LossScaler.load_state_dict`).

        All or nothing: the keys, ``lr_scheduler_lag`` (an integer >= 0) and the precision are
        checked before the scaler loads its part, which passes the scaler's own state check.

        Raises:
            ValueError: naming the field: not a dict, an unknown key, a bad ``lr_scheduler_lag``, an
                invalid scaler state, or a ``"bf16-mixed"`` plugin given a checkpoint whose policy
                scales (one saved by a ``"16-mixed"`` run). Nothing has changed then.
        """
        scaler_state, own = split_plugin_state(type(self).__name__, self.precision, state_dict,
                                               ("lr_scheduler_lag",))
        lag = check_int("load_state_dict: lr_scheduler_lag", own.get("lr_scheduler_lag", 0), 0, INT64_MAX)
        self.scaler.load_state_dict(scaler_state)
        self.lr_scheduler_lag = lag

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also write the scale where Lightning's own plugin reads it: removing this library keeps it.

        Lightning saves :meth:`state_dict` under this class's name, and its stock ``MixedPrecision``
        (``FSDPPrecision`` for :class:`~lossscale_callbacks.lightning.LossScaleFSDPPlugin`) restores
        only the entry under its own name. That entry gets what its ``GradScaler`` loads: the scale,
        the growth tracker, the growth and backoff factors and the growth interval. What a GradScaler
        cannot hold (hysteresis, the bounds, the skip counts, the LR-schedule lag) stays in ours,
        which this plugin prefers when resuming. Not for ``"bf16-mixed"``: nothing was scaled, and a
        stock fp16 run should start from its own initial scale, not from 1.
        """
        ours = checkpoint.get(type(self).__qualname__) or {}
        # A disabled scaler saves no state (the entry then holds the lag alone, if anything).
        if self.precision == "16-mixed" and all(key in ours for key in GRAD_SCALER_KEYS):
            checkpoint[self._STOCK_KEY] = {key: ours[key] for key in GRAD_SCALER_KEYS}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resuming a run of Lightning's own plugin: start from its ``GradScaler``.

        Lightning restores this plugin from the checkpoint's entry under this class's name; a
        checkpoint written with the stock plugin has only ``"MixedPrecision"`` (or
        ``"FSDPPrecision"``), whose scale and growth tracker are taken over here (see
        :meth:`LossScaler.load_state_dict`; a collapsed scale is refused with what to do). A
        checkpoint of ours has both (see :meth:`on_save_checkpoint`): ours is the one loaded.
        """
        if type(self).__qualname__ not in checkpoint and checkpoint.get(self._STOCK_KEY):
            self.load_state_dict(checkpoint[self._STOCK_KEY])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(precision={self.precision!r}, device={self.device!r}, "
                f"policy={self.policy!r})")


class LossScalePlugin(_LossScaling, *bases("plugins.precision", "MixedPrecision")):  # type: ignore[misc]
    """Mixed-precision training whose loss scale follows the core's rule, for ``Trainer(plugins=[...])``.

    It is a subclass of Lightning's ``MixedPrecision`` plugin in every installed namespace
    (``lightning.pytorch`` and ``pytorch_lightning``), so either Trainer accepts it.

    * ``"16-mixed"`` runs ``torch.autocast(device, dtype=torch.float16)``, also on CPU (where
      ``Trainer(precision="16-mixed")`` would switch to bfloat16), with a dynamic loss scale.
    * ``"bf16-mixed"`` runs bfloat16 autocast with the scale fixed at 1: no scaling, but
      non-finite steps are still skipped and counted.

    Gradients are unscaled right after the backward pass (before ``on_before_optimizer_step`` and
    gradient clipping), except for fused optimizers, which unscale in their own kernel (clipping
    is then refused, as in Lightning). Host syncs: none per step with fused optimizers (except
    before the first applied update of a fused ``SGD`` with momentum), one (the skip decision)
    otherwise; see :mod:`lossscale_callbacks.torch._scaler`.

    Checkpoints carry the scaler's state (and ``lr_scheduler_lag``) under ``"LossScalePlugin"`` and
    what Lightning's own ``MixedPrecision`` reads under ``"MixedPrecision"``, so either plugin resumes
    the other's run.

    The scale is updated after every optimizer step; with manual optimization and several
    optimizers, give each its own ``manual_backward`` before its ``step()``.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type (``"cpu"``, ``"cuda"``); default: the type of the device
            the Trainer puts the model on (until the Trainer has set it up: ``"cuda"`` when
            available, else ``"cpu"``).
        scaler: a :class:`~lossscale_callbacks.torch.LossScaler` to use (as
            ``MixedPrecision(scaler=...)`` takes a GradScaler); default: a new one with ``policy``.
        policy: the loss-scale policy of the scaler the plugin makes (default: GradScaler's
            settings, ``DynamicPolicy(initial_scale=2**16)`` in ``[1, 2**24]``; bf16 only allows
            ``None`` or ``FixedPolicy(1.0)``). Not together with ``scaler``.
        sync_found_inf: passed to :class:`LossScaler`. ``"auto"`` also turns it on under
            Lightning's ``ModelParallelStrategy``, decided once when the Trainer sets the run up
            (:meth:`connect`) and put back when it ends. (``strategy="fsdp"`` accepts only
            ``FSDPPrecision`` plugins: use :class:`~lossscale_callbacks.lightning.LossScaleFSDPPlugin`
            there.)
        hold_lr_schedulers: on by default: step-interval LR schedulers and the EMA of Lightning's
            ``WeightAveraging``/``EMAWeightAveraging`` callback advance only on the optimizer steps
            applied, so the schedule and the average follow the updates (``LossScaler.hold``; with a
            fused optimizer the learning rate becomes a device tensor looked up by a device count: no
            host read; see :mod:`lossscale_callbacks.torch._held`). With manual optimization too:
            your ``scheduler.step()`` calls are held. The objects stay yours (their methods are
            held for the run and put back when ``fit`` ends); ``trainer.global_step`` still counts
            attempted steps (a ``max_steps`` run is flagged by the monitor when it skipped some).
            ``plugin.lr_scheduler_lag`` counts the scheduler steps held back; it is saved in
            checkpoints with the scaler. ``False``: Lightning steps them on skipped steps too, and
            ``LossScaleMonitor`` says so.

    Raises:
        ValueError: ``precision`` is not one of the two, ``scaler`` and ``policy`` are both given, or
            another argument is invalid (named).

    Example:
        >>> from lossscale_callbacks import DynamicPolicy
        >>> plugin = LossScalePlugin(policy=DynamicPolicy(hysteresis=2), device="cpu")
        >>> plugin.precision, plugin.autocast_dtype
        ('16-mixed', torch.float16)
    """

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str | None = None,
        scaler: LossScaler | None = None,
        policy: Policy | None = None,
        *,
        sync_found_inf: bool | str = "auto",
        hold_lr_schedulers: bool = True,
    ) -> None:
        self._init_scaling(precision, device, scaler, policy, sync_found_inf, hold_lr_schedulers)


__all__ = [
    "LossScaleFSDPPlugin",
    "LossScalePlugin",
    "namespace_of",
]

# ----------------------------------------
# ``LossScaleFSDPPlugin``: the core's loss scaling under ``Trainer(strategy="fsdp")``.


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
        hold_lr_schedulers: bool = True,
    ) -> None:
        self._init_scaling(precision, device, scaler, policy, sync_found_inf, hold_lr_schedulers)
        # What FSDPPrecision.__init__ sets besides the scaler: inputs and new tensors stay float32
        # (FSDP's MixedPrecision casts the parameters; autocast the ops).
        self._desired_input_dtype = torch.float32
