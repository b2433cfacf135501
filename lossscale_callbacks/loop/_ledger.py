"""The ledger of bad steps in the loop: its words in the summary, its file closed with the run.

An integration that keeps a ledger (:class:`~lossscale_callbacks.ledger._book.Ledger`: torch's
``LossScaler.track``, the Keras optimizer's ``ledger=``) hands it to the loop with the state it reads at the
interval (``carry(state, ledger=book)``, as the skip truth's outcomes come). The entries are the
integration's to record (it holds the samples and the replays); this room only takes the book the reads
carry, and at the run's end gives the summary the book's sentences (the bad steps in words, the cap when
reached, where the file is) and closes its file. Every integration gets the same words this way.

Example:
    >>> from lossscale_callbacks.ledger._book import Ledger
    >>> from lossscale_callbacks.ledger._entry import Entry, MicroBatch
    >>> book = Ledger(None)
    >>> book.add(Entry(12, 0, "overflow", 65536.0, (MicroBatch(0, (3, 7)),)))
    >>> room = LedgerRoom()
    >>> room.seen(book)
    >>> print(room.sentence().strip())
    Step 12 was bad (overflow); not replayed (off).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LedgerRoom"]


class LedgerRoom:
    """The book a run's reads carried (see the module). Made afresh for each run."""

    def __init__(self) -> None:
        self.book: Any = None

    def seen(self, book: Any) -> None:
        """A read carried ``book`` (``None``: this read carried none, the last one stays)."""
        if book is not None:
            self.book = book

    def sentence(self) -> str:
        """The summary's lines on the bad steps, each on a line of its own (empty without entries)."""
        if self.book is None:
            return ""
        lines = self.book.sentences()
        return "".join("\n" + line for line in lines)

    def close(self) -> None:
        """The run ended: the book's file is closed (a later entry reopens it, appending)."""
        if self.book is not None:
            self.book.close()
