"""Decode many scalar events at once: the records of one *layout* differ only in their numbers.

A sink writes the same event at every log interval: the same tags, the same tensor types; only the
wall time, the step and the values change. Records with the same length whose other bytes are all
equal have the same protobuf structure, so their numbers sit at the same offsets. The first record
of such a layout is walked field by field (a small wire-format walker for ``Event`` → ``Summary`` →
``Summary.Value`` → ``TensorProto`` that knows where a scalar's bytes are); every record matching it is
then decoded by NumPy, column by column, instead of one protobuf parse and a dozen attribute reads
per value. What the layout leaves free is exactly what cannot change the structure: the wall time
(8 fixed bytes), the float32/float64 values (fixed bytes) and the step's varint bits (its length, held
by the continuation bits, must match). Records that fit no layout (the first record, texts,
histograms, integer tensors) are parsed by protobuf, as before.

Example:
    >>> from tensorboard.compat.proto import event_pb2, summary_pb2
    >>> value = summary_pb2.Summary.Value(tag="loss_scale/scale", simple_value=1024.0)
    >>> data = event_pb2.Event(step=300, summary=summary_pb2.Summary(value=[value])).SerializeToString()
    >>> layout = layout_of(data)
    >>> [(tag, dtype) for tag, _, dtype in layout.values], layout.step
    ([('loss_scale/scale', '<f4')], (1, 2))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

__all__ = ["Layout", "decode_rows", "layout_of", "match_rows"]

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
