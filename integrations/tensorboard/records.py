"""The record framing of TensorBoard event files, read in chunks, with every checksum that matters verified.

An event file is a sequence of records: the data's length (8 bytes, little-endian), the masked
CRC-32C of those 8 bytes, the data (a serialized ``Event``), the masked CRC-32C of the data.
:func:`iter_record_batches` walks a file chunk by chunk and keeps only the file's first record and
the records whose data contain ``wanted`` (``b"loss_scale/"``): a file of a million other events
costs one pass of the framing, not a million parses. What it checks, and what a failure means:

* the length's checksum of *every* record (the framing depends on it): a damaged length loses the
  framing, so the rest of the file is left out and the damage is reported;
* the data's checksum of every record kept: a damaged record is left out and reported, the file
  goes on (its neighbours are framed by their own lengths);
* a file that ends inside a record is what a run still being written (or a copy cut short) looks
  like: what came before is kept and a note says where the file ends (the rule every reader shares,
  :func:`~lossscale_callbacks.run_readers.ended_inside_record`; a file cut inside its first record
  holds nothing to read, an error);
* a record longer than a chunk is never held: a length past the end of the file is a file cut
  short, and a long record that is there is stepped over (left out as damage if it mentions
  ``wanted``). Memory is bounded by two chunks, whatever the file or its length fields say.

The checksums are computed with NumPy, all records of one length at once (a CRC-32C table lookup per
byte column), since a pure-Python CRC would cost more than everything else the reader does.

Example:
    >>> crc32c_rows(np.frombuffer(b"123456789", dtype=np.uint8).reshape(1, -1)).tolist()  # the check value
    [3808858755]
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from lossscale_callbacks.run_readers import ended_inside_record

__all__ = ["FileReading", "RecordRows", "crc32c_rows", "iter_record_batches", "masked_crc32c_rows"]

_LENGTH = struct.Struct("<Q")
_HEADER, _FOOTER = 12, 4
_CHUNK = 16 * 2**20  # bytes read at once: memory is bounded by two of these, not by the file
_SCAN = 2**20  # a record longer than a chunk is looked through this many bytes at a time
_MASK_DELTA = np.uint32(0xA282EAD8)


def _crc32c_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as TFRecord uses): the byte table, and the
    two 16-bit tables that advance the register over four bytes at once (its low and high halves)."""
    byte = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        byte = np.where(byte & 1, (byte >> 1) ^ np.uint32(0x82F63B78), byte >> 1).astype(np.uint32)

    def four_zero_bytes(register: np.ndarray) -> np.ndarray:
        for _ in range(4):
            register = byte[register & 0xFF] ^ (register >> 8)
        return register

    half = np.arange(2**16, dtype=np.uint32)
    return byte, four_zero_bytes(half), four_zero_bytes(half << 16)


_BYTE, _LOW, _HIGH = _crc32c_tables()


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """The CRC-32C of every row of a 2-D ``uint8`` array (rows of one length), vectorised across rows.

    The CRC register is linear in its input, so xoring four data bytes into it and advancing it over
    four zero bytes (two 16-bit table lookups) equals four byte steps: a few NumPy operations per four
    columns, whatever the number of rows.
    """
    crc = np.full(rows.shape[0], 0xFFFFFFFF, dtype=np.uint32)
    head = rows.shape[1] % 4
    for column in np.ascontiguousarray(rows[:, :head].T):
        crc = _BYTE[(crc ^ column) & 0xFF] ^ (crc >> 8)
    words = np.ascontiguousarray(np.ascontiguousarray(rows[:, head:]).view("<u4").T)
    mixed, low = np.empty_like(crc), np.empty_like(crc)
    for word in words:
        np.bitwise_xor(crc, word, out=mixed)
        np.bitwise_and(mixed, 0xFFFF, out=low)
        np.right_shift(mixed, 16, out=mixed)
        np.bitwise_xor(_LOW[low], _HIGH[mixed], out=crc)
    return crc ^ np.uint32(0xFFFFFFFF)


def masked_crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """The masked CRC-32C TFRecord stores, of every row (see :func:`crc32c_rows`)."""
    crc = crc32c_rows(rows)
    return ((crc >> 15) | (crc << 17)) + _MASK_DELTA  # uint32 arithmetic wraps, as the format wants


