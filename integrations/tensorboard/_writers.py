"""Two writers at once in one TensorBoard folder: told apart from a restarted job by the events' wall times.

A job that resumes writes a new event file after the old one's last event; two processes logging the
loss scale into one folder at the same time open their files while the other still writes. Read one
after the other, both look like a run whose steps went back (a restart): the reader refuses that instead.
"""

from __future__ import annotations

import itertools
import math
import os
import struct

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from lossscale_callbacks._run_readers import RunReadError

__all__ = ["check_one_writer_at_a_time", "closed_at"]

_HEADER = 12  # length (8 bytes) and its checksum (4); the data's checksum (4) follows the data


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
