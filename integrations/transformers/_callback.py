"""``LossScaleTrainerCallback``: the loss scale in the logs that a Transformers ``Trainer`` reports."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import DefaultFlowCallback, Trainer, TrainerCallback

from lossscale_callbacks import LoggingLoop
from lossscale_callbacks.accelerate import install_loss_scaler
from lossscale_callbacks.integration import (
    TRAINER_STEP,
    FollowerCount,
    LoggingArgs,
    Policy,
    carry,
    check_bool,
    check_diagnose,
    check_ledger,
    check_policy,
    interval_args,
    logging_args,
)
from lossscale_callbacks.torch import LossScaler, ScalerReader
from lossscale_callbacks.torch.integration import check_replay, ledger_capture, loss_of_output, warn_no_scaler

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["LossScaleTrainerCallback"]

# The logs of Trainer.evaluate()/predict() (every key prefixed), which the Trainer also returns.
_EVALUATION_PREFIXES = ("eval_", "test_")
# A key of the Trainer's end-of-training log: the run's last read rides on it, whatever the interval.
_END_OF_TRAINING = "train_runtime"
# Where the counts a stock GradScaler does not checkpoint ride in trainer_state.json (not a callback's
# class name: Trainer(restore_callback_states_from_checkpoint=True) would rebuild such a callback).
COUNTS_KEY = "lossscale_callbacks"


def _above_progress_bars(text: str) -> None:
    """Print ``text`` on lines of its own: the Trainer's tqdm bar is still open at ``on_train_end``
    (its callback closes it after ours), and a plain print would continue the bar's line."""
    tqdm.write(text)


def _add_to_history(state: Any, logs: dict[str, Any], added: dict[str, Any]) -> None:
    """``added`` also into the ``log_history`` entry the Trainer made of ``logs``: it appends a copy
    before the callbacks run, and that copy is what ``trainer_state.json`` keeps."""
    history = getattr(state, "log_history", None)
    if history and history[-1].get("step") == state.global_step and set(logs) <= set(history[-1]):
        history[-1].update(added)


