"""``AccelerateLossScaleMonitor``: the loss scale of a plain Accelerate loop on its trackers (through a
sink that writes ``accelerator.log``) and our sinks."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator

from lossscale_callbacks import LossScaleState
from lossscale_callbacks.accelerate._install import check_accelerator
from lossscale_callbacks.integration import (
    GuardedSink,
    LoggingArgs,
    Snapshot,
    check_bool,
    check_int,
    logging_args,
    observed_state,
)
from lossscale_callbacks.torch.integration import ScalerStepMonitor, ledger_capture

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["COUNTS_FILE", "AccelerateLossScaleMonitor", "TrackerSink"]

# Written by save_state beside Accelerate's own files: a loop without the monitor never opens it.
COUNTS_FILE = "loss_scale_counts.json"


# ----------------------------------------
# The trackers of an ``Accelerator`` as one sink: everything goes through ``accelerator.log``.
#
# ``accelerator.log(values, step=...)`` hands the values to every tracker the program started with
# ``Accelerator(log_with=...)`` and ``init_trackers`` (TensorBoard, W&B, MLflow, Comet, Aim,
# ClearML, DVCLive, ...), on the main process only. Its documented value types are numbers and
# strings, so the metrics go as numbers and the reports (the policy, the overflow forensics, the
# end-of-run summary) as markdown strings, which the TensorBoard tracker writes to its Text tab and
# the others log as text or skip with their own warning.


class TrackerSink:
    """Writes metrics and reports with ``accelerator.log`` (all its trackers, main process only).

    The step given to ``accelerator.log`` is the step the logging loop writes at: the optimizer
    steps attempted, or the ``log_step`` handed to the monitor (use the step your own
    ``accelerator.log`` calls use: W&B drops rows whose step goes backwards). Reports go at the
    step of the last metrics. The trackers are Accelerate's to close
    (``accelerator.end_training()``).

    Args:
        accelerator: the ``accelerate.Accelerator`` whose trackers receive the values.

    Example:
        >>> class Recording:  # stands in for an Accelerator
        ...     def log(self, values, step=None):
        ...         print(step, values)
        >>> sink = TrackerSink(Recording())
        >>> sink.write(10, {"loss_scale/scale": 1024.0})
        10 {'loss_scale/scale': 1024.0}
        >>> sink.write_text("loss_scale/summary", "all fine")
        10 {'loss_scale/summary': 'all fine'}
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._step = 0

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._step = int(step)
        self.accelerator.log(dict(metrics), step=self._step)

    def write_text(self, tag: str, markdown: str) -> None:
        self.accelerator.log({tag: markdown}, step=self._step)

    def flush(self) -> None:
        """Accelerate's trackers write (or hand off) each ``log`` call themselves."""

    def close(self) -> None:
        """Accelerate closes its trackers in ``accelerator.end_training()``."""


_NO_SCALER = ("AccelerateLossScaleMonitor found no enabled loss scaler in the accelerator: on a GPU, "
              "Accelerator(mixed_precision='fp16') makes one; on the CPU Accelerate makes none (and trains "
              "in float32): call lossscale_callbacks.accelerate.install_loss_scaler(accelerator) before "
              "accelerator.prepare")


