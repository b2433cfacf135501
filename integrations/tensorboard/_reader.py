"""Read a TensorBoard run's ``loss_scale/*`` series back, fast and verified, for the report command.

Scalars come in two encodings: ``simple_value`` (torch's ``SummaryWriter``, Lightning's
``TensorBoardLogger``, TF1) and rank-0 tensors (``tf.summary`` in TF2 and Keras 3, and
:class:`~lossscale_callbacks.tensorboard.TensorBoardSink`); both are read. Text summaries (the
reports, the policy) are rank-0 string tensors.

The reader streams each file in chunks and keeps only the records that mention ``loss_scale/``
(:mod:`~lossscale_callbacks.tensorboard._reader`), verifying the checksum of every record length
and of every record it keeps: a flipped bit is reported as damage and the record left out, never
read as a loss scale of 2**31. The records a sink writes at every interval share one layout and are
decoded together by NumPy (:mod:`~lossscale_callbacks.tensorboard._reader`); the others are
parsed by protobuf. A run whose event files hold a million other events is read in about a second
(``benchmarks/report_read.py``). Series keep the order the records were written in (a restarted
run's steps go back; the report tells the restarts apart). A file that ends inside a record (a run
still being written) is read up to there, with a note. Neither TensorFlow nor torch is imported.

Example:
    >>> from lossscale_callbacks.tensorboard._reader import read_run
    >>> series = read_run("runs/fp16")                      # doctest: +SKIP
    >>> series["loss_scale/scale"][:2]                      # doctest: +SKIP
    [(100, 32768.0), (200, 32768.0)]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import struct
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, types_pb2

from lossscale_callbacks.integration import (
    GROWTH_INTERVAL,
    MAX_SCALE,
    MIN_SCALE,
    POLICY_TAG,
    TAG_PREFIX,
    RunReadError,
    RunSeries,
    ended_inside_record,
    is_event_file_name,
    is_regular_file,
    policy_bounds_from_markdown,
    policy_values_from_markdown,
)
from lossscale_callbacks.integration import SCALE as SCALE_TAG

__all__ = [
    "FileReading",
    "Layout",
    "RecordRows",
    "RunReadError",
    "check_one_writer_at_a_time",
    "closed_at",
    "crc32c_rows",
    "decode_rows",
    "event_files",
    "iter_events",
    "iter_record_batches",
    "layout_of",
    "masked_crc32c_rows",
    "match_rows",
    "read_run",
    "read_texts",
    "run_folders",
]


# ----------------------------------------
# Decode many scalar events at once: the records of one *layout* differ only in their numbers.
#
# A sink writes the same event at every log interval: the same tags, the same tensor types; only the
# wall time, the step and the values change. Records with the same length whose other bytes are all
# equal have the same protobuf structure, so their numbers sit at the same offsets. The first record
# of such a layout is walked field by field (a small wire-format walker for ``Event`` → ``Summary`` →
# ``Summary.Value`` → ``TensorProto`` that knows where a scalar's bytes are); every record matching it is
# then decoded by NumPy, column by column, instead of one protobuf parse and a dozen attribute reads
# per value. What the layout leaves free is exactly what cannot change the structure: the wall time
# (8 fixed bytes), the float32/float64 values (fixed bytes) and the step's varint bits (its length, held
# by the continuation bits, must match). Records that fit no layout (the first record, texts,
# histograms, integer tensors) are parsed by protobuf, as before.


_FLOAT, _DOUBLE = 1, 2  # TensorProto dtypes (types_pb2.DT_FLOAT, DT_DOUBLE)


_FREE, _VARINT_BITS, _FIXED = 0x00, 0x80, 0xFF  # what of a byte must equal the layout's


_WIDTH = {"<f4": 4, "<f8": 8}


class _NoLayout(Exception):
    """The record is not a plain scalar event: protobuf parses it."""


def _varint(data: bytes, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while position < end:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position += 1
        if byte < 0x80:
            return value, position
        shift += 7
    raise _NoLayout


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(field number, wire type, value start, value end)`` of each field in ``data[start:end]``."""
    position = start
    while position < end:
        key, position = _varint(data, position, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _varint(data, position, end)
        elif wire == 1:
            after = position + 8
        elif wire == 5:
            after = position + 4
        elif wire == 2:
            length, position = _varint(data, position, end)
            after = position + length
        else:  # groups: never in these messages
            raise _NoLayout
        if after > end:
            raise _NoLayout
        yield number, wire, position, after
        position = after


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the numbers of one event layout are, and which bytes every matching record must share.

    Attributes:
        reference: the record the layout was read from, as ``uint8``.
        mask: per byte, the bits that must equal the reference's (0xFF, 0x80 for the step's varint, 0).
        step: ``(offset, width)`` of the step's varint, or None when the event has step 0 (left out).
        values: ``(tag, offset, dtype)`` of each scalar, dtype ``"<f4"`` or ``"<f8"``.
    """

    reference: np.ndarray
    mask: np.ndarray
    step: tuple[int, int] | None
    values: tuple[tuple[str, int, str], ...]


def _tensor(data: bytes, start: int, end: int) -> tuple[int, str]:
    """``(offset, dtype)`` of a rank-0 float32/float64 tensor's value."""
    dtype, found = None, None
    for number, wire, a, b in _fields(data, start, end):
        if number == 1 and wire == 0:
            dtype = _varint(data, a, b)[0]
        elif number == 2 and wire == 2 and a == b:  # an empty shape: rank 0
            continue
        elif (number, wire) in ((4, 2), (5, 2), (5, 5)) and b - a == 4:  # tensor_content, float_val
            found = (a, "<f4")
        elif (number, wire) in ((4, 2), (6, 2), (6, 1)) and b - a == 8:  # tensor_content, double_val
            found = (a, "<f8")
        else:
            raise _NoLayout
    if found is None or {"<f4": _FLOAT, "<f8": _DOUBLE}[found[1]] != dtype:
        raise _NoLayout
    return found