class LossScaleTrainerCallback(TrainerCallback):
    """Puts ``loss_scale/*`` into the Trainer's logs, so every ``report_to`` integration receives them.

    At each of the Trainer's log events at a new ``global_step`` (every ``logging_steps``, and at the
    end of training), or every ``log_every`` optimizer steps (the Trainer is asked to log then), the
    callback reads the Trainer's loss scaler once (never per step) and adds the metrics to the ``logs``
    that TensorBoard, W&B, MLflow... and the progress bar receive, at the Trainer's ``global_step`` like
    its loss (not the logs of ``evaluate()``, ``predict()``). The core's
    :class:`~lossscale_callbacks.LoggingLoop` runs the health rules and prints the summary on rank 0.

    The scaler read is the Trainer's (Accelerate's ``GradScaler``, whose skips are counted on the
    device) or, with ``policy``, ``diagnose`` or ``scaler`` given, the one :meth:`attach` installs
    with :func:`~lossscale_callbacks.accelerate.install_loss_scaler`, which also makes ``fp16=True``
    real on the CPU. The Trainer resumes the installed scaler from ``scaler.pt``, and the counts a
    stock one lacks from ``trainer_state.json``. Give the callback to the Trainer with :meth:`attach`,
    not ``callbacks=[...]``: the scaler must be installed before the Trainer prepares the model, and
    this callback must run before the ``report_to`` integrations log.

    Args:
        policy: install a ``LossScaler`` with this policy.
        diagnose: install a ``LossScaler`` with overflow forensics (``True`` or ``"every_step"``),
            naming the layers after the Trainer's model.
        scaler: install this scaler instead (a ``LossScaler`` or a ``torch.amp.GradScaler``).
        log_every: every this many optimizer steps (``state.global_step``), as for
            :class:`~lossscale_callbacks.LoggingLoop`: the Trainer is asked to log then, and its other
            log events carry no loss-scale metrics (but its end-of-training log); not with ``every``.
        every: ``"trainer"`` (the default when ``log_every`` is not given): at the Trainer's own log
            events (``logging_steps``).
        hold: hold the Trainer's LR scheduler on skipped steps (default ``True``; with our scaler,
            i.e. ``policy``/``diagnose``/``scaler=LossScaler(...)``): with its default fused optimizer,
            whose kernel skips where ``optimizer_step_was_skipped`` cannot see, the learning rate
            follows a device count, no host read. ``state.global_step`` still counts attempted steps
            (``max_steps`` ends the run): a run that skipped steps is flagged once.
        ledger: the ledger of bad steps (installs a ``LossScaler``; the "Which batch" page): ``True``
            writes it into ``output_dir``, a folder there; each bad step with the train sampler's indices
            (or ``ids``'s column). No host read is added to a step.
        replay: replay each bad step on the same weights and RNG state, at the same scale, the minimum
            and in float32: ``True`` (at most 4 per log interval) or the most per interval.
        ids: a column of the train dataset (a ``datasets`` index) naming the samples, read at the
            sampler's indices for the bad steps only.
        **logging: the shared logging arguments (``tensorboard=``, ``wandb=``, ``sinks=``,
            ``health=``, ``echo=``), handed to :class:`~lossscale_callbacks.LoggingLoop` as given (see
            its Args); ``health="stop"`` sets ``should_training_stop``; the default ``echo`` writes
            through tqdm, on lines of their own above the Trainer's progress bar.

    Attributes:
        installed: the scaler :meth:`attach` installed (``None`` when it reads the Trainer's own).
        loop: the :class:`~lossscale_callbacks.LoggingLoop` (its ``last`` snapshot, ``verdicts``).
        reader: the :class:`~lossscale_callbacks.torch.ScalerReader` of the Trainer's scaler
            (from the start of training; ``None`` when the Trainer has none).

    Raises:
        ValueError: an argument is invalid (named).
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra installed.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy
        >>> callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=2.0**12), diagnose=True)
        >>> callback.attach(trainer)  # doctest: +SKIP
        >>> trainer.train()           # doctest: +SKIP
    """

    def __init__(self, *, policy: Policy | None = None, diagnose: bool | str = False,
                 scaler: torch.amp.GradScaler | None = None, log_every: int | None = None,
                 every: str | None = None, hold: bool = True, ledger: Any = False,
                 replay: bool | int = False, ids: str | None = None, **logging: Unpack[LoggingArgs]) -> None:
        self.diagnose = check_diagnose(diagnose)
        self.hold = check_bool("hold", hold)
        log_every, self.every = interval_args("LossScaleTrainerCallback", log_every, every,
                                              allowed=("trainer",), default=(None, "trainer"))
        self.ledger = check_ledger(ledger)
        self.replay = check_replay(replay)
        if self.replay and not self.ledger:
            raise ValueError("replay needs the ledger: LossScaleTrainerCallback(ledger=True, replay=True)")
        if ids is not None and not isinstance(ids, str):
            raise ValueError(f"ids must be None or the name of the train dataset's id column, got {ids!r}")
        self.ids = ids
        self._batch_hook: Any = None
        if policy is not None:
            check_policy("policy", policy)
        self.policy = policy
        self._given_scaler = scaler
        self.installed: torch.amp.GradScaler | None = None
        # Every argument checked now (tensorboard=/wandb= need their extras now, not when training starts).
        logging = logging_args("LossScaleTrainerCallback", logging)
        if logging.get("echo", print) is print:  # the summary on lines of its own, above tqdm's bars
            logging["echo"] = _above_progress_bars
        self.loop = LoggingLoop(None, log_every=log_every, stop=self._request_stop, **logging)
        self.reader: ScalerReader | None = None
        self._trainer: weakref.ref[Trainer] | None = None
        self._read_at = 0
        self._asked_at = -1  # the step log_every asked the Trainer to log at
        self._stop_requested = False
        self._pending: Any = None  # a read made at on_step_end for the log that follows

    @property
    def summary(self) -> str | None:
        """The end-of-run summary, after training."""
        return self.loop.summary

    @property
    def installs(self) -> bool:
        """Whether :meth:`attach` installs a scaler (``policy``, ``diagnose`` or ``scaler`` given)."""
        return (self.policy is not None or bool(self.diagnose) or self._given_scaler is not None
                or bool(self.ledger))

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
            if self.diagnose or self.ledger:
                self.installed.watch(trainer.model)
            if self.ledger:
                self._track(trainer)
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        callbacks.insert(flow[-1] + 1 if flow else 0, self)
        self._trainer = weakref.ref(trainer)
        return self

    def _track(self, trainer: Trainer) -> None:
        """The ledger on the installed scaler: each training forward of the model is a received micro-batch
        (its inputs kept for replay); the sampler's indices name its samples."""
        model, scaler = trainer.model, self.installed
        folder = trainer.args.output_dir if self.ledger is True else self.ledger

        def loss(batch: dict[str, Any]) -> Any:
            # Accelerate wraps the prepared model's forward in its autocast: the replay calls the forward
            # it wrapped (kept as _original_forward), under the replay's own autocast (or none: float32).
            forward = getattr(model, "_original_forward", None) or model
            return loss_of_output(forward(**batch))

        scaler.track(None, ledger=folder, replay=self.replay, loss=loss if self.replay else None)
        capture = ledger_capture(scaler)
        capture.set_autocast(trainer.args.device.type, torch.float16)  # fp16=True: what an install needs
        if self.ids is not None:
            if self.ids not in getattr(trainer.train_dataset, "column_names", ()):
                raise ValueError(f"ids={self.ids!r}: the train dataset has no such column (a "
                                 "datasets.Dataset with an index column is needed)")
            capture.column = (trainer.train_dataset, self.ids)

        def received(module: Any, args: Any, kwargs: Any) -> None:
            if module.training and torch.is_grad_enabled() and not args and not capture.replaying:
                capture.on_batch(dict(kwargs))

        if self._batch_hook is not None:
            self._batch_hook.remove()
        self._batch_hook = model.register_forward_pre_hook(received, with_kwargs=True, prepend=True)

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
        scheduler = getattr(trainer, "lr_scheduler", None)
        if self.hold and isinstance(scaler, LossScaler) and scheduler is not None:
            if all(f.obj is not scheduler for f in scaler.held):
                scaler.hold(scheduler)  # a fused optimizer (the default adamw_torch_fused) included
        self.reader = ScalerReader(scaler, followers=[scheduler] if scheduler is not None else [])
        capture = ledger_capture(scaler) if self.ledger else None
        if capture is not None:
            capture.watch_sampler(trainer.callback_handler.train_dataloader)
        self.reader.count_from(state.global_step)  # a stock GradScaler checkpoints no count: from here
        # state.global_step counts attempted optimizer steps, and max_steps ends the run: a follower too.
        self._step_base = (state.global_step, *self.reader.progress())
        self._read_at = state.global_step
        self._asked_at = -1
        self._stop_requested = False
        self.loop.start(policy=self.reader.policy, writer=bool(state.is_world_process_zero))
        if state.global_step > 0:
            self._resume_counts(state)
        self.loop.resume_at(state.global_step, self.reader.read if state.global_step > 0 else None)

    def _with_global_step(self, read: Any, state: Any) -> Any:
        """The state read, with the Trainer's ``global_step`` among what follows the optimizer."""
        step = FollowerCount("Trainer.global_step", TRAINER_STEP, int(state.global_step), False,
                             "state.global_step", getattr(self, "_step_base", None))
        return carry(read, followers=[*getattr(read, "followers", ()), step])

    def _resume_counts(self, state: Any) -> None:
        """The counts saved with the checkpoint (a stock scaler keeps none); without them, a scaler that
        took over a checkpoint counts from the Trainer's step (the skips before it are not known)."""
        assert self.reader is not None
        saved = (state.stateful_callbacks or {}).get(COUNTS_KEY)
        if isinstance(saved, dict) and saved.get("steps") == state.global_step:
            self.reader.resume_counts(state.global_step, saved.get("skipped_steps"))
        else:
            self.reader.resume_counts(state.global_step, 0)

    def _save_counts(self, state: Any, control: Any) -> None:
        """Before the Trainer writes a checkpoint: the counts into ``trainer_state.json`` (one host read)."""
        if self.reader is not None and control.should_save:
            counts = self.reader.read(outcomes=False)  # the interval's outcomes stay for the next log
            state.stateful_callbacks[COUNTS_KEY] = {"steps": counts.steps,
                                                    "skipped_steps": counts.skipped_steps}

    def _warn_no_scaler(self, args: Any, state: Any) -> None:
        self.reader = None
        if not state.is_world_process_zero:
            return
        why = ("TrainingArguments(fp16=True) on the CPU: Accelerate makes no scaler and no autocast there, "
               "so this run trains in float32; LossScaleTrainerCallback(policy=...) installs a scaler and "
               "makes fp16 real" if args.fp16 else "no fp16 training (TrainingArguments(fp16=True))")
        warn_no_scaler("LossScaleTrainerCallback", why, stacklevel=2)

    def _request_stop(self) -> None:
        self._stop_requested = True

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reader is not None:
            self.reader.after_optimizer_step()  # a stock scaler's overflow, counted on the device

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # log_every asks the Trainer for a log event; the read itself happens in on_log.
        if self.reader is not None and self.every is None and self.loop.due(state.global_step):
            control.should_log = True
            self._asked_at = state.global_step
        if (self.reader is not None and control.should_log and state.global_step > self._read_at
                and (self.every is not None or state.global_step == self._asked_at)):
            # The interval's read now, before the Trainer logs its learning rate: the held scheduler's
            # get_last_lr() comes up to date with it (the same one read; on_log uses it).
            self._pending = (state.global_step, self._with_global_step(self.reader.read(), state))
        self._save_counts(state, control)  # after DefaultFlowCallback decided (attach puts us after it)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_counts(state, control)  # save_strategy="epoch"

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.reader is None or logs is None or state.global_step <= self._read_at:
            return
        if any(key.startswith(_EVALUATION_PREFIXES) for key in logs):
            return
        if self.every is None and state.global_step != self._asked_at and _END_OF_TRAINING not in logs:
            return  # a log event of the Trainer's own: log_every decides when the scaler is read
        self._read_at = state.global_step
        forensics = self.reader.read_forensics()
        pending, self._pending = self._pending, None
        read = pending[1] if pending is not None and pending[0] == state.global_step else None
        if read is None:
            read = self._with_global_step(self.reader.read(), state)
        snapshot = self.loop.observe(read, sink_step=state.global_step, forensics=forensics)
        added = {**snapshot.metrics(), **self.loop.outcome_metrics(), **self.loop.rank_metrics(),
                 **(forensics.metrics() if forensics is not None else {})}
        _add_to_history(state, logs, added)
        logs.update(added)
        if self._stop_requested:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reader is None or self.loop.summary is not None:
            return
        if state.global_step > self._read_at:
            # Steps after the last log event (none when the Trainer logged at its last step).
            self._read_at = state.global_step
            self.loop.observe(self._with_global_step(self.reader.read(), state), sink_step=state.global_step,
                              forensics=self.reader.read_forensics())
        # The ledger's words came with the reads. Prints the summary on the main process, closes the sinks
        # it opened.
        self.loop.finish()
