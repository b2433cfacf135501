"""Read a TensorBoard run's ``loss_scale/*`` series back, fast and verified, for the report command.

Scalars come in two encodings: ``simple_value`` (torch's ``SummaryWriter``, Lightning's
``TensorBoardLogger``, TF1) and rank-0 tensors (``tf.summary`` in TF2 and Keras 3, and
:class:`~lossscale_callbacks.tensorboard.TensorBoardSink`); both are read. Text summaries (the
reports, the policy) are rank-0 string tensors.

The reader streams each file in chunks and keeps only the records that mention ``loss_scale/``
(:mod:`~lossscale_callbacks.tensorboard.records`), verifying the checksum of every record length
and of every record it keeps: a flipped bit is reported as damage and the record left out, never
read as a loss scale of 2**31. The records a sink writes at every interval share one layout and are
decoded together by NumPy (:mod:`~lossscale_callbacks.tensorboard.event_layouts`); the others are
parsed by protobuf. A run whose event files hold a million other events is read in about a second
(``benchmarks/report_read.py``). Series keep the order the records were written in (a restarted
run's steps go back; the report tells the restarts apart). A file that ends inside a record (a run
still being written) is read up to there, with a note. Neither TensorFlow nor torch is imported.

Example:
    >>> from lossscale_callbacks.tensorboard.reader import read_run
    >>> series = read_run("runs/fp16")                      # doctest: +SKIP
    >>> series["loss_scale/scale"][:2]                      # doctest: +SKIP
    [(100, 32768.0), (200, 32768.0)]
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Sequence

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, types_pb2

from lossscale_callbacks.metrics import SCALE as SCALE_TAG
from lossscale_callbacks.policy_text import policy_bounds_from_markdown, policy_values_from_markdown
from lossscale_callbacks.run_discovery import is_event_file_name, is_regular_file
from lossscale_callbacks.run_readers import GROWTH_INTERVAL, MAX_SCALE, MIN_SCALE, RunReadError, RunSeries
from lossscale_callbacks.sinks import POLICY_TAG
from lossscale_callbacks.tensorboard._writers import check_one_writer_at_a_time
from lossscale_callbacks.tensorboard.event_layouts import Layout, decode_rows, layout_of, match_rows
from lossscale_callbacks.tensorboard.records import FileReading, RecordRows, iter_record_batches

__all__ = ["RunReadError", "event_files", "iter_events", "read_run", "read_texts", "run_folders"]

_WANTED = b"loss_scale/"
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
            if "loss_scale/" in tag:
                self.columns.setdefault(tag, []).append((places, steps, column))

    def _parse_one(self, file_path: str, index: int, data: bytes) -> None:
        event = _parse(file_path, data)
        for value in event.summary.value:
            if "loss_scale/" not in value.tag:
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
    collector = _Collector()
    writers = []  # the files that hold the loss scale: one at a time, or two writers (see _writers)
    for number, file_path in enumerate(files):
        reading = FileReading(file_path)
        before = collector.scale_points()
        for groups in _batches(file_path, reading):
            collector.add(file_path, number, groups)
        damage.extend(reading.damage)
        notes.extend([reading.ended_early] if reading.ended_early else [])
        if collector.scale_points() > before:
            writers.append((file_path, _opened_at(file_path)))
    if len(writers) > 1:
        check_one_writer_at_a_time(os.path.dirname(files[0]), writers)
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