def _value(data: bytes, start: int, end: int) -> tuple[str, int, str]:
    """``(tag, offset, dtype)`` of one ``Summary.Value`` holding a scalar."""
    tag, found = None, None
    for number, wire, a, b in _fields(data, start, end):
        if number == 1 and wire == 2:
            tag = data[a:b].decode("utf-8", "replace")
        elif number in (7, 9) and wire == 2:  # node_name, metadata: part of the layout
            continue
        elif number == 2 and wire == 5:  # simple_value
            found = (a, "<f4")
        elif number == 8 and wire == 2:
            found = _tensor(data, a, b)
        else:
            raise _NoLayout
    if tag is None or found is None:
        raise _NoLayout
    return tag, *found


def layout_of(data: bytes) -> Layout | None:
    """The layout of an event record whose summary holds only float scalars, else None."""
    mask = np.full(len(data), _FIXED, dtype=np.uint8)
    step, values = None, []
    try:
        for number, wire, a, b in _fields(data, 0, len(data)):
            if number == 1 and wire == 1:  # wall_time
                mask[a:b] = _FREE
            elif number == 2 and wire == 0:
                step = (a, b - a)
                mask[a:b] = _VARINT_BITS
            elif number == 5 and wire == 2:
                for inner, inner_wire, va, vb in _fields(data, a, b):
                    if inner != 1 or inner_wire != 2:
                        raise _NoLayout
                    values.append(_value(data, va, vb))
            else:
                raise _NoLayout
    except _NoLayout:
        return None
    if not values:
        return None
    for _, offset, dtype in values:
        mask[offset:offset + _WIDTH[dtype]] = _FREE
    return Layout(np.frombuffer(data, dtype=np.uint8), mask, step, tuple(values))


def match_rows(layout: Layout, rows: np.ndarray) -> np.ndarray:
    """Which rows (records of the layout's length, as ``uint8``) have the layout: a boolean per row."""
    return ~(((rows ^ layout.reference) & layout.mask).any(axis=1))


