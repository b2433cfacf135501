"""``LossScaleTrainerCallback``: the loss scale in the logs that a Transformers ``Trainer`` reports."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from transformers import DefaultFlowCallback, Trainer, TrainerCallback

from lossscale_callbacks.accelerate.install import install_loss_scaler
from lossscale_callbacks.forensics import check_diagnose
from lossscale_callbacks.health import HealthSpec
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.policy import Policy, check_policy
from lossscale_callbacks.sinks import Sink
from lossscale_callbacks.torch.reader import ScalerReader

__all__ = ["LossScaleTrainerCallback"]

# The logs of Trainer.evaluate()/predict() (every key prefixed), which the Trainer also returns.
_EVALUATION_PREFIXES = ("eval_", "test_")


class LossScaleTrainerCallback(TrainerCallback):
    """Puts ``loss_scale/*`` into the Trainer's logs, so every ``report_to`` integration receives them.

    At each of the Trainer's log events (every ``logging_steps``, and at the end of training) at
    a new ``global_step``, the callback reads the Trainer's loss scaler once (never per step) and
    adds the metric schema (``loss_scale/scale``, ``loss_scale/log2_scale``,
    ``loss_scale/growth_counter``, ``loss_scale/skipped_steps``, ``loss_scale/skipped_in_interval``,
    ``loss_scale/skip_rate``, and ``loss_scale/steps``, the optimizer steps attempted) to the
    ``logs`` that TensorBoard, W&B, MLflow... and the progress bar receive. They are written at the
    Trainer's own ``global_step``, like its loss (TensorBoard and W&B prefix them with ``train/``).
    The logs of ``evaluate()`` and ``predict()`` are left alone. The core's
    :class:`~lossscale_callbacks.LoggingLoop` runs the health rules on every process (a ``"stop"``
    rule sets ``should_training_stop``) and prints the end-of-run summary with its health verdict
    on the main process.

    The scaler read is the Trainer's: Accelerate's ``GradScaler`` (``fp16=True`` on a GPU), whose
    skipped steps are counted on the device after each optimizer step, or the scaler this callback
    installed. With ``policy``, ``diagnose`` or ``scaler`` given, :meth:`attach` installs it with
    :func:`~lossscale_callbacks.accelerate.install_loss_scaler` (a
    :class:`~lossscale_callbacks.torch.LossScaler` with that policy and forensics, or the scaler
    given), which also makes ``fp16=True`` real on the CPU: there Accelerate makes no scaler and no
    autocast, and the Trainer trains in float32 without a word. The Trainer saves and resumes the
    installed scaler in its checkpoints (``scaler.pt``). (The Trainer holds its LR scheduler on a
    skipped step only when Accelerate sees the skip: a fused optimizer, the default
    ``adamw_torch_fused``, skips on the device, and the scheduler advances there, with either scaler.)

    Give the callback to the Trainer with :meth:`attach` (not ``callbacks=[...]``): installing a
    scaler must happen before the Trainer prepares the model, and the Trainer calls callbacks in
    order and puts those of ``callbacks=`` after its ``report_to`` integrations, which would then
    log before the scale is in the logs; ``attach`` puts this callback right after the Trainer's
    ``DefaultFlowCallback``.

    Args:
        policy: install a ``LossScaler`` with this policy.
        diagnose: install a ``LossScaler`` with overflow forensics (``True`` or ``"every_step"``),
            naming the layers after the Trainer's model; each read then also logs the skip causes,
            and the summary says which layer overflowed and why.
        scaler: install this scaler instead (a ``LossScaler`` or a ``torch.amp.GradScaler``).
        log_every: also ask the Trainer to log every ``log_every`` optimizer steps (``None``: its
            ``logging_steps`` alone decide).
        health: the health rules (``None``/``False`` off, ``True``/``"warn"``/``"raise"``/``"stop"``
            for the default rules with that action, or rule objects).
        tensorboard: a log directory: also write to a
            :class:`~lossscale_callbacks.tensorboard.TensorBoardSink` there (with the reports:
            policy, forensics, summary).
        wandb: True, or a dict of ``wandb.init`` arguments: also write to a
            :class:`~lossscale_callbacks.wandb.WandbSink`.
        sinks: more :class:`~lossscale_callbacks.sinks.Sink` objects.
        echo: prints the summary on the main process (``None``: silent).

    Attributes:
        installed: the scaler :meth:`attach` installed (``None`` when it reads the Trainer's own).
        loop: the :class:`~lossscale_callbacks.LoggingLoop` (its ``last`` snapshot, ``verdicts``).
        reader: the :class:`~lossscale_callbacks.torch.reader.ScalerReader` of the Trainer's scaler
            (from the start of training; ``None`` when the Trainer has none).

    Example:
        >>> from lossscale_callbacks.policy import DynamicPolicy
        >>> callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=2.0**12), diagnose=True)
        >>> callback.attach(trainer)  # doctest: +SKIP
        >>> trainer.train()           # doctest: +SKIP
    """

    def __init__(self, *, policy: Policy | None = None, diagnose: bool | str = False,
                 scaler: torch.amp.GradScaler | None = None, log_every: int | None = None,
                 health: HealthSpec = "warn", tensorboard: str | os.PathLike[str] | None = None,
                 wandb: bool | Mapping[str, Any] | None = None, sinks: Iterable[Sink] = (),
                 echo: Any = print) -> None:
        self.diagnose = check_diagnose(diagnose)
        if policy is not None:
            check_policy("policy", policy)
        self.policy = policy
        self._given_scaler = scaler
        self.installed: torch.amp.GradScaler | None = None
        # Every argument checked now (tensorboard=/wandb= need their extras now, not when training starts).
        self.loop = LoggingLoop(None, log_every=log_every, tensorboard=tensorboard, wandb=wandb, sinks=sinks,
                                health=health, stop=self._request_stop, echo=echo)
        self.reader: ScalerReader | None = None
        self._trainer: weakref.ref[Trainer] | None = None
        self._read_at = 0
        self._stop_requested = False

    @property
    def summary(self) -> str | None:
        """The end-of-run summary, after training."""
        return self.loop.summary

    @property
    def installs(self) -> bool:
        """Whether :meth:`attach` installs a scaler (``policy``, ``diagnose`` or ``scaler`` given)."""
        return self.policy is not None or bool(self.diagnose) or self._given_scaler is not None

    def attach(self, trainer: Trainer) -> LossScaleTrainerCallback:
        """Add this callback to ``trainer`` (before ``trainer.train()``), installing the scaler if asked.

        Returns:
            The callback.

        Raises:
            ValueError: not a ``Trainer``; installing without ``TrainingArguments(fp16=True)``; a
                bad ``policy``/``scaler`` (see ``install_loss_scaler``); attached to another Trainer.
            RuntimeError: installing after the Trainer prepared its model (``train()`` ran).
        """
        if not isinstance(trainer, Trainer):
            raise ValueError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        attached = self._trainer() if self._trainer is not None else None
        if attached is not None and attached is not trainer:
            raise ValueError("this LossScaleTrainerCallback is attached to another Trainer; make one per "
                             "Trainer")
        if self.installs:
            if not trainer.args.fp16:
                raise ValueError("LossScaleTrainerCallback(policy=/diagnose=/scaler=) installs a float16 "
                                 "loss scaler: it needs TrainingArguments(fp16=True)")
            self.installed = install_loss_scaler(trainer.accelerator, self._given_scaler, policy=self.policy,
                                                 diagnose=self.diagnose)
            if self.diagnose:
                self.installed.watch(trainer.model)
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        callbacks.insert(flow[-1] + 1 if flow else 0, self)
        self._trainer = weakref.ref(trainer)
        return self

    # ------------------------------------------------------------------------------ training

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            raise RuntimeError("LossScaleTrainerCallback was given to the Trainer without attach(): use "
                               "LossScaleTrainerCallback(...).attach(trainer) instead of callbacks=[...]")
        scaler = trainer.accelerator.scaler
        if self.installs and scaler is not self.installed:
            raise RuntimeError("the Trainer replaced its Accelerator (and the scaler installed in it) after "
                               "attach(); attach the callback again after that")
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            self._warn_no_scaler(args, state)
            return
        self.reader = ScalerReader(scaler)
        self.reader.count_from(state.global_step)  # a stock GradScaler checkpoints no count: from here
        self._read_at = state.global_step
        self._stop_requested = False
        self.loop.start(policy=self.reader.policy, writer=bool(state.is_world_process_zero))
        self.loop.restart_interval(state.global_step)
        if state.global_step > 0:
            # Resumed: one read now (not a step), so the first interval covers only its own steps.
            self.loop.baseline(self.reader.read())

    def _warn_no_scaler(self, args: Any, state: Any) -> None:
        self.reader = None
        if not state.is_world_process_zero:
            return
        why = ("TrainingArguments(fp16=True) on the CPU: Accelerate makes no scaler and no autocast there, "
               "so this run trains in float32; LossScaleTrainerCallback(policy=...) installs a scaler and "
               "makes fp16 real" if args.fp16 else "no fp16 training (TrainingArguments(fp16=True))")
        warnings.warn(f"[lossscale-callbacks] LossScaleTrainerCallback found no loss scaler: {why}. "
                      "Nothing will be logged.", UserWarning, stacklevel=2)

    def _request_stop(self) -> None:
        self._stop_requested = True

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reader is not None:
            self.reader.after_optimizer_step()  # a stock scaler's overflow, counted on the device

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # log_every asks the Trainer for a log event; the read itself happens in on_log.
        if self.reader is not None and self.loop.log_every is not None and self.loop.due(state.global_step):
            control.should_log = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.reader is None or logs is None or state.global_step <= self._read_at:
            return
        if any(key.startswith(_EVALUATION_PREFIXES) for key in logs):
            return
        self._read_at = state.global_step
        forensics = self.reader.read_forensics()
        snapshot = self.loop.observe(self.reader.read(), sink_step=state.global_step, forensics=forensics)
        metrics = {**snapshot.metrics(), **self.loop.rank_metrics(),
                   **(forensics.metrics() if forensics is not None else {})}
        logs.update(metrics)
        # The Trainer keeps a copy of these logs in its history, which Ray's RayTrainReportCallback
        # reports (and trainer_state.json saves): ours go there too.
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(metrics)
        if self._stop_requested:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reader is None or self.loop.summary is not None:
            return
        if state.global_step > self._read_at:
            # Steps after the last log event (none when the Trainer logged at its last step).
            self._read_at = state.global_step
            self.loop.observe(self.reader.read(), sink_step=state.global_step,
                              forensics=self.reader.read_forensics())
        self.loop.finish()  # prints the summary on the main process, closes the sinks it opened
