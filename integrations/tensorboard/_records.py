"""Event files' records written fast: the framing with a CRC-32C in C, and scalar summaries encoded directly.

An event file is a sequence of records (``length``, its masked CRC-32C, the data, the data's masked
CRC-32C), each record one serialized ``Event``. TensorBoard's own ``RecordWriter`` computes the
checksums in pure Python, byte by byte (about 0.25 µs a byte: an event of a hundred scalars costs a
millisecond); ``google-crc32c`` (installed with the ``tensorboard`` extra) does it in C, and without
it the pure-Python checksum is used as before.

A step's scalars are the bulk of what the sinks write (the fp8 monitor writes every rebuilt step's
amax and scale: thousands of values a read), and building a protobuf object per value costs several
microseconds. :class:`ScalarEncoder` writes the bytes ``Event(step, wall_time,
Summary(value=[Value(tag, tensor=TensorProto(DT_FLOAT, scalar shape, float_val=[v]))]))`` serializes
to, from a prefix per tag made once: a value whose tag still needs its metadata (the first time in a
file) is built as a protobuf message, as before. ``tests/test_tensorboard_sink.py`` proves the bytes
equal to protobuf's own serialization.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

__all__ = ["RecordFile", "ScalarEncoder", "crc32c", "varint"]


def _pure_crc32c() -> Callable[[bytes], int]:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c

    return crc32c


try:  # the C implementation when installed (the tensorboard extra installs it)
    import google_crc32c

    crc32c: Callable[[bytes], int] = google_crc32c.value
except ImportError:  # pragma: no cover - exercised where the package is missing
    crc32c = _pure_crc32c()


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint (a negative int64 as its 64-bit two's complement)."""
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class RecordFile:
    """Writes records to an open binary file (the framing TensorBoard and TensorFlow read)."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle

    def write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._handle.write(header + _masked(header) + data + _masked(data))


# Value.tensor (field 8) = TensorProto{dtype: DT_FLOAT (1), tensor_shape: {} (a scalar), float_val: packed,
# one float}: its bytes but the float's.
_TENSOR_HEAD = b"\x42\x0a" + b"\x08\x01" + b"\x12\x00" + b"\x2a\x04"


def _float32(value: float) -> bytes:
    """``value`` as protobuf stores a double in a float field: a C cast, rounded to the nearest float32,
    an infinity where that overflows (where ``struct`` raises instead)."""
    try:
        return struct.pack("<f", value)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, value))


class ScalarEncoder:
    """A step's scalars as the bytes of one serialized ``Event`` (see the module docstring).

    Args:
        described: the tags already described in the file (the metadata goes with a tag's first value);
            the encoder adds the tags it describes.
        value_message: makes the protobuf ``Summary.Value`` of a tag's first value (with its metadata).
    """

    def __init__(self, described: set[str], value_message: Callable[[str, float], Any]) -> None:
        self._described = described
        self._value_message = value_message
        self._prefix: dict[str, bytes] = {}

    def reset(self, described: set[str]) -> None:
        """A new file: its own set of described tags."""
        self._described = described

    def _entry(self, tag: str, value: float) -> bytes:
        """``tag``'s value as an entry of ``Summary.value`` (its field key and length, then the message)."""
        prefix = self._prefix.get(tag)
        if prefix is not None and tag in self._described:
            return prefix + _float32(value)
        if tag not in self._described:
            encoded = self._value_message(tag, value).SerializeToString()
            return b"\x0a" + varint(len(encoded)) + encoded
        name = tag.encode("utf-8")  # an empty tag is not written (proto3 leaves out an empty string)
        head = (b"\x0a" + varint(len(name)) + name if name else b"") + _TENSOR_HEAD
        # A described tag's value always has the same length: the entry's key and length go in the prefix.
        prefix = self._prefix[tag] = b"\x0a" + varint(len(head) + 4) + head
        return prefix + _float32(value)

    def event(self, wall_time: float, step: int, metrics: dict[str, float]) -> bytes:
        """The serialized ``Event`` of ``step``'s ``metrics`` (values as floats)."""
        summary = b"".join([self._entry(tag, value) for tag, value in metrics.items()])
        head = b"\x09" + struct.pack("<d", wall_time) if wall_time != 0 else b""
        if step != 0:
            head += b"\x10" + varint(step)
        return head + b"\x2a" + varint(len(summary)) + summary