def decode_rows(layout: Layout, rows: np.ndarray) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
    """The steps (int64) and, per value of the layout, its tag and values (float64), of rows that match it."""
    steps = np.zeros(rows.shape[0], dtype=np.uint64)
    if layout.step is not None:
        offset, width = layout.step
        for i in range(width):
            steps |= (rows[:, offset + i] & 0x7F).astype(np.uint64) << np.uint64(7 * i)
    values = []
    for tag, offset, dtype in layout.values:
        column = np.ascontiguousarray(rows[:, offset:offset + _WIDTH[dtype]]).view(dtype)[:, 0]
        values.append((tag, column.astype(np.float64)))
    return steps.view(np.int64), values



# ----------------------------------------
# The record framing of TensorBoard event files, read in chunks, with every checksum that matters verified.
#
# An event file is a sequence of records: the data's length (8 bytes, little-endian), the masked
# CRC-32C of those 8 bytes, the data (a serialized ``Event``), the masked CRC-32C of the data.
# :func:`iter_record_batches` walks a file chunk by chunk and keeps only the file's first record and
# the records whose data contain ``wanted`` (``b"loss_scale/"``): a file of a million other events
# costs one pass of the framing, not a million parses. What it checks, and what a failure means:
#
# * the length's checksum of *every* record (the framing depends on it): a damaged length loses the
#   framing, so the rest of the file is left out and the damage is reported;
# * the data's checksum of every record kept: a damaged record is left out and reported, the file
#   goes on (its neighbours are framed by their own lengths);
# * a file that ends inside a record is what a run still being written (or a copy cut short) looks
#   like: what came before is kept and a note says where the file ends.
#
# The checksums are computed with NumPy, all records of one length at once (a CRC-32C table lookup per
# byte column), since a pure-Python CRC would cost more than everything else the reader does.


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


_WANTED = TAG_PREFIX.encode()
_NEW_LAYOUTS = 8  # per record length and batch; past that (a file of odd records) protobuf parses them
# A scalar tensor's value: its repeated field, or the NumPy type of its raw bytes (tensor_content).
_FIELDS = {types_pb2.DT_FLOAT: "float_val", types_pb2.DT_DOUBLE: "double_val", types_pb2.DT_HALF: "half_val",
           types_pb2.DT_BFLOAT16: "half_val", types_pb2.DT_INT32: "int_val", types_pb2.DT_INT64: "int64_val",
           types_pb2.DT_BOOL: "bool_val"}
_CONTENT = {types_pb2.DT_FLOAT: "<f4", types_pb2.DT_DOUBLE: "<f8", types_pb2.DT_HALF: "<u2",
            types_pb2.DT_BFLOAT16: "<u2", types_pb2.DT_INT32: "<i4", types_pb2.DT_INT64: "<i8",
            types_pb2.DT_BOOL: "?"}


def _opened_at(path: str) -> float:
    """The wall time of a file's first event (when its writer opened it); infinity when it cannot be told."""
    try:
        with open(path, "rb") as handle:
            header = handle.read(12)
            (length,) = struct.unpack("<Q", header[:8]) if len(header) == 12 else (-1,)
            if not 0 < length < 2**16:  # a file-version event is a few dozen bytes
                return math.inf
            return float(event_pb2.Event.FromString(handle.read(length)).wall_time)
    except (OSError, DecodeError):
        return math.inf


