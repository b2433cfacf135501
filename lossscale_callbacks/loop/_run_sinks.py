"""The sinks of the logging loop's runs: which are open, who owns them, which process writes.

The loop *owns* the sinks it opens from ``tensorboard=``/``wandb=`` and named ``sinks={name: value}``:
each run makes its own at its first write (on the writer only) and :meth:`RunSinks.close_owned` closes
them at the run's end. The caller's ``sinks=[...]`` are written and flushed, closed only by
:meth:`RunSinks.close`; a run's own sinks (a trainer's loggers) join that run only. :attr:`RunSinks.out`
is what the loop writes to: the run's sinks on the writer (global rank 0 unless told), nothing elsewhere.

Example:
    >>> from lossscale_callbacks import InMemorySink
    >>> memory = InMemorySink()
    >>> sinks = RunSinks(None, None, [memory], writer=True)
    >>> sinks.out.write(10, {"loss_scale/scale": 2.0})
    >>> memory.series("loss_scale/scale")
    [(10, 2.0)]
    >>> RunSinks(None, None, [memory], writer=False).out.write(20, {"loss_scale/scale": 4.0})
    >>> memory.series("loss_scale/scale")  # another rank writes nothing
    [(10, 2.0)]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lossscale_callbacks._ranks import is_rank_zero
from lossscale_callbacks._sinks import (
    GuardedSink,
    Sink,
    SinkGroup,
    check_tensorboard,
    check_wandb,
    named_sinks,
    owned_sinks,
)
from lossscale_callbacks._validation import check_bool

__all__ = ["RunSinks"]

_SILENT = SinkGroup()  # what a process that does not write writes to


class RunSinks:
    """The sinks of the current run and of the loop's life (see the module).

    Args:
        tensorboard, wandb, sinks, writer: as for :class:`~lossscale_callbacks.LoggingLoop` (checked here).

    Raises:
        ValueError: an argument is invalid, naming it.
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra.
    """

    def __init__(self, tensorboard: Any, wandb: Any, sinks: Iterable[Sink] | Mapping[str, Any] = (),
                 writer: bool | None = None) -> None:
        self._writer = None if writer is None else check_bool("writer", writer)
        self.user, self.named = named_sinks(sinks)
        self._tensorboard, self._wandb = check_tensorboard(tensorboard), check_wandb(wandb)
        # Made once here to check them and their extras; each run makes its own at its first write,
        # so an unstarted loop holds no file or run (a Trainer pickles its callbacks for ddp_spawn).
        owned_sinks(self._tensorboard, self._wandb, self.named)
        self._owned: list[Sink] | None = None
        self._run: list[GuardedSink] = []
        self._group: SinkGroup | None = None
        self.config_written = False

    @property
    def writer(self) -> bool:
        """Whether this process writes to the sinks and prints (looked up when first needed)."""
        if self._writer is None:
            self._writer = is_rank_zero()
        return self._writer

    @writer.setter
    def writer(self, writer: bool) -> None:
        self._writer = check_bool("writer", writer)

    @property
    def group(self) -> SinkGroup:
        """The run's sinks: the owned ones (made at the run's first use, on the writer only), the
        caller's and the run's."""
        if self._group is None:
            if self._owned is None:
                self._owned = owned_sinks(self._tensorboard, self._wandb, self.named) if self.writer else []
            self._group = SinkGroup([*self._owned, *self.user, *self._run])
        return self._group

    @property
    def out(self) -> SinkGroup:
        """What this process writes to: the run's sinks on the writer, nothing elsewhere."""
        return self.group if self.writer else _SILENT

    def start_run(self, run_sinks: list[GuardedSink] | None = None) -> None:
        """A new run: the owned sinks a previous run left open are closed, the next use makes fresh
        ones; ``run_sinks`` join this run only (``None``: the first run, none yet)."""
        if run_sinks is not None:
            self.close_owned()
            self._owned = None
            self._run = run_sinks
        self._group = None
        self.config_written = False

    def write_config_once(self, policy: Any) -> None:
        """The policy to the sinks by the writer, once a run (again after ``config_written`` is reset:
        a new policy)."""
        if self.config_written or policy is None or not self.writer:
            return
        self.config_written = True
        self.out.write_config(policy.to_config())

    def close_owned(self) -> None:
        for sink in self._owned or ():
            sink.close()  # a ManagedSink: guarded, and a disabled one still releases its file or run
        self._owned = []  # closed for this run; start_run() lets the next run make new ones

    def close(self) -> None:
        """Every sink: the owned ones and the caller's (a disabled sink is closed too)."""
        self.close_owned()
        for sink in [*self.user, *self._run]:
            sink.close()

