"""``LossScaleMonitor``: the loss-scale metrics on every Lightning logger, like ``LearningRateMonitor``."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

import torch

from lossscale_callbacks import LoggingLoop
from lossscale_callbacks.integration import (
    SCALE,
    SKIPPED_STEPS,
    TRAINER_STEP,
    FollowerCount,
    LoggingArgs,
    Snapshot,
    carry,
    check_bool,
    check_diagnose,
    interval_args,
    logging_args,
)
from lossscale_callbacks.lightning._compat import bases
from lossscale_callbacks.lightning._ledger import LightningLedger
from lossscale_callbacks.lightning._loggers import logger_sink
from lossscale_callbacks.torch import LossScaler, ScalerReader
from lossscale_callbacks.torch.integration import has_deepspeed_scaler, warn_no_scaler

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

# The old spellings of the intervals that are not a count (they still work, with a FutureWarning).
_DEPRECATED = {"step": "trainer", "epoch": "epoch"}


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


def _lightning_logs_now(trainer: Any) -> bool:
    """Whether Lightning itself logs at this batch end (``log_every_n_steps``), as ``self.log`` does."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    every = trainer.log_every_n_steps
    return bool(every) and trainer.global_step % every == 0


class LossScaleMonitor(*bases("callbacks", "Callback")):  # type: ignore[misc]
    """Logs ``loss_scale/*`` through every trainer logger and into ``trainer.callback_metrics``.

    Works with :class:`~lossscale_callbacks.lightning.LossScalePlugin` and
    :class:`~lossscale_callbacks.lightning.LossScaleFSDPPlugin`, with Lightning's stock
    ``MixedPrecision`` and ``FSDPPrecision`` plugins, whose skipped steps it counts on the device, and
    with ``DeepSpeedStrategy`` in fp16, whose own scaler it reads from the engine (all through
    :class:`~lossscale_callbacks.torch.ScalerReader`). The state is read once per log interval (never
    per step), at the end of training and when training resumes, and handed to the core's
    :class:`~lossscale_callbacks.LoggingLoop`. Loggers write at Lightning's own logging step, so their
    rows line up with ``self.log``'s; ``TensorBoardLogger`` also gets the "Loss scale" section,
    ``WandbLogger`` what a :class:`~lossscale_callbacks.wandb.WandbSink` run gets. Loggers and sinks
    are written from rank 0 only; ``callback_metrics`` and the health rules run on every rank.

    Args:
        log_every: every this many optimizer steps (``trainer.global_step``), as for
            :class:`~lossscale_callbacks.LoggingLoop`; not with ``every``.
        every: ``"trainer"`` (the default when ``log_every`` is not given): at the trainer's
            ``log_every_n_steps``, where ``self.log`` logs; ``"epoch"``: at the end of each training
            epoch. The old spellings ``log_every="step"`` and ``log_every="epoch"`` still work, with a
            ``FutureWarning``.
        prog_bar: also show the scale and the skipped steps in the progress bar.
        **logging: the shared logging arguments (``tensorboard=``, ``wandb=``, ``sinks=``,
            ``health=``, ``echo=``), handed to :class:`~lossscale_callbacks.LoggingLoop` as given (see
            its Args); a ``"stop"`` health rule sets ``trainer.should_stop``.
        check_alignment: run the Tensor Core alignment check once, on the first training batch;
            print its report and write it to the loggers and sinks. The model input is
            ``alignment_kwargs["sample"]`` if given, else the module's ``example_input_array``, else
            the first element of an ``(inputs, targets)`` batch, else the batch itself; ``dtype``
            defaults to the trainer's precision.
        alignment_kwargs: more keyword arguments for the check (``sample``, ``dtype``, ``target``,
            ``forward``, ``loss_fn``...).
        diagnose: overflow forensics (``True`` or ``"every_step"``), switched on in the plugin's
            :class:`~lossscale_callbacks.torch.LossScaler` (a stock scaler has none: the monitor
            warns); layers are named after the LightningModule's modules. No host read is added to
            the training step.
        ledger: the ledger of bad steps (with ``LossScalePlugin``): ``True`` writes
            ``bad_steps.rank<r>.jsonl`` beside the dashboards (``tensorboard=``, else the trainer's
            ``log_dir``), a folder writes there; each bad step with its epoch, ``batch_idx`` and the train
            sampler's indices; its words join the summary. No host read is added to the step.
        replay: replay each bad step's batch (``training_step``) on the same weights, with its RNG state,
            at the same scale, the policy's minimum and in float32: ``True`` (at most 4 per log
            interval) or the most per interval. See the "Which batch" page for what it costs.
        ids: the batch's own id field (a mapping key or attribute) instead of the sampler's indices.

    Raises:
        ValueError: an argument is invalid (checked here, with ``tensorboard=``/``wandb=``).
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra installed.

    Example:
        >>> monitor = LossScaleMonitor(log_every=50, health="stop")
        >>> monitor.log_every
        50
    """

    def __init__(
        self,
        log_every: int | None = None,
        prog_bar: bool = False,
        *,
        every: str | None = None,
        check_alignment: bool = False,
        alignment_kwargs: dict[str, Any] | None = None,
        diagnose: bool | str = False,
        ledger: Any = False,
        replay: bool | int = False,
        ids: str | None = None,
        **logging: Unpack[LoggingArgs],
    ) -> None:
        log_every, self.every = interval_args("LossScaleMonitor", log_every, every,
                                              allowed=("epoch", "trainer"), default=(None, "trainer"),
                                              deprecated=_DEPRECATED)
        check_bool("prog_bar", prog_bar)
        check_bool("check_alignment", check_alignment)
        if alignment_kwargs is not None and not isinstance(alignment_kwargs, dict):
            raise ValueError(f"alignment_kwargs must be None or a dict, got {alignment_kwargs!r}")
        self.diagnose = check_diagnose(diagnose)
        self.ledger = LightningLedger(ledger, replay, ids)
        if self.ledger.replay and not self.ledger.on:
            raise ValueError("replay needs the ledger: LossScaleMonitor(ledger=True, replay=True)")
        self._tensorboard = logging.get("tensorboard")
        self.loop = LoggingLoop(None, log_every=log_every, stop=self._stop,
                                **logging_args("LossScaleMonitor", logging))
        self.prog_bar = prog_bar
        self.check_alignment = check_alignment
        self.alignment_kwargs = dict(alignment_kwargs or {})
        self.reader: ScalerReader | None = None
        self.alignment_report: Any = None
        self._scaler: Any = None
        self._deepspeed: Any = None
        self._trainer: Any = None
        self._last_global_step = 0  # the trainer's step when steps were last counted
        self._read_at = -1  # ... and when the state was last read
        self._alignment_done = False

    @property
    def log_every(self) -> int | None:
        """The optimizer steps per interval (``None`` with ``every``); the loop holds it."""
        return self.loop.log_every

    @property
    def summary(self) -> str | None:
        """The end-of-training summary (``None`` before it)."""
        return self.loop.summary

    def _stop(self) -> None:
        self._trainer.should_stop = True

    # ------------------------------------------------------------------------------- setup

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._scaler = _find_scaler(trainer)
        self._deepspeed = _deepspeed_fp16(trainer) if self._scaler is None else None
        self.reader = None
        if self._scaler is None and self._deepspeed is None:
            self._warn_no_scaler(trainer)
        elif self.diagnose and isinstance(self._scaler, LossScaler):
            if self._scaler.forensics is None or self._scaler.forensics.mode != self.diagnose:
                self._scaler.set_diagnose(self.diagnose)
        elif self.diagnose and trainer.is_global_zero:
            warnings.warn("[lossscale-callbacks] LossScaleMonitor(diagnose=...) needs the "
                          "lossscale-callbacks scaler (plugins=[LossScalePlugin()]); Lightning's own "
                          "scaler has no forensics. Logging goes on without them.", UserWarning, stacklevel=2)
        if self.ledger.on and self._scaler is not None:
            self.ledger.setup(trainer, pl_module, self._scaler, self._tensorboard)

    @staticmethod
    def _warn_no_scaler(trainer: Any) -> None:
        if trainer.is_global_zero:
            warn_no_scaler("LossScaleMonitor", "use plugins=[LossScalePlugin(...)], precision='16-mixed' on "
                           "a GPU, or DeepSpeed with fp16", stacklevel=3)

    def _make_reader(self, trainer: Any) -> ScalerReader | None:
        """The reader, made when training starts: after a checkpoint restored the scaler, and after
        DeepSpeed made its engine."""
        if self._deepspeed is not None:
            engine = getattr(self._deepspeed, "deepspeed_engine", None)
            if engine is None or not has_deepspeed_scaler(engine):
                self._warn_no_scaler(trainer)
                return None
            return ScalerReader(engine)
        if self._scaler is None:
            return None
        schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]
        return ScalerReader(self._scaler, followers=schedulers)

    # ---------------------------------------------------------------------------- training

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.ledger.on and self._scaler is not None:  # before the first epoch's loader iterator
            self.ledger.epoch_start(trainer, self._scaler)
        # After a checkpoint was restored: count steps from here.
        self._last_global_step = trainer.global_step
        self._read_at = trainer.global_step
        self.reader = self._make_reader(trainer)
        if self.reader is None:
            return
        # A stock GradScaler does not checkpoint its steps or skips: they are counted from here on.
        self.reader.count_from(trainer.global_step)
        # trainer.global_step counts attempted optimizer steps: with max_steps it decides when the run ends
        # (compared with the applied steps at each read; see _with_trainer_step).
        self._step_base = (trainer.global_step, *self.reader.progress())
        writer = bool(trainer.is_global_zero)
        self.loop.start(policy=self.reader.policy, writer=writer,
                        sinks=[logger_sink(lg, lambda: trainer.current_epoch) for lg in trainer.loggers]
                        if writer else [])
        self.loop.resume_at(trainer.global_step, self.reader.read if trainer.global_step > 0 else None)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.ledger.on and self._scaler is not None:
            self.ledger.epoch_start(trainer, self._scaler)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.ledger.on and self._scaler is not None:
            self.ledger.batch_start(trainer, self._scaler, batch, batch_idx)
        if self.check_alignment and not self._alignment_done:
            self._alignment_done = True
            self._run_alignment(trainer, pl_module, batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.reader is None:
            return
        if self.ledger.on and self._scaler is not None and not outputs and pl_module.automatic_optimization:
            self.ledger.batch_skipped(self._scaler)  # training_step returned None: no part of a step
        self._count_steps(trainer)
        if self._due(trainer):
            self._observe(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Several optimizer steps in one batch (manual optimization): the stock GradScaler's state
        # after the previous step is visible only until the next update.
        self._count_steps(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.reader is not None and self.every == "epoch":
            self._observe(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.reader is None:
            return
        last = self.loop.last
        lag = getattr(getattr(trainer.strategy, "precision_plugin", None), "lr_scheduler_lag", 0)
        note = (f"The LR schedulers were held on skipped steps: the schedule is {lag} scheduler step(s) "
                "behind the optimizer steps attempted." if lag else "")
        # One last read so the final values and the summary describe the whole run (host counts
        # say whether anything happened since the last read: no device read to find out).
        # (the trainer's step, the same on every rank: each rank reads, and gathers, alike)
        if last is None or self._read_at != trainer.global_step:
            self._observe(trainer)
        self.loop.finish(note=note)

    # ----------------------------------------------------------------------------- helpers

    def _count_steps(self, trainer: Any) -> None:
        """Host-side step count; a stock scaler's overflow is also counted here, on the device."""
        stepped = trainer.global_step - self._last_global_step
        if stepped > 0 and self.reader is not None:
            self._last_global_step = trainer.global_step
            self.reader.after_optimizer_step(stepped)

    def _due(self, trainer: Any) -> bool:
        step = trainer.global_step
        if self.every is None:
            return self.loop.due(step)
        if self.every == "epoch" or step == self._read_at:
            return False
        return _lightning_logs_now(trainer)

    def _observe(self, trainer: Any) -> Snapshot | None:
        assert self.reader is not None
        self._read_at = trainer.global_step
        # Lightning's own logging step: rows line up with the metrics of self.log.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        sink_step = getattr(epoch_loop, "_batches_that_stepped", None)
        state = self._with_trainer_step(self.reader.read(), trainer)
        snapshot = self.loop.observe(state, sink_step=sink_step, forensics=self.reader.read_forensics())
        if self.ledger.on and self._scaler is not None:
            self.ledger.read(self._scaler)
        metrics = {**snapshot.metrics(), **self.loop.outcome_metrics(), **self.loop.rank_metrics()}
        callback_metrics = trainer.callback_metrics
        for name, value in metrics.items():
            callback_metrics[name] = torch.tensor(value)
        if self.prog_bar:
            progress = trainer.progress_bar_metrics
            progress[SCALE] = metrics[SCALE]
            progress[SKIPPED_STEPS] = metrics[SKIPPED_STEPS]
        return snapshot

    def _with_trainer_step(self, state: Any, trainer: Any) -> Any:
        """The state read, with ``trainer.global_step`` among what follows the optimizer when it ends the
        run (``max_steps``): it counts skipped steps too, and the run applies that many fewer updates."""
        if getattr(trainer, "max_steps", -1) is None or trainer.max_steps <= 0:
            return state
        base = getattr(self, "_step_base", None)
        step = FollowerCount("Trainer.global_step", TRAINER_STEP, int(trainer.global_step), False,
                             "trainer.global_step", base)
        return carry(state, followers=[*getattr(state, "followers", ()), step])

    def _run_alignment(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        try:
            module = importlib.import_module("lossscale_callbacks.torch._alignment")
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
        self.loop.report_alignment(report.to_markdown())
