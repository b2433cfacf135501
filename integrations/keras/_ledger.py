"""The ledger of bad steps in Keras ``fit``: each bad step's epoch and batch index, its rows where they are
known, its cause and scale from the optimizer's device ring, and the layers the forensics name.

What a ``LossScaleCallback`` knows of a step without reading anything: the epoch (``on_epoch_begin``) and
the optimizer steps counted on the host, so each step's batch index in its epoch. That is the sample
identity of a step, for NumPy and ``tf.data`` inputs alike. Keras hands a callback neither the batch size nor
whether ``fit`` shuffles, and never the batch itself: with NumPy inputs and ``fit(..., shuffle=False)`` the
rows of batch ``b`` are ``b * batch_size`` onwards, and the callback lists them when given ``unshuffled=(rows,
batch_size)``; with ``shuffle=True`` (``fit``'s default for NumPy) Keras draws a new permutation each epoch
inside its data pipeline and exposes it nowhere, so the epoch and batch index are the identity.

The cause and scale of each bad step come from the skip truth: the optimizer's device ring, read at the
interval with the state (:meth:`~lossscale_callbacks.keras.LossScaleOptimizer.read_state_and_outcomes`).
The layers come from the interval's forensics (``diagnose=``): the producing layer of a step the forward
trace traced (its first non-finite step of the interval; ``diagnose="every_step"`` or ``trace_every=1``
traces every step), and the origin layer of the gradients where the interval's skips all name one.

No replay: a Keras callback never sees the batch ``fit`` feeds its compiled step (the data adapter takes it
from the iterator inside ``fit``), so it cannot run it again; each entry says so.
"""

from __future__ import annotations

from typing import Any

from lossscale_callbacks.integration import (
    Ledger,
    MicroBatch,
    bad_steps,
    check_int,
    check_ledger,
    process_rank,
)

__all__ = ["NO_REPLAY", "KerasLedger", "check_unshuffled"]

NO_REPLAY = "keras: a callback never sees the batch fit feeds its compiled step"


def check_unshuffled(unshuffled: Any) -> tuple[int, int] | None:
    """``unshuffled``: ``None``, or ``(rows, batch_size)`` of ``fit``'s NumPy inputs with ``shuffle=False``.

    Raises:
        ValueError: anything else, naming ``unshuffled``.

    Example:
        >>> check_unshuffled((512, 8))
        (512, 8)
    """
    if unshuffled is None:
        return None
    if not isinstance(unshuffled, (tuple, list)) or len(unshuffled) != 2:
        raise ValueError(f"unshuffled must be None or (rows, batch_size) of fit's NumPy inputs given with "
                         f"shuffle=False, got {unshuffled!r}")
    rows = check_int("unshuffled rows", unshuffled[0])
    return rows, check_int("unshuffled batch_size", unshuffled[1])


class KerasLedger:
    """What ``LossScaleCallback(ledger=..., unshuffled=...)`` does at ``fit``'s hooks and at each read.

    Example:
        >>> from lossscale_callbacks.integration import IntervalOutcomes
        >>> from lossscale_callbacks.skips._outcomes import StepOutcome
        >>> ledger = KerasLedger(True, (20, 8))
        >>> ledger.start(None)
        >>> ledger.epoch_begin(0, steps=0)
        >>> ledger.epoch_begin(1, steps=3)  # 3 batches an epoch
        >>> outcome = IntervalOutcomes(1, 6, (StepOutcome(5, "overflow", 1024.0),), {"overflow": 1})
        >>> [(e.step, e.micro_batches[0].epoch, e.micro_batches[0].batch, e.samples()) for e in
        ...  ledger.record(outcome, None)]
        [(5, 1, 1, (8, 9, 10, 11, 12, 13, 14, 15))]
    """

    def __init__(self, ledger: Any, unshuffled: Any, replay: Any = False) -> None:
        if replay:
            raise ValueError(f"replay={replay!r} is not available in Keras fit: {NO_REPLAY}, so it cannot be "
                             "run again on the same weights (replay is on the torch integrations); "
                             "ledger= records the bad steps without it")
        self.ledger = check_ledger(ledger)
        self.unshuffled = check_unshuffled(unshuffled)
        if self.unshuffled is not None and not self.ledger:
            raise ValueError("unshuffled names the rows of the ledger's entries: give ledger= too")
        self.book: Ledger | None = None
        self._epochs: list[tuple[int, int]] = []  # (epoch, optimizer steps before it), in order

    @property
    def on(self) -> bool:
        return bool(self.ledger)

    def start(self, tensorboard: Any) -> None:
        """At ``on_train_begin``: the book (once; later ``fit`` calls append to it), a new run's epochs."""
        if self.book is None:
            folder = self.ledger if not isinstance(self.ledger, bool) else tensorboard
            self.book = Ledger(folder or None, rank=process_rank())
        self._epochs = []

    def epoch_begin(self, epoch: int, steps: int) -> None:
        """At ``on_epoch_begin``: ``steps`` optimizer steps were taken before this epoch (host count)."""
        self._epochs.append((int(epoch), int(steps)))

    def _place(self, step: int) -> tuple[int | None, int | None]:
        """The epoch and batch index of optimizer step ``step`` (from 1), where this ``fit`` ran it."""
        for epoch, before in reversed(self._epochs):
            if step > before:
                return epoch, step - before - 1
        return None, None

    def _samples(self, batch: int | None) -> tuple[int, ...] | None:
        if self.unshuffled is None or batch is None:
            return None
        rows, size = self.unshuffled
        return tuple(range(batch * size, min((batch + 1) * size, rows)))

    def record(self, outcomes: Any, forensics: Any) -> list[Any]:
        """An interval's bad steps (the skip truth's ``IntervalOutcomes``) into the book, one entry each, with
        the layers ``forensics`` (the interval's ``IntervalForensics``, or ``None``) name for it."""
        assert self.book is not None
        bad = bad_steps(outcomes)
        producer, producer_step, origin = _layers(forensics, len(bad))
        new = []
        for step in sorted(bad):
            epoch, batch = self._place(step)
            micro = (MicroBatch(0, self._samples(batch), epoch, batch),)
            new += self.book.record({step: bad[step]}, {step: (micro, None, NO_REPLAY)}, origin=origin,
                                    producer=producer if producer_step == step else None)
        if self._epochs and outcomes.last_step > 0:  # the epochs wholly before this read are not needed again
            keep = [i for i, (_, before) in enumerate(self._epochs) if before >= outcomes.last_step]
            self._epochs = self._epochs[max(0, (keep[0] if keep else len(self._epochs)) - 1):]
        return new

    def close(self) -> None:
        if self.book is not None:
            self.book.close()


def _layers(forensics: Any, bad: int) -> tuple[str | None, int | None, str | None]:
    """The producing layer and its step (the forward trace's first non-finite step of the interval), and
    the gradients' origin layer when the interval's skips all name that one."""
    if forensics is None:
        return None, None, None
    trace = getattr(forensics, "activations", None)
    producer = getattr(trace, "producer", None)
    # The trace numbers a step by the state's steps before it (from 0); the ledger from 1.
    first = getattr(trace, "producer_step", None)
    producer_step = first + 1 if producer is not None and first is not None else None
    origins = {layer: n for layer, n in forensics.layer_origins.items() if n}
    origin = next(iter(origins)) if len(origins) == 1 and sum(origins.values()) == bad else None
    return producer, producer_step, origin
