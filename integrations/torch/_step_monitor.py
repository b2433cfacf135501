"""``ScalerStepMonitor``: what a monitor of a hand-written torch loop does, written once.

The Accelerate and Fabric monitors differ only in where they find the scaler, which of the
framework's loggers join the run, and when a call counts as an optimizer step. Reading the scaler
(through :class:`~lossscale_callbacks.torch.ScalerReader`), the interval, the health rules
and ``should_stop``, the checkpoint and the summary are this class's, so both behave alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from lossscale_callbacks import LoggingLoop, Sink
from lossscale_callbacks.integration import LoggingArgs, Snapshot, interval_args, logging_args
from lossscale_callbacks.torch._reader import ScalerReader

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["ScalerStepMonitor"]


class ScalerStepMonitor:
    """Reads a torch loss scaler once per interval of optimizer steps, through the core's logging loop.

    A subclass finds the scaler and the framework's sinks and calls this ``__init__``; its
    ``step()`` calls :meth:`_count_step` after each optimizer step. The state is read from the
    device only when an interval ends (and in :meth:`finish`); metrics go to the sinks from the
    writer process only, the health rules run on every process, and a ``"stop"`` rule sets
    :attr:`should_stop` on all alike (break out of the loop when it is true).

    Args:
        scaler: what :class:`~lossscale_callbacks.torch.ScalerReader` reads.
        log_every: optimizer steps between reads (>= 1).
        **logging: the logging arguments, handed to the :class:`~lossscale_callbacks.LoggingLoop`
            as given (``tensorboard=``, ``wandb=``, ``sinks=``, ``health=``, ``echo=``; see its
            Args);
        writer: whether this process writes to the sinks and prints.
        run_sinks: the framework's loggers or trackers, written and flushed, never closed here.
        followers: the LR schedulers and EMAs the framework knows (the reader also finds the others).

    Example:
        >>> import torch
        >>> from lossscale_callbacks import InMemorySink
        >>> from lossscale_callbacks.torch import LossScaler
        >>> class Monitor(ScalerStepMonitor):
        ...     def step(self):
        ...         return self._count_step()
        >>> scaler, memory = LossScaler(device="cpu"), InMemorySink()
        >>> monitor = Monitor(scaler, log_every=1, sinks=[memory], writer=True, echo=None)
        >>> weight = torch.ones(2, requires_grad=True)
        >>> optimizer = torch.optim.SGD([weight], lr=0.1)
        >>> scaler.scale(weight.sum()).backward(); scaler.step(optimizer); scaler.update()
        >>> monitor.step().scale, memory.series("loss_scale/steps")
        (65536.0, [(1, 1.0)])
    """

    # What must have happened before the first step() (the framework's words), for its error.
    _FIRST_STEP_NEEDS = "once the loss was scaled and backpropagated"

    def __init__(self, scaler: Any, *, log_every: int = 100, writer: bool = True,
                 run_sinks: Iterable[Sink] = (), followers: Iterable[Any] = (),
                 **logging: Unpack[LoggingArgs]) -> None:
        log_every, _ = interval_args(type(self).__name__, log_every, None)  # no interval but the count
        self.reader = ScalerReader(scaler, followers=followers)
        self._tensorboard = logging.get("tensorboard")
        self.loop = LoggingLoop(self.reader.policy, log_every=log_every, writer=writer,
                                **logging_args(type(self).__name__, logging))
        self.loop.start(sinks=run_sinks)
        # The count intervals end on: the same on every rank (rank 0's steps at each gathered read),
        # so all ranks read, and gather, at the same calls even when their scalers' counts differ.
        self._ticks = self.reader.steps
        self.loop.restart_interval(self._ticks)

    @property
    def scaler(self) -> Any:
        """The loss scaler read."""
        return self.reader.scaler

    @property
    def summary(self) -> str | None:
        """The end-of-run summary (after :meth:`finish`)."""
        return self.loop.summary

    def hold(self, follower: Any, *, optimizer: Any = None) -> Any:
        """Hold an LR scheduler or an EMA (``AveragedModel``) on skipped steps: ``LossScaler.hold`` of the
        scaler read (ours); returns ``follower``. Keep stepping it as before.

        Raises:
            ValueError: the scaler is a stock one (only ours holds: what advanced on skipped steps is
                flagged instead), or what ``LossScaler.hold`` refuses.
        """
        hold = getattr(self.scaler, "hold", None)
        if hold is None:
            raise ValueError(f"{type(self).__name__}.hold needs the lossscale-callbacks scaler (LossScaler); "
                             f"this run's is a {type(self.scaler).__name__}: a scheduler or an EMA that "
                             "advances on skipped steps is flagged at the log interval instead")
        hold(follower, optimizer=optimizer)
        if self.reader.followers is not None:
            self.reader.followers.add([follower])
        return follower

    @property
    def should_stop(self) -> bool:
        """Whether a ``"stop"`` health rule fired (on every process alike): break out of the loop then."""
        return self.loop.should_stop

    def _count_step(self, log_step: int | None = None) -> Snapshot | None:
        """Count one optimizer step; read the scaler when an interval ends (else no host read)."""
        if not self.reader.started:  # host-side: no device read
            raise RuntimeError(
                f"{type(self).__name__}.step() counts an optimizer step, but the loss scaler has not "
                f"scaled any loss yet: call it after optimizer.step(), {self._FIRST_STEP_NEEDS}")
        self.reader.after_optimizer_step()  # device ops only for a stock scaler, no host read
        self._ticks += 1
        return self.loop.maybe_observe(self._ticks, self._read, sink_step=log_step,
                                       read_forensics=self.reader.read_forensics)

    def track(self, loader: Any, *, ledger: Any = True, replay: bool | int = False, loss: Any = None,
              ids: str | None = None, model: Any = None) -> Any:
        """The ledger of bad steps on this loop (our ``LossScaler`` only): ``loader`` comes back yielding
        the same batches, its sampler's indices recorded on the host; the bad steps are written at each
        interval's read (``bad_steps.rank<r>.jsonl`` beside the dashboards: ``tensorboard=``, else
        ``ledger``'s folder), and told in the summary. ``replay``, ``loss`` and ``ids`` as in
        :meth:`LossScaler.track`; ``model`` is the model whose gradients a replay checks (else the
        scaler's watched one).

        Raises:
            ValueError: a stock scaler (no ledger), or a bad argument.
        """
        scaler = self.reader.scaler
        if self.reader.kind != "ours":
            raise ValueError("the ledger of bad steps needs the lossscale-callbacks scaler (its outcomes and "
                             "replay): a stock GradScaler has neither")
        if model is not None:
            scaler.watch(model)
        folder = (self._tensorboard or None) if ledger is True else (ledger or None)
        return scaler.track(loader, ledger=folder, replay=replay, loss=loss, ids=ids)

    def _read(self) -> Any:
        """The interval's read (every rank's state too, under torch.distributed); re-bases the count."""
        state = self.reader.read()  # with the skip truth's outcomes: the ledger takes its bad steps there
        ranks = getattr(state, "ranks", None)
        self._ticks = ranks.rows[0][3] if ranks is not None else int(state.steps)
        return state

    def finish(self) -> str:
        """End of training: one last read, the summary (printed on the writer, returned everywhere).

        Closes the sinks made from ``tensorboard=``/``wandb=``; the framework's loggers are its own
        to close.
        """
        return self.loop.finish(self._read())  # the ledger's words come with the read, as every read's

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the step count (and a stock scaler's skipped steps, which
        ``GradScaler`` does not keep). One host read."""
        return self.reader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`, checked whole (the core's state gate) before anything changes.

        A ``steps`` that disagrees with the scaler's, or a state saved with the other kind of
        scaler, is refused. The logging loop then judges against the loaded policy, from the loaded
        step on, and the first interval after the resume counts only its own steps.

        Raises:
            ValueError: naming the key or field; nothing was loaded.
        """
        self.reader.load_state_dict(state)
        self.loop.set_policy(self.reader.policy)
        self.loop.baseline(self._read())  # one read now, not a step (and the ranks compared); it
        self.loop.restart_interval(self._ticks)  # re-bases the tick count, so the interval comes after
