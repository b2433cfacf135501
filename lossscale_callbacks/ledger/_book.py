"""The book of bad steps: bounded in memory, one JSON-lines file per rank beside the dashboards.

Every rank keeps its own book and writes its own file, ``bad_steps.rank<r>.jsonl`` (the rank in each
entry too), in the run's folder: the TensorBoard log directory when the run has one, or the folder
given as ``ledger=``. Lines are appended as the log interval reads the bad steps, flushed at once (a
crashed run keeps what it found). At most ``max_entries`` entries are kept in memory and written in a
run (:data:`MAX_ENTRIES` by default); the bad steps past the cap are counted, and the summary says so.

Example:
    >>> import tempfile
    >>> from lossscale_callbacks.ledger._entry import Entry, MicroBatch
    >>> from lossscale_callbacks.ledger._read import read_ledger_file
    >>> folder = tempfile.mkdtemp()
    >>> book = Ledger(folder, rank=0)
    >>> book.add(Entry(12, 0, "overflow", 65536.0, (MicroBatch(0, (3, 7)),)))
    >>> book.close()
    >>> [e.step for e in read_ledger_file(book.path)]
    [12]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from lossscale_callbacks.ledger._entry import Entry, MicroBatch, Replay
from lossscale_callbacks.ledger._read import ledger_file
from lossscale_callbacks.ledger._words import group_sentences

__all__ = ["MAX_ENTRIES", "Ledger", "bad_steps", "check_ledger"]


def check_ledger(ledger: Any) -> bool | str | os.PathLike[str]:
    """An integration's ``ledger=`` argument: ``False`` or ``None`` (off), ``True`` (beside the
    dashboards) or a folder.

    Raises:
        ValueError: anything else, naming ``ledger``.

    Example:
        >>> check_ledger(None), check_ledger("runs/ledger")
        (False, 'runs/ledger')
    """
    if ledger is None or isinstance(ledger, (bool, str, os.PathLike)):
        return ledger or False
    raise ValueError(f"ledger must be True, False or a folder, got {ledger!r}")

MAX_ENTRIES = 10_000


def bad_steps(outcomes: Any) -> dict[int, tuple[str, float | None, bool]]:
    """The bad steps of an interval from the skip truth (an ``IntervalOutcomes``): step -> (cause, the
    scale the step used, whether it was applied anyway). Every listed step is one: skipped (overflow,
    non-finite, spike) or applied with non-finite gradients."""
    return {int(o.step): (str(o.cause), float(o.scale), not o.skipped) for o in outcomes.outcomes}


class Ledger:
    """One rank's bad steps: kept (at most ``max_entries``), written as JSON lines, told in words.

    Args:
        directory: the folder to write into (``None``: kept in memory only).
        rank: this process's global rank (in the file name and every entry).
        max_entries: the cap on entries kept and written in a run.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, rank: int = 0,
                 max_entries: int = MAX_ENTRIES) -> None:
        self.directory = None if directory is None else Path(directory)
        self.rank = rank
        self.max_entries = max_entries
        self.entries: list[Entry] = []
        self.dropped = 0  # bad steps past the cap
        self._file: IO[str] | None = None
        self._failed = False

    @property
    def path(self) -> Path | None:
        """This rank's file (``None`` when kept in memory only)."""
        return None if self.directory is None else ledger_file(self.directory, self.rank)

    def add(self, entry: Entry) -> None:
        """Keep and write one bad step (counted only, past the cap)."""
        if len(self.entries) >= self.max_entries:
            self.dropped += 1
            return
        self.entries.append(entry)
        self._write(entry.to_json())

    def record(self, bad: Mapping[int, tuple[str, float | None, bool]],
               details: Mapping[int, tuple[tuple[MicroBatch, ...], Replay | None, str | None]],
               origin: str | None = None, producer: str | None = None) -> list[Entry]:
        """An interval's bad steps as entries: ``bad`` (step -> cause, scale, applied: the skip truth),
        ``details`` (step -> micro-batches, replay, why no replay: the integration's capture), and the
        interval's forensics where they name one layer for all its bad steps. Returns the new entries."""
        new = []
        for step in sorted(bad):
            cause, scale, applied = bad[step]
            micro, replay, note = details.get(step, ((), None, "off"))
            entry = Entry(step=step, rank=self.rank, cause=cause,
                          scale=replay.scale if scale is None and replay is not None else scale,
                          micro_batches=micro, applied=applied,
                          origin_layer=(replay.origin if replay is not None and replay.origin else origin),
                          producing_layer=(replay.producer if replay is not None and not replay.same
                                           else producer),
                          replay=replay, replay_note=None if replay is not None else note)
            self.add(entry)
            new.append(entry)
        return new

    def _write(self, line: str) -> None:
        if self.directory is None or self._failed:
            return
        try:
            if self._file is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._file = open(ledger_file(self.directory, self.rank), "a", encoding="utf-8")
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as error:  # a full disk never stops training: the entries stay in memory
            import warnings

            self._failed = True
            warnings.warn(f"[lossscale-callbacks] the ledger of bad steps could not be written to "
                          f"{self.directory} ({error}); its entries stay in memory only.", RuntimeWarning,
                          stacklevel=2)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def reset(self) -> None:
        """A new run: nothing kept (the file is appended to; ``report`` keeps a step's last line)."""
        self.close()
        self.entries = []
        self.dropped = 0

    def write_skip_list(self, directory: str | os.PathLike[str],
                        include: str = "reproduced") -> tuple[Path, Path]:
        """Write ``skip_samples.json`` and Lightning's ``skip_batches.json`` for these entries into
        ``directory`` (see :mod:`lossscale_callbacks.ledger._skip`); returns the two paths."""
        from lossscale_callbacks.ledger._skip import write_skip_list

        return write_skip_list(self.entries, directory, include)

    def sentences(self) -> list[str]:
        """The run's bad steps in words: grouped by verdict, samples and layer, and the cap if reached."""
        if not self.entries:
            return []
        out = group_sentences(self.entries)
        if self.dropped:
            out.append(f"The ledger keeps at most {self.max_entries:,} entries a run: {self.dropped:,} more "
                       "bad step(s) were counted, not recorded.")
        if self.path is not None:
            out.append(f"Ledger: {self.path} (`lossscale-callbacks report` lists the bad samples).")
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_file"] = None  # a Trainer pickles its callbacks (ddp_spawn): the file is reopened
        return state