class AccelerateLossScaleMonitor(ScalerStepMonitor):
    """Reads the accelerator's loss scaler once per interval; metrics to its trackers and our sinks.

    Works with the scaler that :func:`~lossscale_callbacks.accelerate.install_loss_scaler` put in
    (ours) and with Accelerate's own ``torch.amp.GradScaler`` (``mixed_precision="fp16"`` on a GPU),
    whose skipped steps it counts on the device after each optimizer step; both are read through
    :class:`~lossscale_callbacks.torch.ScalerReader`, whose step count is the scaler's. Call
    :meth:`step` after every ``optimizer.step()``; in an ``accelerator.accumulate`` loop the calls
    of the accumulation steps are not counted (``accelerator.sync_gradients`` is false there), so
    the count is the optimizer steps attempted, skipped ones included. The state is read from the
    device once every ``log_every`` of those (never per step) and once in :meth:`finish`, and runs
    through the core's :class:`~lossscale_callbacks.LoggingLoop`: metrics to the trackers (through
    ``accelerator.log``) and the sinks from the main process only, health rules on every process
    (each holds the same state, so a ``"stop"`` rule sets :attr:`should_stop` on all alike; break
    out of the loop when it is true), the summary printed at the end.

    To resume, nothing more is needed: the monitor hooks into ``accelerator.save_state``/``load_state``,
    which then also carry ``loss_scale_counts.json`` (checked on loading), and a loop without the
    monitor loads such a checkpoint as well. Do not register it with ``register_for_checkpointing``.
    :meth:`finish` closes only the sinks made from ``tensorboard=``/``wandb=``; the trackers are
    Accelerate's to close.

    Args:
        accelerator: the ``accelerate.Accelerator`` whose scaler is read.
        log_every: optimizer steps between reads (>= 1).
        **logging: the logging arguments, handed to the :class:`~lossscale_callbacks.LoggingLoop`
            as given (``tensorboard=``, ``wandb=``, ``sinks=``, ``health=``, ``echo=``; see its
            Args); the summary is printed on the main process.
        trackers: also write through ``accelerator.log`` to the trackers of ``init_trackers``.

    Raises:
        ValueError: a bad argument (naming it), or an accelerator without an enabled scaler.

    Example:
        >>> from accelerate import Accelerator
        >>> from lossscale_callbacks.accelerate import install_loss_scaler
        >>> accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        >>> _ = install_loss_scaler(accelerator)
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = accelerator.prepare(model, optimizer)
        >>> monitor = AccelerateLossScaleMonitor(accelerator, log_every=2, echo=None)
        >>> for _ in range(4):
        ...     accelerator.backward(model(torch.ones(2, 4)).sum())
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        ...     snapshot = monitor.step()
        >>> # 65536 overflows these float16 gradients twice; the scale backs off to 16384
        >>> snapshot.step, snapshot.scale, snapshot.skipped_steps
        (4, 16384.0, 2)
        >>> monitor.finish().splitlines()[0]  # doctest: +ELLIPSIS
        'Loss scaling: 4 optimizer steps, 2 skipped (50.00%) for Inf/NaN gradients; final loss scale 16384...'
    """

    _FIRST_STEP_NEEDS = "once accelerator.backward(loss) ran"

    def __init__(self, accelerator: Accelerator, *, log_every: int = 100, trackers: bool = True,
                 **logging: Unpack[LoggingArgs]) -> None:
        check_accelerator(accelerator)
        check_bool("trackers", trackers)
        scaler = accelerator.scaler
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            raise ValueError(_NO_SCALER)
        self.accelerator = accelerator
        # Accelerate's trackers join the run like a trainer's loggers: written and flushed, never
        # closed by the loop (accelerator.end_training() closes them).
        super().__init__(scaler, log_every=log_every, writer=bool(accelerator.is_main_process),
                         followers=list(getattr(accelerator, "_schedulers", ())),
                         **logging_args("AccelerateLossScaleMonitor", logging),
                         run_sinks=[GuardedSink(TrackerSink(accelerator), name="Accelerate trackers")]
                         if trackers else [])
        self._resumed: LossScaleState | None = None  # read by load_state, baselined at the next step
        accelerator.register_save_state_pre_hook(self._save_counts)
        accelerator.register_load_state_pre_hook(self._load_counts)

    def _save_counts(self, models: Any, weights: Any, output_dir: str) -> None:
        """``save_state``: the state read now into ``loss_scale_counts.json`` (the main process writes)."""
        state = self.reader.read()  # on every process: a collective-free host read of its own scaler
        if self.accelerator.is_main_process:
            with open(os.path.join(output_dir, COUNTS_FILE), "w") as file:
                json.dump(state._asdict(), file)

    def _load_counts(self, models: Any, input_dir: str) -> None:
        """``load_state`` (before it loads the scaler): the saved counts, if the checkpoint has them."""
        path = os.path.join(input_dir, COUNTS_FILE)
        if not os.path.isfile(path):
            return
        try:
            with open(path) as file:
                state = observed_state(json.load(file))
        except (ValueError, TypeError) as error:  # json's errors are ValueErrors
            raise ValueError(f"{path}: not the counts this monitor saves: {error}") from error
        self.reader.resume_counts(state.steps, state.skipped_steps, loading=True)
        self._resumed = state

    def track(self, loader: Any, *, ledger: Any = True, replay: bool | int = False, loss: Any = None,
              ids: str | None = None, model: Any = None) -> Any:
        """The ledger of bad steps on this loop (the shared step monitor's ``track``, as on Fabric):
        ``loader`` is the prepared one, ``model`` the prepared model. ``loss`` may call the prepared model
        as the loop does: during a replay its forward is the one Accelerate wrapped in its autocast (kept
        as ``_original_forward``), so that the replay sets the precision (its float32 pass runs with
        autocast off); the run's forward is put back after each replay call."""
        if loss is not None and model is not None:
            loss = _replayed_without_autocast(model, loss)
        tracked = super().track(loader, ledger=ledger, replay=replay, loss=loss, ids=ids, model=model)
        capture = ledger_capture(self.scaler)
        if capture is not None:  # the step's autocast is the one prepare() put inside the forward: fp16
            capture.set_autocast(self.accelerator.device.type, torch.float16)
        return tracked

    def step(self, log_step: int | None = None) -> Snapshot | None:
        """Call after each ``optimizer.step()``: counts the step, and reads the scaler when an interval ends.

        Args:
            log_step: the step the trackers and sinks write at (default: the optimizer steps
                attempted); pass the step your own ``accelerator.log`` calls use if it counts
                something else.

        Returns:
            The interval's :class:`~lossscale_callbacks.extend.Snapshot` when it read the scaler
            (one host read), else ``None`` (no host read).

        Raises:
            RuntimeError: the scaler has not scaled a loss yet, so no optimizer step was taken.
        """
        if log_step is not None:
            check_int("log_step", log_step, minimum=0)
        if self._resumed is not None:  # the scaler is loaded by now: judge by its policy, from the save
            resumed, self._resumed = self._resumed, None
            self.loop.set_policy(self.reader.policy)
            self._ticks = resumed.steps  # the steps counted on from the save, on every rank alike
            self.loop.resume_at(resumed.steps, lambda: resumed)
        if self.reader.started and not self.accelerator.sync_gradients:
            return None  # an accumulation step: the prepared optimizer did not step
        return self._count_step(log_step)


def _replayed_without_autocast(model: Any, loss: Any) -> Any:
    """``loss`` run with the prepared module's own forward (without the autocast of ``prepare``)."""
    inner = getattr(model, "module", model)  # under DDP the wrapped module holds the patched forward
    original = inner.__dict__.get("_original_forward") if hasattr(inner, "__dict__") else None
    if original is None:
        return loss

    def replay_loss(batch: Any) -> Any:
        patched = inner.__dict__.get("forward")
        inner.forward = original
        try:
            return loss(batch)
        finally:
            if patched is None:
                del inner.forward
            else:
                inner.forward = patched

    return replay_loss
