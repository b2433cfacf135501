"""``LossScaleMonitor``: the loss-scale metrics on every Lightning logger, like ``LearningRateMonitor``."""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lossscale_callbacks._validation import check_bool
from lossscale_callbacks.forensics import check_diagnose
from lossscale_callbacks.health import HealthMonitor, HealthSpec
from lossscale_callbacks.lightning._compat import bases
from lossscale_callbacks.lightning._loggers import logger_sink
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.metrics import SCALE, SKIPPED_STEPS, Snapshot
from lossscale_callbacks.sinks import GuardedSink, Sink
from lossscale_callbacks.torch.deepspeed_reader import DeepSpeedScalerReader, has_deepspeed_scaler
from lossscale_callbacks.torch.scaler import LossScaler
from lossscale_callbacks.torch.stock import StockScalerReader

_INTERVALS = (None, "step", "epoch")


class _Source:
    """Where the state comes from: our LossScaler, a stock GradScaler read through StockScalerReader,
    or DeepSpeed's own loss scaler (found once the engine exists, when training starts)."""

    def __init__(self, scaler: Any = None, deepspeed_strategy: Any = None) -> None:
        self.ours = isinstance(scaler, LossScaler)
        self.scaler = scaler
        self.stock = None if self.ours or scaler is None else StockScalerReader(scaler)
        self.deepspeed_strategy = deepspeed_strategy
        self.deepspeed: DeepSpeedScalerReader | None = None

    def start(self) -> bool:
        """At training start; False when there is nothing to read after all."""
        if self.deepspeed_strategy is None:
            return True
        engine = getattr(self.deepspeed_strategy, "deepspeed_engine", None)
        if engine is None or not has_deepspeed_scaler(engine):
            return False
        self.deepspeed = DeepSpeedScalerReader(engine)
        return True

    @property
    def policy(self) -> Any:
        # Asked for when training starts: a checkpoint restored after setup may bring its own policy.
        # torch's GradScaler has none (the loop then counts a scale of 1 as its minimum).
        if self.deepspeed is not None:
            return self.deepspeed.policy()
        return self.scaler.policy if self.ours else None

    def after_optimizer_steps(self, steps: int) -> None:
        if self.stock is not None:
            self.stock.after_optimizer_step(steps)
        elif self.deepspeed is not None:
            self.deepspeed.after_optimizer_step(steps)

    def read_forensics(self) -> Any:
        """Our scaler's overflow forensics of the interval (``diagnose``), else ``None``."""
        return self.scaler.read_forensics() if self.ours else None

    def read(self) -> Any:
        """The one host read of an interval (DeepSpeed's numbers are on the host already)."""
        if self.deepspeed is not None:
            return self.deepspeed.read()
        return self.scaler.get_state() if self.ours else self.stock.read()  # type: ignore[union-attr]


def _find_scaler(trainer: Any) -> Any:
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, (LossScaler, torch.amp.GradScaler)) and scaler.is_enabled():
        return scaler
    return None


def _deepspeed_fp16(trainer: Any) -> Any:
    """Lightning's DeepSpeedStrategy with fp16 (DeepSpeed scales the loss itself), else None."""
    strategy = getattr(trainer, "strategy", None)
    if not hasattr(type(strategy), "deepspeed_engine"):
        return None
    precision = str(getattr(getattr(strategy, "precision_plugin", None), "precision", ""))
    return strategy if precision.startswith("16") else None


