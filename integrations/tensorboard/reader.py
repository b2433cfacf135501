"""Read a TensorBoard run's ``loss_scale/*`` series back, fast, for ``lossscale-callbacks report``.

Scalars come in two encodings: ``simple_value`` (torch's ``SummaryWriter``, Lightning's
``TensorBoardLogger``, TF1) and rank-0 tensors (``tf.summary`` in TF2 and Keras 3, and
:class:`~lossscale_callbacks.tensorboard.TensorBoardSink`); both are read. Text summaries (the
reports, the policy) are rank-0 string tensors.

The reader streams the file record by record and parses only the records that mention
``loss_scale/``: a run whose event files hold a million other events (per-batch losses,
histograms, images) is read in seconds and in little memory (``benchmarks/report_read.py``).
Record checksums are not verified (a pure-Python CRC would cost more than everything else);
a file that is not an event file, or whose records do not parse, is reported as corrupt. A
truncated last record is what a run still being written looks like, and ends the file quietly.
Neither TensorFlow nor torch is imported.

Example:
    >>> from lossscale_callbacks.tensorboard.reader import read_run
    >>> series = read_run("runs/fp16")                      # doctest: +SKIP
    >>> series["loss_scale/scale"][:2]                      # doctest: +SKIP
    [(100, 32768.0), (200, 32768.0)]
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, types_pb2

from lossscale_callbacks.policy_text import policy_bounds_from_markdown, policy_values_from_markdown
from lossscale_callbacks.run_readers import GROWTH_INTERVAL, MAX_SCALE, MIN_SCALE, RunReadError
from lossscale_callbacks.sinks import POLICY_TAG

__all__ = ["RunReadError", "event_files", "iter_events", "read_run", "read_texts", "run_folders"]

_EVENT_MARK = "tfevents"
_WANTED = b"loss_scale/"
_HEADER = struct.Struct("<Q")
_FLOATS = {types_pb2.DT_FLOAT: "float_val", types_pb2.DT_DOUBLE: "double_val", types_pb2.DT_HALF: "half_val",
           types_pb2.DT_BFLOAT16: "half_val"}
_INTS = {types_pb2.DT_INT32: "int_val", types_pb2.DT_INT64: "int64_val", types_pb2.DT_BOOL: "bool_val"}


def _is_event_file_name(name: str) -> bool:
    return _EVENT_MARK in name and not name.endswith((".tmp", ".lock"))


def _is_regular_file(path: str) -> bool:
    # A FIFO, socket or device named like an event file would block or fail when opened.
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _event_files_in(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names
            if _is_event_file_name(n) and _is_regular_file(os.path.join(folder, n))]


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
        if not _is_event_file_name(os.path.basename(path)):
            raise RunReadError(f"{path}: not a TensorBoard event file (its name has no 'tfevents')")
        if not _is_regular_file(path):
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


def _records(file_path: str) -> Iterator[bytes]:
    """The file's first record, then those whose data mention ``loss_scale/`` (the rest are skipped)."""
    size = os.path.getsize(file_path)
    position = good = 0
    with open(file_path, "rb") as handle:
        while position < size:
            header = handle.read(12)  # the data's length (8 bytes) and its checksum (4)
            if len(header) < 12:
                break
            (length,) = _HEADER.unpack_from(header)
            position += 12 + length + 4
            if position > size:
                break
            data = handle.read(length)
            handle.seek(4, os.SEEK_CUR)  # the data's checksum
            good += 1
            if good == 1 or _WANTED in data:
                yield data
        else:
            return
    if good:
        return  # a truncated last record: the file of a run still being written
    raise RunReadError(f"{file_path}: corrupt TensorBoard event file (its first record runs past the end "
                       "of the file)")


def iter_events(file_path: str) -> Iterator[event_pb2.Event]:
    """The events of one file that carry ``loss_scale/`` tags (and the file's first event)."""
    first = True
    for record in _records(file_path):
        try:
            event = event_pb2.Event.FromString(record)
        except DecodeError as exc:
            raise RunReadError(f"{file_path}: corrupt TensorBoard event file ({exc})") from None
        if first:
            first = False
            if not event.file_version.startswith("brain.Event"):
                raise RunReadError(f"{file_path}: not a TensorBoard event file (no file version event)")
        yield event