@dataclasses.dataclass
class FileReading:
    """What reading one file found besides its records: damage (one sentence each), where it ended early."""

    path: str
    damage: list[str] = dataclasses.field(default_factory=list)
    ended_early: str | None = None
    records_read: int = 0


@dataclasses.dataclass(frozen=True)
class RecordRows:
    """Records of one length, their checksums verified: their file offsets, and their data as rows.

    Example:
        >>> group = RecordRows(np.array([0, 40]), np.zeros((2, 24), dtype=np.uint8))
        >>> group.data(1) == bytes(24)
        True
    """

    offsets: np.ndarray  # int64: where each record (its length field) starts in the file
    rows: np.ndarray  # uint8, (records, length): each record's data

    def data(self, i: int) -> bytes:
        """The data of record ``i``, as bytes (for protobuf)."""
        return self.rows[i].tobytes()


def _windows(buffer: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` bytes at each of ``starts``, as rows: a strided view gathered once, no index table."""
    if width == 0:
        return np.empty((len(starts), 0), dtype=np.uint8)
    return np.lib.stride_tricks.sliding_window_view(buffer, width)[starts]


def _crc_fails(buffer: np.ndarray, starts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Whether each row (the bytes at one of ``starts``) differs from the masked CRC-32C stored after it."""
    stored = _windows(buffer, starts + rows.shape[1], 4).copy().view("<u4")[:, 0]
    return masked_crc32c_rows(rows) != stored


def _frame(buffer: bytes, wanted: bytes, keep_first: bool) -> tuple[list[int], list[int], list[int], int]:
    """Frame the whole records in ``buffer``: where each starts; where the kept ones start and their data's
    lengths; and the position of the first byte not framed (a record that continues in the next chunk).
    Kept: the first record when ``keep_first``, and every record whose data contain ``wanted``."""
    starts: list[int] = []
    kept: list[int] = []
    lengths: list[int] = []
    position, size = 0, len(buffer)
    while position + _HEADER <= size:
        (length,) = _LENGTH.unpack_from(buffer, position)
        end = position + _HEADER + length + _FOOTER
        if end > size:
            break
        starts.append(position)
        if keep_first or buffer.find(wanted, position + _HEADER, end - _FOOTER) >= 0:
            kept.append(position)
            lengths.append(length)
        keep_first = False
        position = end
    return starts, kept, lengths, position


def _verified(buffer: np.ndarray, base: int, kept: np.ndarray, lengths: np.ndarray,
              reading: FileReading) -> list[RecordRows]:
    """The kept records, one group per length, without those whose data fail their checksum (reported)."""
    groups = []
    for length in np.unique(lengths).tolist():
        starts = kept[lengths == length]
        rows = _windows(buffer, starts + _HEADER, length)
        bad = _crc_fails(buffer, starts + _HEADER, rows)
        for offset in (starts[bad] + base).tolist():
            reading.damage.append(f"{reading.path}: the record at byte {offset} fails its checksum "
                                  "(left out)")
        groups.append(RecordRows(starts[~bad] + base, rows[~bad]))
    return groups


def _lengths_damaged(buffer: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Whether the length field of each record at ``starts`` fails its checksum."""
    return _crc_fails(buffer, starts, _windows(buffer, starts, 8))


def _header_damaged(header: bytes) -> bool:
    return bool(_lengths_damaged(np.frombuffer(header, dtype=np.uint8), np.zeros(1, dtype=np.int64))[0])


def _end_of_file(rest: bytes, offset: int, reading: FileReading) -> None:
    """Judge the bytes left after the last whole record: nothing, a record cut short, or a damaged length
    (an empty file is one cut short before its first record)."""
    if not rest and (offset or reading.damage):
        return
    if len(rest) >= _HEADER and _header_damaged(rest[:_HEADER]):
        reading.damage.append(f"{reading.path}: the length of the record at byte {offset} fails its "
                              f"checksum: the last {len(rest)} bytes cannot be read")
        return
    reading.ended_early = ended_inside_record(reading.path, offset, reading.records_read)


def _mentions(handle: BinaryIO, length: int, wanted: bytes) -> bool:
    """Whether the next ``length`` bytes of ``handle`` contain ``wanted``, read into one small buffer."""
    keep = len(wanted) - 1  # the end of a piece, kept for a match across two pieces
    window = bytearray(keep + _SCAN)
    view, held = memoryview(window), 0
    while length > 0:
        got = handle.readinto(view[held: held + min(length, _SCAN)])
        if not got:
            return False
        end, length = held + got, length - got
        if window.find(wanted, 0, end) >= 0:
            return True
        held = min(keep, end)
        window[:held] = window[end - held: end]
    return False


def _long_record(handle: BinaryIO, carry: bytes, offset: int, size: int, wanted: bytes,
                 reading: FileReading) -> bool:
    """Step over the record at ``offset`` (``carry`` starts with it) when it is longer than a chunk; whether
    it did. Memory stays at one chunk: a length past the end of the file is a file cut short (read up to
    there), and a record that is there is scanned piece by piece for ``wanted`` (a loss-scale event is a
    few hundred bytes: one that long is left out, as damage) and never held."""
    if len(carry) < _HEADER or _header_damaged(carry[:_HEADER]):
        return False
    total = _HEADER + _LENGTH.unpack_from(carry)[0] + _FOOTER
    if total <= _CHUNK:
        return False
    if offset + total > size:
        reading.ended_early = ended_inside_record(reading.path, offset, reading.records_read)
        return True
    handle.seek(offset + _HEADER)
    found = _mentions(handle, total - _HEADER - _FOOTER, wanted)
    if found:
        reading.damage.append(f"{reading.path}: the record at byte {offset} is {total} bytes long, more than "
                              f"the {_CHUNK} this reader holds at once (left out)")
    handle.seek(offset + total)
    reading.records_read += 1
    return True


def _chunk_groups(buffer: bytes, base: int, wanted: bytes, first: bool, more: bool,
                  reading: FileReading) -> tuple[list[RecordRows], int, int | None]:
    """One chunk: its verified record groups, the bytes framed, and where a damaged length stops the file
    (``more``: the file goes on after this chunk)."""
    starts, kept, lengths, used = _frame(buffer, wanted, keep_first=first)
    array = np.frombuffer(buffer, dtype=np.uint8)
    all_starts = np.asarray(starts, dtype=np.int64)
    bad_header = None
    if starts:
        wrong = np.flatnonzero(_lengths_damaged(array, all_starts))
        bad_header = int(all_starts[wrong[0]]) if wrong.size else None
    elif more and len(buffer) >= _HEADER and _header_damaged(buffer[:_HEADER]):
        bad_header = 0  # a damaged length too large to frame: do not read on to satisfy it
    kept_starts, kept_lengths = np.asarray(kept, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if bad_header is not None:
        keep = kept_starts < bad_header
        kept_starts, kept_lengths = kept_starts[keep], kept_lengths[keep]
    reading.records_read += len(starts)
    groups = _verified(array, base, kept_starts, kept_lengths, reading)
    return groups, used, None if bad_header is None else base + bad_header


def iter_record_batches(path: str, wanted: bytes, reading: FileReading) -> Iterator[list[RecordRows]]:
    """The first record and the records mentioning ``wanted``, one batch of length groups per chunk.

    Only records whose checksums hold are yielded; damage and an early end go to ``reading`` (see the
    module). The first record (offset 0) is in the first batch, unless it is damaged.
    """
    base, carry, first = 0, b"", True
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        while True:
            data = handle.read(_CHUNK)
            buffer = carry + data if carry else data
            groups, used, bad_header = _chunk_groups(buffer, base, wanted, first, bool(data), reading)
            first = first and used == 0
            if any(len(group.offsets) for group in groups):
                yield groups
            if bad_header is not None:
                reading.damage.append(f"{path}: the length of the record at byte {bad_header} fails its "
                                      f"checksum: the {size - bad_header} bytes from there cannot be read")
                return
            base, carry = base + used, buffer[used:]
            if data and _long_record(handle, carry, base, size, wanted, reading):
                if reading.ended_early:
                    return
                base, carry, first = handle.tell(), b"", False
                continue
            if not data:
                _end_of_file(carry, base, reading)
                return