def _event_files_in(folder: str) -> list[str]:
    """The event files directly in ``folder``, in the order their writers opened them (a restarted job's
    new file after the old one, whatever their names)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    files = [os.path.join(folder, n) for n in names
             if is_event_file_name(n) and is_regular_file(os.path.join(folder, n))]
    return sorted(files, key=_opened_at) if len(files) > 1 else files


def run_folders(root: str) -> list[str]:
    """Folders under ``root`` (itself included) that hold event files, sorted; non-files are ignored."""
    found = []
    for folder, dirs, _ in os.walk(root):
        dirs.sort()
        if _event_files_in(folder):
            found.append(folder)
    return found


def event_files(path: str) -> dict[str, list[str]]:
    """The event files of the run(s) at ``path``, by run name relative to ``path`` ("" for itself).

    A folder with event files directly in it is one run (its sub-folders are other runs and
    are not read). A folder without any, such as the ``log_dir`` of Keras' ``TensorBoard``
    callback (``train/``, ``validation/``), gives every run below it.

    Raises:
        RunReadError: nothing at ``path``, or no event file there.
    """
    if not os.path.exists(path):
        raise RunReadError(f"{path}: no such file or folder")
    if not os.path.isdir(path):
        if not is_event_file_name(os.path.basename(path)):
            raise RunReadError(f"{path}: not a TensorBoard event file (its name has no 'tfevents')")
        if not is_regular_file(path):
            raise RunReadError(f"{path}: not a regular file")
        return {"": [path]}
    direct = _event_files_in(path)
    if direct:
        return {"": direct}
    runs = {os.path.relpath(folder, path).replace(os.sep, "/"): _event_files_in(folder)
            for folder in run_folders(path)}
    if not runs:
        raise RunReadError(f"{path}: no TensorBoard run here (no events.out.tfevents.* file in it or below)")
    return runs


def _parse(file_path: str, data: bytes) -> event_pb2.Event:
    try:
        return event_pb2.Event.FromString(data)
    except DecodeError as exc:  # its checksum held: written so by its writer
        raise RunReadError(f"{file_path}: corrupt TensorBoard event file ({exc})") from None


def _without_first(file_path: str, groups: list[RecordRows], reading: FileReading) -> list[RecordRows]:
    """The first batch's groups without the file's first record, once that is checked to be the version
    record every event file starts with."""
    first = next(((g, int(np.argmin(g.offsets))) for g in groups if len(g.offsets) and g.offsets.min() == 0),
                 None)
    if first is None and reading.damage:
        raise RunReadError(f"corrupt TensorBoard event file ({reading.damage[0]})")
    if first is None or not _parse(file_path, first[0].data(first[1])).file_version.startswith("brain.Event"):
        raise RunReadError(f"{file_path}: not a TensorBoard event file (no file version event)")
    rest = first[0].offsets != 0
    return [RecordRows(g.offsets[rest], g.rows[rest]) if g is first[0] else g for g in groups]


def _batches(file_path: str, reading: FileReading) -> Iterator[list[RecordRows]]:
    """The verified records of one file that mention ``loss_scale/``, batch by batch (groups of one
    length), after its first record (checked, then dropped)."""
    first = True
    for groups in iter_record_batches(file_path, _WANTED, reading):
        if first:
            first = False
            groups = _without_first(file_path, groups, reading)
        yield groups
    if first and reading.damage:  # not even the first record could be read
        raise RunReadError(f"corrupt TensorBoard event file ({reading.damage[0]})")


def iter_events(file_path: str) -> Iterator[event_pb2.Event]:
    """The events of one file that carry ``loss_scale/`` tags, parsed by protobuf, in file order.

    Records whose checksum fails are left out (:func:`read_run` reports them).
    """
    for groups in _batches(file_path, FileReading(file_path)):
        records = [(int(offset), group, i) for group in groups for i, offset in enumerate(group.offsets)]
        for _, group, i in sorted(records, key=lambda record: record[0]):
            yield _parse(file_path, group.data(i))


def _number(value: event_pb2.summary_pb2.Summary.Value) -> float | None:
    """The value of a scalar: a ``simple_value`` or a rank-0 numeric tensor; None for anything else."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if not value.HasField("tensor") or value.tensor.tensor_shape.dim:  # rank-0 only
        return None
    tensor = value.tensor
    field = _FIELDS.get(tensor.dtype)
    if field is None:
        return None
    values = getattr(tensor, field)
    if values:
        first = values[0]
    elif tensor.tensor_content:  # numpy-written tensors keep their bytes here
        first = np.frombuffer(tensor.tensor_content, dtype=_CONTENT[tensor.dtype])[0].item()
    else:
        first = 0  # proto3 leaves a zero out of the repeated field
    if tensor.dtype == types_pb2.DT_HALF:  # half and bfloat16 are stored as their bits
        return float(np.array([first], dtype=np.uint16).view(np.float16)[0])
    if tensor.dtype == types_pb2.DT_BFLOAT16:
        return float((np.array([first], dtype=np.uint32) << 16).view(np.float32)[0])
    return float(first)


