"""Sample identities on the host side of the pipeline, per micro-batch, for the steps not yet read.

A pipeline hands over what it knows where it already is on the host: a sampler's indices as it yields
them (:meth:`SampleTracker.produced`, first in first out, as a ``DataLoader`` delivers its batches in
the order its batch sampler made them), or a batch's identities when the training loop receives it
(:meth:`SampleTracker.consumed`: Keras' epoch and batch index, a ``datasets`` index column). Each
micro-batch the loop receives is filed under the optimizer step it belongs to (the next one to end),
with its place under gradient accumulation. Nothing here reads a device: an identity that lives on
the device (a user's id field moved there with the batch) is kept as it is and resolved only for the
bad steps, at the log interval.

Bounded: at most ``max_micro_batches`` micro-batches and ``max_ids`` identities are held (the oldest
steps are forgotten first, counted in :attr:`SampleTracker.forgotten`); the queue of produced but not
yet received batches holds at most :data:`QUEUE_CAP` (a loader's prefetch is a few).

Example:
    >>> tracker = SampleTracker()
    >>> tracker.produced([3, 1], epoch=0, batch=0)
    >>> tracker.consumed()  # the loop received the batch: it belongs to step 1
    >>> tracker.step_ended()
    >>> tracker.of_step(1)
    (MicroBatch(index=0, samples=(3, 1), epoch=0, batch=0),)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from lossscale_callbacks.ledger._entry import MicroBatch

__all__ = ["MAX_IDS", "MAX_MICRO_BATCHES", "QUEUE_CAP", "SampleTracker"]

MAX_MICRO_BATCHES = 65536
MAX_IDS = 2**21
QUEUE_CAP = 1024
_FROM_QUEUE: Any = object()


class SampleTracker:
    """Which samples were in each micro-batch of the steps not yet read; host only, bounded.

    Args:
        max_micro_batches: micro-batches held at most (the oldest steps go first).
        max_ids: identities held at most, all micro-batches together.
    """

    def __init__(self, max_micro_batches: int = MAX_MICRO_BATCHES, max_ids: int = MAX_IDS) -> None:
        self.max_micro_batches = max_micro_batches
        self.max_ids = max_ids
        self._queue: deque[tuple[Any, int | None, int | None]] = deque(maxlen=QUEUE_CAP)
        self._steps: OrderedDict[int, list[tuple[int, Any, int | None, int | None]]] = OrderedDict()
        self._step = 0  # optimizer steps ended: a micro-batch received now belongs to step _step + 1
        self._micro = 0
        self._held = 0
        self._ids_held = 0
        self.forgotten = 0  # micro-batches dropped for the bound before their step was read

    @property
    def steps_ended(self) -> int:
        return self._step

    # ------------------------------------------------------------------------------ feeding

    def produced(self, ids: Any, epoch: int | None = None, batch: int | None = None) -> None:
        """The pipeline made a batch of these identities (first in, first out)."""
        self._queue.append((ids, epoch, batch))

    def new_pass(self) -> None:
        """A new pass over the data began: batches made for an earlier one and never received are dropped."""
        self._queue.clear()

    def consumed(self, ids: Any = _FROM_QUEUE, epoch: int | None = None, batch: int | None = None) -> None:
        """The training loop received a micro-batch: the next produced batch's identities, or ``ids``.

        ``epoch`` and ``batch`` given here replace the queue's (the trainer's own count is the truth).
        """
        if ids is _FROM_QUEUE:
            if self._queue:
                ids, q_epoch, q_batch = self._queue.popleft()
                epoch = q_epoch if epoch is None else epoch
                batch = q_batch if batch is None else batch
            else:
                ids = None
        step = self._step + 1
        micro_batches = self._steps.get(step)
        if micro_batches is None:
            micro_batches = self._steps[step] = []
        micro_batches.append((self._micro, ids, epoch, batch))
        self._micro += 1
        self._held += 1
        self._ids_held += _count(ids)
        if self._held > self.max_micro_batches or self._ids_held > self.max_ids:
            self._shrink()

    def withdraw(self) -> None:
        """The micro-batch received last was not trained on (the loop skipped it before any backward:
        Lightning's ``training_step`` returned ``None``): it leaves the coming step."""
        micro_batches = self._steps.get(self._step + 1)
        if not micro_batches:
            return
        _, ids, _, _ = micro_batches.pop()
        self._micro -= 1
        self._held -= 1
        self._ids_held -= _count(ids)
        if not micro_batches:
            del self._steps[self._step + 1]

    def step_ended(self, count: int = 1) -> None:
        """``count`` optimizer steps ended (attempted, skipped or not): later micro-batches are the next's."""
        self._step += count
        self._micro = 0

    def rebase(self, steps_ended: int) -> None:
        """The run's true count of steps ended (a checkpoint was loaded, or a read re-based it)."""
        if steps_ended != self._step:
            self._step = steps_ended
            self._micro = 0

    # ------------------------------------------------------------------------------ reading

    def of_step(self, step: int, resolve: Callable[[Any], Iterable[Any] | None] | None = None
                ) -> tuple[MicroBatch, ...]:
        """The micro-batches of ``step`` (empty when not known or forgotten); ``resolve`` turns a kept
        identity object (a device tensor) into host values, called only here."""
        out = []
        for index, ids, epoch, batch in self._steps.get(step, ()):
            if ids is not None and resolve is not None:
                ids = resolve(ids)
            out.append(MicroBatch(index, None if ids is None else tuple(ids), epoch, batch))
        return tuple(out)

    def release_through(self, step: int) -> None:
        """Forget every step up to ``step`` (its interval was read)."""
        while self._steps:
            first = next(iter(self._steps))
            if first > step:
                break
            self._drop(first)

    def _drop(self, step: int) -> None:
        for _, ids, _, _ in self._steps.pop(step):
            self._held -= 1
            self._ids_held -= _count(ids)

    def _shrink(self) -> None:
        while self._steps and (self._held > self.max_micro_batches or self._ids_held > self.max_ids):
            first = next(iter(self._steps))
            self.forgotten += len(self._steps[first])
            self._drop(first)


def _count(ids: Any) -> int:
    if ids is None:
        return 0
    try:
        return len(ids)
    except TypeError:
        return 1