class LossScaleMonitor(*bases("callbacks", "Callback")):  # type: ignore[misc]
    """Logs ``loss_scale/*`` through every trainer logger and into ``trainer.callback_metrics``.

    Works with :class:`~lossscale_callbacks.lightning.LossScalePlugin` and
    :class:`~lossscale_callbacks.lightning.LossScaleFSDPPlugin`, with Lightning's stock
    ``MixedPrecision`` and ``FSDPPrecision`` plugins (``precision="16-mixed"`` on a GPU), whose
    skipped steps it counts on the device, and with ``DeepSpeedStrategy`` in fp16, whose own loss
    scaler and skipped-step count it reads from the engine. The state is read from the device
    once per log interval (never per step), once more at the end of training, and once when
    training resumes from a checkpoint (so the first interval counts only its own steps), and
    handed to the core's :class:`~lossscale_callbacks.LoggingLoop`, the same loop the Keras
    callback runs.

    What goes where: every logger of the trainer (``TensorBoardLogger`` also gets the "Loss
    scale" Custom Scalars section and the reports in its Text tab; ``WandbLogger`` gets what a
    :class:`~lossscale_callbacks.wandb.WandbSink` run gets: the ``loss_scale/step`` axis, the
    summary, report Tables, the policy in the config and alerts; ``CSVLogger`` rows), plus the
    sinks of ``tensorboard=``, ``wandb=`` and ``sinks=``. Loggers write at Lightning's own logging
    step, so their rows line up with the metrics of ``self.log``. Counts are ints. The
    end-of-training summary (with an honest health verdict) and the alignment report are printed.
    Loggers and sinks are written from rank 0 only, while ``callback_metrics`` and the health
    rules run on every rank (the state is the same on all ranks), so
    ``EarlyStopping(monitor="loss_scale/skip_rate")`` and a ``"stop"`` rule behave the same on
    every rank.

    Args:
        logging_interval: ``None`` or ``"step"``: at the trainer's ``log_every_n_steps``;
            ``"epoch"``: at the end of each training epoch; an integer ``n >= 1``: at the end of
            every batch that took the optimizer step count past a multiple of ``n``.
        prog_bar: also show the scale and the skipped steps in the progress bar.
        health: the health rules (``None``/``False`` off, ``True``/``"warn"``/``"raise"``/``"stop"``
            for the default rules, or rules); ``"stop"`` sets ``trainer.should_stop``.
        tensorboard: a log directory: also write to a
            :class:`~lossscale_callbacks.tensorboard.TensorBoardSink` there.
        wandb: True, or a dict of ``wandb.init`` arguments: also write to a
            :class:`~lossscale_callbacks.wandb.WandbSink` (uses the active run if there is one).
        sinks: more :class:`~lossscale_callbacks.sinks.Sink` objects.
        check_alignment: run the Tensor Core alignment check
            (``lossscale_callbacks.torch.alignment.check_alignment``) once, on the first training
            batch; print its report and write it to the loggers and sinks. The model input is
            ``alignment_kwargs["sample"]`` if given, else the module's ``example_input_array``,
            else the first element of an ``(inputs, targets)`` batch, else the batch itself;
            ``dtype`` defaults to the trainer's precision (``"16-mixed"``...).
        alignment_kwargs: more keyword arguments for ``check_alignment`` (``sample``, ``dtype``,
            ``target``, ``forward``, ``loss_fn``...).
        diagnose: overflow forensics (``True`` or ``"every_step"``; see
            :mod:`lossscale_callbacks.forensics`): switches them on in the plugin's
            :class:`~lossscale_callbacks.torch.LossScaler` (``LossScalePlugin`` or
            ``LossScaleFSDPPlugin``; a stock scaler has none, and the monitor warns), which names
            the layers after the LightningModule's modules. Each interval then also logs the skip
            causes, writes the report and the gradient histogram, and the summary says which layer
            overflowed and why. No host read is added to the training step.

    Example:
        >>> monitor = LossScaleMonitor(logging_interval=50, health="stop")
        >>> monitor.logging_interval
        50
    """

    def __init__(
        self,
        logging_interval: int | str | None = None,
        prog_bar: bool = False,
        health: HealthSpec = "warn",
        check_alignment: bool = False,
        alignment_kwargs: dict[str, Any] | None = None,
        *,
        tensorboard: str | os.PathLike[str] | None = None,
        wandb: bool | Mapping[str, Any] | None = None,
        sinks: Iterable[Sink] = (),
        diagnose: bool | str = False,
    ) -> None:
        is_count = isinstance(logging_interval, int) and not isinstance(logging_interval, bool)
        if logging_interval not in _INTERVALS and not (is_count and logging_interval >= 1):
            raise ValueError(f"logging_interval must be None, 'step', 'epoch' or an integer >= 1, "
                             f"got {logging_interval!r}")
        check_bool("prog_bar", prog_bar)
        check_bool("check_alignment", check_alignment)
        if alignment_kwargs is not None and not isinstance(alignment_kwargs, dict):
            raise ValueError(f"alignment_kwargs must be None or a dict, got {alignment_kwargs!r}")
        if tensorboard is not None and not isinstance(tensorboard, (str, os.PathLike)):
            raise ValueError(f"tensorboard must be None or a log directory path, got {tensorboard!r}")
        if not (wandb is None or isinstance(wandb, (bool, Mapping))):
            raise ValueError(f"wandb must be None, a bool, or a dict of wandb.init arguments, got {wandb!r}")
        HealthMonitor.from_spec(health)  # validated now, used by the logging loop of each fit
        self.diagnose = check_diagnose(diagnose)
        self.logging_interval = logging_interval
        self.prog_bar = prog_bar
        self.health_spec = health
        self.tensorboard = tensorboard
        self.wandb = wandb
        self._user_sinks = [GuardedSink(s) for s in sinks]
        self.check_alignment = check_alignment
        self.alignment_kwargs = dict(alignment_kwargs or {})
        self.loop: LoggingLoop | None = None
        self.summary: str | None = None
        self.alignment_report: Any = None
        self._source: _Source | None = None
        self._owned_sinks: list[Sink] = []
        self._last_global_step = 0  # the trainer's step when steps were last counted
        self._observed_at = 0  # ... and when the state was last read
        self._alignment_done = False

    @property
    def tracker(self) -> Any:
        """The logging loop's metrics tracker (its ``last`` snapshot), or None before training."""
        return self.loop.tracker if self.loop is not None else None

    @property
    def health(self) -> HealthMonitor | None:
        return self.loop.health if self.loop is not None else HealthMonitor.from_spec(self.health_spec)

    # ------------------------------------------------------------------------------- setup

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        scaler = _find_scaler(trainer)
        deepspeed = _deepspeed_fp16(trainer) if scaler is None else None
        if scaler is None and deepspeed is None:
            self._warn_no_scaler(trainer)
            self._source = None
            return
        self._source = _Source(scaler, deepspeed_strategy=deepspeed)
        if self.diagnose:
            if self._source.ours:
                if scaler.forensics is None or scaler.forensics.mode != self.diagnose:
                    scaler.set_diagnose(self.diagnose)
            elif trainer.is_global_zero:
                warnings.warn("[lossscale-callbacks] LossScaleMonitor(diagnose=...) needs the "
                              "lossscale-callbacks scaler (plugins=[LossScalePlugin()]); Lightning's own "
                              "scaler has no forensics. Logging goes on without them.", UserWarning,
                              stacklevel=2)

    @staticmethod
    def _warn_no_scaler(trainer: Any) -> None:
        if trainer.is_global_zero:
            warnings.warn(
                "[lossscale-callbacks] LossScaleMonitor found no loss scaler: use "
                "plugins=[LossScalePlugin(...)], precision='16-mixed' on a GPU, or DeepSpeed with fp16. "
                "Nothing will be logged.",
                UserWarning, stacklevel=3)

    def _open_loop(self, trainer: Any) -> LoggingLoop:
        assert self._source is not None
        self._close_owned_sinks()
        sinks: list[Sink] = []
        if trainer.is_global_zero:
            sinks += [logger_sink(lg) for lg in trainer.loggers]
            if self.tensorboard is not None:
                from lossscale_callbacks.tensorboard import TensorBoardSink

                self._owned_sinks.append(TensorBoardSink(os.fspath(self.tensorboard)))
            if self.wandb:
                from lossscale_callbacks.wandb import WandbSink

                self._owned_sinks.append(WandbSink(**(dict(self.wandb) if isinstance(self.wandb, Mapping)
                                                      else {})))
            sinks += [*self._owned_sinks, *self._user_sinks]
        return LoggingLoop(self._source.policy, sinks=sinks, health=self.health_spec,
                           writer=bool(trainer.is_global_zero),
                           stop=lambda: setattr(trainer, "should_stop", True))

    def _close_owned_sinks(self) -> None:
        for sink in self._owned_sinks:
            GuardedSink(sink).close()
        self._owned_sinks = []

    # ---------------------------------------------------------------------------- training

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # After a checkpoint was restored: count steps from here.
        self._last_global_step = self._observed_at = trainer.global_step
        if self._source is None:
            return
        if not self._source.start():
            self._warn_no_scaler(trainer)
            self._source = None
            return
        if self._source.stock is not None:
            # GradScaler does not checkpoint skipped steps; they are counted from this point on.
            self._source.stock.steps = trainer.global_step
        self.loop = self._open_loop(trainer)
        if trainer.global_step > 0:
            # Resumed: one read now (not a step), so the first interval covers only its own steps.
            self.loop.baseline(self._source.read())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.check_alignment and not self._alignment_done:
            self._alignment_done = True
            self._run_alignment(trainer, pl_module, batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._source is None:
            return
        self._count_steps(trainer)
        if self._due_at_step(trainer):
            self._observe(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Several optimizer steps in one batch (manual optimization): the stock GradScaler's state
        # after the previous step is visible only until the next update.
        self._count_steps(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._source is not None and self.logging_interval == "epoch":
            self._observe(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._source is None or self.loop is None:
            return
        last = self.loop.last
        lag = getattr(getattr(trainer.strategy, "precision_plugin", None), "lr_scheduler_lag", 0)
        note = (f"The LR schedulers were held on skipped steps: the schedule is {lag} scheduler step(s) "
                "behind the optimizer steps attempted." if lag else "")
        # One last read so the final values and the summary describe the whole run.
        if last is None or last.step != self._steps_now(trainer):
            self._observe(trainer)
        self.summary = self.loop.finish(note=note)
        self._close_owned_sinks()

    # ----------------------------------------------------------------------------- helpers

    def _steps_now(self, trainer: Any) -> int:
        # Host-side counts: no device read needed to know whether anything happened since.
        if self._source is not None and self._source.stock is not None:
            return self._source.stock.steps
        return int(trainer.global_step)

    def _count_steps(self, trainer: Any) -> None:
        """Host-side step count; a stock scaler's overflow is also counted here, on the device."""
        stepped = trainer.global_step - self._last_global_step
        if stepped > 0 and self._source is not None:
            self._last_global_step = trainer.global_step
            self._source.after_optimizer_steps(stepped)

    def _due_at_step(self, trainer: Any) -> bool:
        step = trainer.global_step
        if self.logging_interval == "epoch" or step <= self._observed_at:
            return False
        if isinstance(self.logging_interval, int):
            # Crossing a multiple, not landing on it: a batch may take several optimizer steps.
            return step // self.logging_interval > self._observed_at // self.logging_interval
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and hasattr(connector, "should_update_logs"):
            return bool(connector.should_update_logs)
        every = trainer.log_every_n_steps
        return bool(every) and step % every == 0

    def _observe(self, trainer: Any) -> Snapshot | None:
        assert self._source is not None and self.loop is not None
        self._observed_at = trainer.global_step
        # Lightning's own logging step: rows line up with the metrics of self.log.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        sink_step = getattr(epoch_loop, "_batches_that_stepped", None)
        snapshot = self.loop.observe(self._source.read(), sink_step=sink_step,
                                     forensics=self._source.read_forensics())
        metrics = snapshot.metrics()
        callback_metrics = trainer.callback_metrics
        for name, value in metrics.items():
            callback_metrics[name] = torch.tensor(value)
        if self.prog_bar:
            progress = trainer.progress_bar_metrics
            progress[SCALE] = metrics[SCALE]
            progress[SKIPPED_STEPS] = metrics[SKIPPED_STEPS]
        return snapshot

    def _run_alignment(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        try:
            module = importlib.import_module("lossscale_callbacks.torch.alignment")
        except ImportError as exc:
            warnings.warn(f"[lossscale-callbacks] check_alignment=True but the alignment checker could not "
                          f"be imported ({exc}); skipping it.", UserWarning, stacklevel=2)
            return
        kwargs = dict(self.alignment_kwargs)
        sample = kwargs.pop("sample", None)
        if sample is None:
            sample = getattr(pl_module, "example_input_array", None)
        if sample is None:
            sample = batch[0] if isinstance(batch, (tuple, list)) and len(batch) >= 2 else batch
        precision = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
        if "dtype" not in kwargs:  # the Trainer's precision is the one the model trains in
            name = str(getattr(precision, "precision", "auto"))
            kwargs["dtype"] = name if name in ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true",
                                               "32") else "auto"
        had_no_grad = [p for p in pl_module.parameters() if p.grad is None]
        try:
            report = module.check_alignment(pl_module, sample, **kwargs)
        except Exception as exc:  # a diagnostic must never stop training
            warnings.warn(f"[lossscale-callbacks] the alignment check failed and was skipped: "
                          f"{type(exc).__name__}: {exc}", UserWarning, stacklevel=2)
            return
        finally:
            # The check may run a backward pass; leave the gradients as training expects them.
            for param in had_no_grad:
                param.grad = None
        self.alignment_report = report
        if self.loop is not None:
            self.loop.report_alignment(report.to_markdown())