def _text(value: event_pb2.summary_pb2.Summary.Value) -> str | None:
    tensor = value.tensor if value.HasField("tensor") else None
    if tensor is None or tensor.dtype != types_pb2.DT_STRING or not tensor.string_val:
        return None
    return tensor.string_val[0].decode("utf-8", "replace")


class _Collector:
    """The ``loss_scale/*`` scalars and texts of one run, decoded group by group, kept in file order.

    A record's place in the run is its file's number (in reading order) and its offset in the file,
    packed into one integer for sorting.
    """

    def __init__(self) -> None:
        self.layouts: dict[int, list[Layout]] = {}
        self.columns: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self.points: dict[str, list[tuple[int, int, float]]] = {}
        self.texts: list[tuple[int, str, int, str]] = []

    def add(self, file_path: str, file_number: int, groups: Sequence[RecordRows]) -> None:
        """Decode one batch: each record length at once, layout by layout, the rest by protobuf."""
        for group in groups:
            if len(group.offsets):
                self._decode(file_path, (file_number << 48) + group.offsets, group)

    def _decode(self, file_path: str, order: np.ndarray, group: RecordRows) -> None:
        pending = np.ones(len(order), dtype=bool)
        known = self.layouts.setdefault(group.rows.shape[1], [])
        for layout in known:
            self._take(layout, order, group.rows, pending)
        new = 0
        while pending.any():
            i = int(np.argmax(pending))
            layout = layout_of(group.data(i)) if new < _NEW_LAYOUTS else None
            if layout is None:
                self._parse_one(file_path, int(order[i]), group.data(i))
                pending[i] = False
                continue
            new += 1
            known.append(layout)
            self._take(layout, order, group.rows, pending)
    def _take(self, layout: Layout, order: np.ndarray, rows: np.ndarray, pending: np.ndarray) -> None:
        matched = match_rows(layout, rows) & pending
        if not matched.any():
            return
        pending &= ~matched
        steps, values = decode_rows(layout, rows[matched])
        places = order[matched]  # one array for every tag of these records: series() sorts it once
        for tag, column in values:
            if TAG_PREFIX in tag:
                self.columns.setdefault(tag, []).append((places, steps, column))

    def _parse_one(self, file_path: str, index: int, data: bytes) -> None:
        event = _parse(file_path, data)
        for value in event.summary.value:
            if TAG_PREFIX not in value.tag:
                continue
            text = _text(value)
            if text is not None:
                self.texts.append((index, value.tag, int(event.step), text))
                continue
            number = _number(value)
            if number is not None:
                self.points.setdefault(value.tag, []).append((index, int(event.step), number))

    def scale_points(self) -> int:
        """How many ``loss_scale/scale`` points were collected so far (Keras' ``batch_`` copies of the
        logs, written beside our sink by its TensorBoard callback, are another writer's on purpose)."""
        return (sum(len(part[0]) for part in self.columns.get(SCALE_TAG, []))
                + len(self.points.get(SCALE_TAG, [])))

    def series(self) -> dict[str, list[tuple[int, float]]]:
        """Every scalar tag's ``(step, value)`` pairs in the order they were written.

        Tags written in the same events share their records' places and steps: those are sorted once.
        """
        out = {}
        shared: dict[tuple[int, ...], tuple[np.ndarray, list[int]]] = {}
        for tag in dict.fromkeys([*self.columns, *self.points]):
            loose = self.points.get(tag, [])
            parts = [*self.columns.get(tag, []), (np.array([p[0] for p in loose], dtype=np.int64),
                                                  np.array([p[1] for p in loose], dtype=np.int64),
                                                  np.array([p[2] for p in loose], dtype=np.float64))]
            key = tuple(id(part[0]) for part in parts[:-1]) if not loose else None
            if key is None or key not in shared:
                order = np.concatenate([part[0] for part in parts])
                sort = np.argsort(order, kind="stable")
                steps = np.concatenate([part[1] for part in parts])[sort].tolist()
                if key is not None:
                    shared[key] = sort, steps
            else:
                sort, steps = shared[key]
            values = np.concatenate([part[2] for part in parts])[sort].tolist()
            out[tag] = list(zip(steps, values, strict=True))
        return out

    def ordered_texts(self) -> list[tuple[str, int, str]]:
        return [(tag, step, text) for _, tag, step, text in sorted(self.texts, key=lambda t: t[0])]


