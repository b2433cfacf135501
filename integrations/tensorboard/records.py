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
  like: what came before is kept and a note says where the file ends.

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

import numpy as np

__all__ = ["FileReading", "crc32c_rows", "iter_record_batches", "masked_crc32c_rows"]

_LENGTH = struct.Struct("<Q")
_HEADER, _FOOTER = 12, 4
_CHUNK = 16 * 2**20  # bytes read at once: memory is bounded by this, not by the file
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


def _stored_crcs(blobs: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(blobs), dtype="<u4")


def _bad_rows(blobs: list[bytes], stored: np.ndarray) -> list[int]:
    """Indices of the blobs whose masked CRC-32C differs from ``stored``, checked one length at a time."""
    by_length: dict[int, list[int]] = {}
    for i, blob in enumerate(blobs):
        by_length.setdefault(len(blob), []).append(i)
    bad: list[int] = []
    for length, indices in by_length.items():
        joined = b"".join(blobs[i] for i in indices)
        rows = np.frombuffer(joined, dtype=np.uint8).reshape(len(indices), length)
        wrong = masked_crc32c_rows(rows) != stored[indices]
        bad.extend(indices[k] for k in np.flatnonzero(wrong))
    return sorted(bad)


@dataclasses.dataclass
class _Chunk:
    """The records framed in one buffer: where each starts, and the kept ones (offset, data, data's CRC)."""

    buffer: bytes
    base: int
    starts: list[int] = dataclasses.field(default_factory=list)
    kept: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)
    kept_crcs: list[bytes] = dataclasses.field(default_factory=list)


def _frame(buffer: bytes, base: int, wanted: bytes, keep_first: bool) -> tuple[_Chunk, int]:
    """Frame the whole records in ``buffer`` (which starts at file offset ``base``); return them and
    the position of the first byte not framed (the start of a record that continues in the next chunk)."""
    chunk = _Chunk(buffer, base)
    position, size = 0, len(buffer)
    while position + _HEADER <= size:
        (length,) = _LENGTH.unpack_from(buffer, position)
        end = position + _HEADER + length + _FOOTER
        if end > size:
            break
        chunk.starts.append(position)
        start = position + _HEADER
        if (keep_first and not chunk.kept) or buffer.find(wanted, start, start + length) >= 0:
            chunk.kept.append((base + position, buffer[start:start + length]))
            chunk.kept_crcs.append(buffer[end - _FOOTER:end])
        keep_first = False
        position = end
    return chunk, position


def _first_bad_header(chunk: _Chunk) -> int | None:
    """The file offset of the first record whose length fails its checksum, or None."""
    if not chunk.starts:
        return None
    where = np.asarray(chunk.starts)[:, None] + np.arange(_HEADER)
    headers = np.frombuffer(chunk.buffer, dtype=np.uint8)[where]
    wrong = masked_crc32c_rows(headers[:, :8]) != headers[:, 8:].copy().view("<u4")[:, 0]
    bad = np.flatnonzero(wrong)
    return chunk.base + chunk.starts[bad[0]] if bad.size else None


def _verified(chunk: _Chunk, reading: FileReading) -> list[tuple[int, bytes]]:
    """The kept records whose data match their checksum; the others go to ``reading.damage``."""
    bad = set(_bad_rows([data for _, data in chunk.kept], _stored_crcs(chunk.kept_crcs)))
    for i in sorted(bad):
        reading.damage.append(f"{reading.path}: the record at byte {chunk.kept[i][0]} fails its checksum "
                              "(left out)")
    return [record for i, record in enumerate(chunk.kept) if i not in bad]


def _header_damaged(header: bytes) -> bool:
    stored = np.frombuffer(header[8:12], dtype="<u4")
    return bool(_bad_rows([header[:8]], stored))


def _end_of_file(rest: bytes, offset: int, reading: FileReading) -> None:
    """Judge the bytes left after the last whole record: nothing, a record cut short, or a damaged length."""
    if not rest:
        return
    if len(rest) >= _HEADER and _header_damaged(rest[:_HEADER]):
        reading.damage.append(f"{reading.path}: the length of the record at byte {offset} fails its "
                              f"checksum: the last {len(rest)} bytes cannot be read")
        return
    reading.ended_early = (f"{reading.path} ends inside the record at byte {offset} (a run still being "
                           "written, or a copy cut short): read up to there")


def iter_record_batches(path: str, wanted: bytes, reading: FileReading) -> Iterator[list[tuple[int, bytes]]]:
    """The first record and the records mentioning ``wanted``, as ``(offset, data)``, one batch per chunk.

    Only records whose checksums hold are yielded; damage and an early end go to ``reading`` (see the
    module). The first batch starts with the file's first record, unless that record is damaged.
    """
    base, carry, first = 0, b"", True
    with open(path, "rb") as handle:
        while True:
            data = handle.read(_CHUNK)
            buffer = carry + data if carry else data
            chunk, used = _frame(buffer, base, wanted, keep_first=first)
            bad_header = _first_bad_header(chunk)
            if bad_header is None and not chunk.starts and data and len(buffer) >= _HEADER \
                    and _header_damaged(buffer[:_HEADER]):
                bad_header = base  # a damaged length too large to frame: do not read on to satisfy it
            if bad_header is not None:
                chunk.kept = [r for r in chunk.kept if r[0] < bad_header]
                chunk.kept_crcs = chunk.kept_crcs[:len(chunk.kept)]
            records = _verified(chunk, reading)
            reading.records_read += len(chunk.starts)
            first = first and not chunk.starts
            if records:
                yield records
            if bad_header is not None:
                reading.damage.append(f"{path}: the length of the record at byte {bad_header} fails its "
                                      f"checksum: the {os.path.getsize(path) - bad_header} bytes from there "
                                      "cannot be read")
                return
            base, carry = base + used, buffer[used:]
            if not data:
                _end_of_file(carry, base, reading)
                return