def _number(value: event_pb2.summary_pb2.Summary.Value) -> float | None:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if not value.HasField("tensor"):
        return None
    tensor = value.tensor
    if tensor.tensor_shape.dim:  # rank-0 only
        return None
    field = _FLOATS.get(tensor.dtype) or _INTS.get(tensor.dtype)
    if field is None:
        return None
    values = getattr(tensor, field)
    if values:
        return float(values[0])
    if tensor.tensor_content:  # numpy-written tensors keep their bytes here
        import numpy as np

        dtype = {types_pb2.DT_FLOAT: np.float32, types_pb2.DT_DOUBLE: np.float64,
                 types_pb2.DT_HALF: np.float16, types_pb2.DT_INT32: np.int32, types_pb2.DT_INT64: np.int64,
                 types_pb2.DT_BOOL: np.bool_}
        kind = dtype.get(tensor.dtype)
        return float(np.frombuffer(tensor.tensor_content, dtype=kind)[0]) if kind is not None else None
    return 0.0  # proto3 leaves a zero out of the repeated field


def _text(value: event_pb2.summary_pb2.Summary.Value) -> str | None:
    tensor = value.tensor if value.HasField("tensor") else None
    if tensor is None or tensor.dtype != types_pb2.DT_STRING or not tensor.string_val:
        return None
    return tensor.string_val[0].decode("utf-8", "replace")


_Points = list[tuple[float, int, float]]  # (wall time, step, value)


def _read_files(files: list[str]) -> tuple[dict[str, _Points], list[tuple[str, int, str]]]:
    scalars: dict[str, _Points] = {}
    texts: list[tuple[str, int, str]] = []
    for file_path in files:
        for event in iter_events(file_path):
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                tag = value.tag
                if "loss_scale/" not in tag:
                    continue
                text = _text(value)
                if text is not None:
                    texts.append((tag, int(event.step), text))
                    continue
                number = _number(value)
                if number is not None:
                    scalars.setdefault(tag, []).append((event.wall_time, int(event.step), number))
    return scalars, texts


def _sorted(points: _Points) -> list[tuple[int, float]]:
    # Python's sort is stable: points of one step keep their order of writing.
    return [(step, value) for _, step, value in sorted(points, key=lambda p: p[1])]


def read_run(path: str) -> dict[str, list[tuple[int, float]]]:
    """Every ``loss_scale/*`` series in a TensorBoard run folder (or one event file), sorted by step.

    Several event files in one folder (a resumed run, or this library's sink writing next to
    Keras' ``TensorBoard`` callback) are merged. When ``path`` holds no event file itself but
    several runs below it (Keras' ``train/`` and ``validation/``), each tag is prefixed with
    its run (``train/loss_scale/scale``); with one run below it, tags are left as they are. The
    policy's bounds, written once as the ``loss_scale/policy`` text, come back as one-point
    ``loss_scale/min_scale`` and ``loss_scale/max_scale`` series (older runs wrote those series
    at every interval; both read the same).

    Raises:
        RunReadError: nothing at ``path``, no event file, or a corrupt event file.
    """
    runs = event_files(path)
    merged: dict[str, list[tuple[int, float]]] = {}
    for run, files in runs.items():
        scalars, texts = _read_files(files)
        prefix = f"{run}/" if len(runs) > 1 else ""
        for tag, points in scalars.items():
            merged[prefix + tag] = _sorted(points)
        policy = [(step, text) for tag, step, text in texts if tag == POLICY_TAG]
        if policy:
            step, text = policy[-1]
            bounds = policy_bounds_from_markdown(text)
            if bounds is not None:
                merged.setdefault(prefix + MIN_SCALE, [(step, bounds[0])])
                merged.setdefault(prefix + MAX_SCALE, [(step, bounds[1])])
            interval = policy_values_from_markdown(text).get("growth_interval", "")
            if interval.isdigit():
                merged.setdefault(prefix + GROWTH_INTERVAL, [(step, float(interval))])
    return merged


def read_texts(path: str) -> list[tuple[str, int, str]]:
    """Every ``loss_scale/*`` text (reports, the policy) in the run(s) at ``path``: ``(tag, step, text)``."""
    out: list[tuple[str, int, str]] = []
    runs = event_files(path)
    for run, files in runs.items():
        prefix = f"{run}/" if len(runs) > 1 else ""
        out.extend((prefix + tag, step, text) for tag, step, text in _read_files(files)[1])
    return out