def _read_files(files: list[str], damage: list[str], notes: list[str]) -> _Collector:
    """The records of a run's files. A file that cannot be read (cut inside its first record, corrupt)
    beside readable ones is left out as damage (an empty one with a note); the run is unreadable when
    none can be read."""
    collector = _Collector()
    unreadable: list[str] = []
    writers = []  # files holding the loss scale: one at a time, or two writers (check_one_writer_at_a_time)
    for number, file_path in enumerate(files):
        reading = FileReading(file_path)
        before = collector.scale_points()
        try:
            for groups in _batches(file_path, reading):
                collector.add(file_path, number, groups)
        except RunReadError as exc:
            if len(files) == 1:
                raise
            if os.path.getsize(file_path) == 0:  # nothing was written to it, so nothing is lost: a note
                notes.append(f"{file_path} is empty (left out)")
                unreadable.append("")
            else:
                unreadable.append(f"{exc} (the file is left out)")
            continue
        damage.extend(reading.damage)
        notes.extend([reading.ended_early] if reading.ended_early else [])
        if collector.scale_points() > before:
            writers.append((file_path, _opened_at(file_path)))
    if len(writers) > 1:
        check_one_writer_at_a_time(os.path.dirname(files[0]), writers)
    if unreadable and len(unreadable) == len(files):
        raise RunReadError(f"none of the {len(files)} event files can be read"
                           + "".join(f": {u}" for u in unreadable if u)[:1000])
    damage.extend(u for u in unreadable if u)
    return collector


def _policy_series(texts: list[tuple[str, int, str]]) -> dict[str, list[tuple[int, float]]]:
    """The policy's bounds and growth interval as one-point series, from the last policy text written."""
    policy = [(step, text) for tag, step, text in texts if tag == POLICY_TAG]
    if not policy:
        return {}
    step, text = policy[-1]
    out = {}
    bounds = policy_bounds_from_markdown(text)
    if bounds is not None:
        out[MIN_SCALE], out[MAX_SCALE] = [(step, bounds[0])], [(step, bounds[1])]
    interval = policy_values_from_markdown(text).get("growth_interval", "")
    if interval.isdigit():
        out[GROWTH_INTERVAL] = [(step, float(interval))]
    return out


def read_run(path: str) -> RunSeries:
    """Every ``loss_scale/*`` series in a TensorBoard run folder (or one event file), in the order written.

    Several event files in one folder (a resumed run, or this library's sink writing next to
    Keras' ``TensorBoard`` callback) are read in the order their writers opened them (the wall
    time of each file's first event). When ``path`` holds no event file itself but several runs below it
    (Keras' ``train/`` and ``validation/``), each tag is prefixed with its run
    (``train/loss_scale/scale``); with one run below it, tags are left as they are. The policy's
    bounds, written once as the ``loss_scale/policy`` text, come back as one-point
    ``loss_scale/min_scale`` and ``loss_scale/max_scale`` series (older runs wrote those series
    at every interval; both read the same). Records that fail their checksum are left out and
    listed in the result's ``damage``; a file that ends inside a record adds a ``notes`` entry.

    Raises:
        RunReadError: nothing at ``path``, no event file, or a file that is not an event file.
        OSError: a file cannot be read (no permission).
    """
    runs = event_files(path)
    merged = RunSeries()
    for run, files in runs.items():
        collector = _read_files(files, merged.damage, merged.notes)
        prefix = f"{run}/" if len(runs) > 1 else ""
        for tag, points in collector.series().items():
            merged[prefix + tag] = points
        for tag, points in _policy_series(collector.ordered_texts()).items():
            merged.setdefault(prefix + tag, points)
    return merged


