"""``AccelerateLossScaleMonitor``: the loss scale of a plain Accelerate loop on its trackers and our sinks."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from accelerate import Accelerator

from lossscale_callbacks._validation import check_bool, check_int
from lossscale_callbacks.accelerate.install import check_accelerator
from lossscale_callbacks.accelerate.reading import ScalerSource, open_sinks
from lossscale_callbacks.accelerate.trackers import TrackerSink
from lossscale_callbacks.health import HealthSpec
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.metrics import Snapshot
from lossscale_callbacks.sinks import GuardedSink, Sink
from lossscale_callbacks.torch.stock import StockScalerReader

__all__ = ["AccelerateLossScaleMonitor"]

_NO_SCALER = ("AccelerateLossScaleMonitor found no enabled loss scaler in the accelerator: on a GPU, "
              "Accelerator(mixed_precision='fp16') makes one; on the CPU Accelerate makes none (and trains "
              "in float32): call lossscale_callbacks.accelerate.install_loss_scaler(accelerator) before "
              "accelerator.prepare")


class AccelerateLossScaleMonitor:
    """Reads the accelerator's loss scaler once per interval; metrics to its trackers and our sinks.

    Works with the scaler that :func:`~lossscale_callbacks.accelerate.install_loss_scaler` put in
    (ours, read directly) and with Accelerate's own ``torch.amp.GradScaler`` (``mixed_precision=
    "fp16"`` on a GPU), whose skipped steps it counts on the device after each optimizer step. Call
    :meth:`step` after every ``optimizer.step()``; in an ``accelerator.accumulate`` loop the calls
    of the accumulation steps are not counted (``accelerator.sync_gradients`` is false there), so
    the count is the optimizer steps attempted, skipped ones included. The state is read from the
    device once every ``log_every`` of those (never per step) and once in :meth:`finish`, and runs
    through the core's :class:`~lossscale_callbacks.LoggingLoop`: metrics to the trackers (through
    ``accelerator.log``) and the sinks from the main process only, health rules on every process
    (each holds the same state, so a ``"stop"`` rule sets :attr:`should_stop` on all alike; break
    out of the loop when it is true), the summary printed at the end.

    To resume, register the monitor with ``accelerator.register_for_checkpointing(monitor)``:
    ``save_state``/``load_state`` then carry its step count (and a stock scaler's skipped steps,
    which ``GradScaler`` does not checkpoint), and the first interval after a resume counts only
    its own steps.

    Args:
        accelerator: the ``accelerate.Accelerator`` whose scaler is read.
        log_every: optimizer steps between reads (>= 1).
        health: the health rules (``None``/``False`` off, ``True``/``"warn"``/``"raise"``/``"stop"``
            for the default rules with that action, or rule objects).
        trackers: also write through ``accelerator.log`` to the trackers of ``init_trackers``.
        tensorboard: a log directory: also write to a
            :class:`~lossscale_callbacks.tensorboard.TensorBoardSink` there.
        wandb: True, or a dict of ``wandb.init`` arguments: also write to a
            :class:`~lossscale_callbacks.wandb.WandbSink` (the active run if there is one).
        sinks: more :class:`~lossscale_callbacks.sinks.Sink` objects.
        echo: prints the end-of-run summary on the main process (``None``: silent).

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

    def __init__(self, accelerator: Accelerator, *, log_every: int = 100, health: HealthSpec = "warn",
                 trackers: bool = True, tensorboard: str | os.PathLike[str] | None = None,
                 wandb: bool | Mapping[str, Any] | None = None, sinks: Iterable[Sink] = (),
                 echo: Any = print) -> None:
        check_accelerator(accelerator)
        check_int("log_every", log_every)
        check_bool("trackers", trackers)
        scaler = accelerator.scaler
        if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            raise ValueError(_NO_SCALER)
        all_sinks, self._owned = open_sinks(tensorboard, wandb, sinks)
        if trackers:
            all_sinks.insert(0, GuardedSink(TrackerSink(accelerator), name="Accelerate trackers"))
        self.accelerator = accelerator
        self.source = ScalerSource(scaler)
        self.should_stop = False
        self.summary: str | None = None
        self.loop = LoggingLoop(self.source.policy, sinks=all_sinks, health=health,
                                writer=bool(accelerator.is_main_process), every_steps=log_every,
                                stop=self._stop, echo=echo)

    def _stop(self) -> None:
        self.should_stop = True

    def step(self, log_step: int | None = None) -> Snapshot | None:
        """Call after each ``optimizer.step()``: counts the step, and reads the scaler when an interval ends.

        Args:
            log_step: the step the trackers and sinks write at (default: the optimizer steps
                attempted); pass the step your own ``accelerator.log`` calls use if it counts
                something else.

        Returns:
            The interval's :class:`~lossscale_callbacks.metrics.Snapshot` when it read the scaler
            (one host read), else ``None`` (no host read).
        """
        if log_step is not None:
            check_int("log_step", log_step, minimum=0)
        if not self.accelerator._optimizers:
            raise RuntimeError("monitor.step() counts optimizer steps: call it after optimizer.step() of an "
                               "optimizer returned by accelerator.prepare")
        if not self.accelerator.sync_gradients:
            return None  # an accumulation step: the prepared optimizer did not step
        self.source.after_optimizer_step()
        return self.loop.maybe_observe(self.source.steps, self.source.read, sink_step=log_step,
                                       read_forensics=self.source.read_forensics)

    def finish(self) -> str:
        """End of training: one last read, the summary (printed on the main process, returned everywhere).

        Closes the sinks made from ``tensorboard=``/``wandb=``; the trackers are Accelerate's to
        close (``accelerator.end_training()``).
        """
        self.summary = self.loop.finish(self.source.read())
        for sink in self._owned:
            GuardedSink(sink).close()
        return self.summary

    # -------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, int]:
        """The step count (and a stock scaler's skipped steps), for ``register_for_checkpointing``. One host
        read with a stock scaler."""
        if self.source.stock is not None:
            return self.source.stock.state_dict()
        return {"steps": self.source.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: checked whole before anything changes.

        ``accelerator.load_state`` loads the scaler before the registered objects, so our scaler's
        own step count is already restored here and must agree with the saved one.

        Raises:
            ValueError: not a state of this monitor's kind of scaler, or one that disagrees with the scaler.
        """
        keys = {"steps", "skipped_steps"} if self.source.stock is not None else {"steps"}
        if not isinstance(state, Mapping) or set(state) != keys:
            raise ValueError(f"state: expected the keys {sorted(keys)} of this monitor's state_dict() (saved "
                             f"with {'a stock GradScaler' if self.source.stock else 'a LossScaler'}), got "
                             f"{state!r}")
        steps = check_int("state['steps']", state["steps"], minimum=0, maximum=2**62)
        if self.source.stock is not None:
            StockScalerReader.check_state(dict(state))
            self.source.stock.load_state_dict(dict(state))
            self.source.steps = steps
        elif (restored := self.source.scaler.get_state().steps) != steps:
            raise ValueError(f"state: the checkpoint says {steps} optimizer steps, but the scaler restored "
                             f"with it says {restored}; load the monitor with the scaler saved with it "
                             "(accelerator.load_state restores both)")
        if steps:
            # One read now, not a step: the first interval after resuming covers only its own steps.
            self.loop.baseline(self.source.read())
