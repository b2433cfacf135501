"""Fixed-width records of numbers, appended in order and read back in order, in a bounded amount of memory.

A reader of another engine's log cannot know a log point's meaning until the whole log is read (a
setting printed late, the first overflow's scale, which engine's lines make the series), and a log
may hold millions of them. :class:`Records` keeps the first ones in a compact array and, past
``in_memory`` records, moves them to an unnamed temporary file (removed by the system when closed,
even if the process dies): memory stays bounded however long the log, and the records can be read
back as often as needed.

Example:
    >>> records = Records(width=2, in_memory=2)
    >>> for step in range(5):
    ...     records.add(step, step / 2)
    >>> list(records), len(records)
    ([(0.0, 0.0), (1.0, 0.5), (2.0, 1.0), (3.0, 1.5), (4.0, 2.0)], 5)
"""

from __future__ import annotations

import math
import tempfile
from array import array
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["Records"]

IN_MEMORY = 1 << 16  # records kept in memory before they go to the file (64 Ki x width x 8 bytes)


class Records:
    """Records of ``width`` floats (integers are exact up to 2**53), read back in the order added.

    Args:
        width: numbers per record, an integer >= 1.
        in_memory: records kept in memory (default :data:`IN_MEMORY`); past that they are written to
            an unnamed temporary file, ``in_memory`` at a time. Where no temporary file can be made,
            they stay in memory.

    Raises:
        ValueError: ``width`` or ``in_memory`` is not an integer >= 1.
    """

    def __init__(self, width: int, in_memory: int | None = None) -> None:
        in_memory = IN_MEMORY if in_memory is None else in_memory
        for name, value in (("width", width), ("in_memory", in_memory)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.width = width
        self._buffer = array("d")
        self._limit: float = in_memory * width  # numbers in the buffer before it is written out
        self._chunk = in_memory * width * 8  # bytes read back at a time: whole records
        self._file: BinaryIO | None = None
        self._written = 0  # bytes of whole records in the file
        self._count = 0

    def add(self, *values: float) -> None:
        """Append one record of ``width`` numbers (called once per log point: kept short)."""
        buffer = self._buffer
        buffer.extend(values)
        self._count += 1
        if len(buffer) >= self._limit:
            self._spill()

    def __len__(self) -> int:
        return self._count

    def _spill(self) -> None:
        if len(self._buffer) % self.width:
            raise ValueError(f"a record of {self.width} numbers was added with another number of them")
        if self._file is None:
            try:  # unbuffered: a write that fails fails here, not at a later flush
                self._file = tempfile.TemporaryFile(prefix="lossscale-records-", buffering=0)
            except OSError:  # no writable temporary folder: the records stay in memory
                self._limit = math.inf
                return
        try:
            self._file.seek(self._written)
            self._buffer.tofile(self._file)
        except OSError:  # the temporary folder is full: what was written stays, the rest in memory
            self._limit = math.inf
            return
        self._written += len(self._buffer) * 8
        del self._buffer[:]

    def __iter__(self) -> Iterator[tuple[float, ...]]:
        """The records in the order added, each a tuple of ``width`` floats. Each iteration reads the file
        from its own position, so two may run at once."""
        width = self.width
        offset = 0
        while self._file is not None and offset < self._written:
            self._file.seek(offset)
            chunk = self._file.read(min(self._chunk, self._written - offset))
            offset += len(chunk)
            values = array("d")
            values.frombytes(chunk)
            yield from zip(*[iter(values)] * width, strict=True)
        yield from zip(*[iter(self._buffer)] * width, strict=True)

    def close(self) -> None:
        """Let the temporary file go now (it also goes when the records are garbage collected)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._written = 0
        self._buffer = array("d")
        self._count = 0