def read_texts(path: str) -> list[tuple[str, int, str]]:
    """Every ``loss_scale/*`` text (reports, the policy) in the run(s) at ``path``: ``(tag, step, text)``."""
    out: list[tuple[str, int, str]] = []
    runs = event_files(path)
    for run, files in runs.items():
        prefix = f"{run}/" if len(runs) > 1 else ""
        texts = _read_files(files, [], []).ordered_texts()
        out.extend((prefix + tag, step, text) for tag, step, text in texts)
    return out


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "event_layouts": """
    >>> from tensorboard.compat.proto import event_pb2, summary_pb2
    >>> value = summary_pb2.Summary.Value(tag="loss_scale/scale", simple_value=1024.0)
    >>> data = event_pb2.Event(step=300, summary=summary_pb2.Summary(value=[value])).SerializeToString()
    >>> layout = layout_of(data)
    >>> [(tag, dtype) for tag, _, dtype in layout.values], layout.step
    ([('loss_scale/scale', '<f4')], (1, 2))
""",
    "records": """
    >>> crc32c_rows(np.frombuffer(b"123456789", dtype=np.uint8).reshape(1, -1)).tolist()  # the check value
    [3808858755]
""",
}


# ---------------------------------------- two writers at once
# Two writers at once in one TensorBoard folder: told apart from a restarted job by the events' wall times.
# A job that resumes writes a new event file after the old one's last event; two processes logging the
# loss scale into one folder at the same time open their files while the other still writes. Read one
# after the other, both look like a run whose steps went back (a restart): the reader refuses that instead.


def closed_at(path: str) -> float:
    """The wall time of a file's last complete event (its writer's last write); ``-inf`` if none.

    Walks the record headers only (a seek per record, no data read but the last record's); a length
    that runs past the end of the file ends the walk, so a damaged length costs nothing.
    """
    last = -1
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            offset = 0
            while offset + _HEADER <= size:
                handle.seek(offset)
                (length,) = struct.unpack("<Q", handle.read(8))
                end = offset + _HEADER + length + 4
                if end > size:
                    break
                last, offset = offset, end
            if last < 0:
                return -math.inf
            handle.seek(last)
            length = struct.unpack("<Q", handle.read(8))[0]
            handle.seek(last + _HEADER)
            return float(event_pb2.Event.FromString(handle.read(length)).wall_time)
    except (OSError, DecodeError, struct.error):
        return -math.inf


def check_one_writer_at_a_time(folder: str, writers: list[tuple[str, float]]) -> None:
    """Refuse a folder where a file with the loss scale was opened while another such file was still written.

    Args:
        folder: the run folder (for the message).
        writers: ``(path, opened_at)`` of each file with loss-scale series, in the order opened.

    Raises:
        RunReadError: two writers at once, naming both files and how to report each.
    """
    for (earlier, _), (later, opened) in itertools.pairwise(writers):
        last_write = closed_at(earlier)
        if opened < last_write:
            raise RunReadError(
                f"{folder}: two writers wrote the loss scale into this folder at the same time "
                f"({os.path.basename(earlier)} was still written after {os.path.basename(later)} was "
                "opened), so their steps would read as restarts; "
                f"give each run its own folder, or report one file: "
                f"`lossscale-callbacks report {later}`")
