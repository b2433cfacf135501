"""Read every scalar series of a TensorBoard run back, with TensorBoard's own record reader and compat layers.

Scalars come in two encodings: ``simple_value`` (torch's ``SummaryWriter``, Lightning's
``TensorBoardLogger``, TF1) and rank-0 tensors with the ``scalars`` plugin (``tf.summary`` in
TF2 and Keras 3, and :class:`~lossscale_callbacks.tensorboard.TensorBoardSink`). TensorBoard's
``data_compat`` layer turns the first into the second, so both are read the same way.

Records are read with TensorBoard's pure-Python record reader (CRC-checked), so reading a run
never imports TensorFlow: ``lossscale-callbacks report`` starts in a fraction of a second.

Example:
    >>> from lossscale_callbacks.tensorboard.reader import read_run
    >>> series = read_run("runs/fp16")                      # doctest: +SKIP
    >>> series["loss_scale/scale"][:2]                      # doctest: +SKIP
    [(100, 32768.0), (200, 32768.0)]
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from tensorboard import data_compat, dataclass_compat
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub import errors as tb_errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.util import tensor_util

from lossscale_callbacks.report import RunReadError

__all__ = ["RunReadError", "event_files", "iter_events", "read_run", "read_texts"]

_EVENT_MARK = "tfevents"
_NUMERIC_KINDS = ("b", "i", "u", "f")


def _is_event_file(name: str) -> bool:
    return _EVENT_MARK in name and not name.endswith((".tmp", ".lock"))


def _run_dirs(root: str) -> list[str]:
    """Folders under ``root`` (itself included) that hold event files, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        if any(_is_event_file(f) for f in files):
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
    if os.path.isfile(path):
        if not _is_event_file(os.path.basename(path)):
            raise RunReadError(f"{path}: not a TensorBoard event file (its name has no 'tfevents')")
        return {"": [path]}
    direct = sorted(f for f in os.listdir(path)
                    if _is_event_file(f) and os.path.isfile(os.path.join(path, f)))
    if direct:
        return {"": [os.path.join(path, f) for f in direct]}
    runs = {}
    for folder in _run_dirs(path):
        rel = os.path.relpath(folder, path).replace(os.sep, "/")
        runs[rel] = sorted(os.path.join(folder, f) for f in os.listdir(folder) if _is_event_file(f))
    if not runs:
        raise RunReadError(f"{path}: no TensorBoard run here (no events.out.tfevents.* file in it or below)")
    return runs


def _raw_records(file_path: str) -> Iterator[bytes]:
    reader = pywrap_tensorflow.PyRecordReader_New(file_path)
    good = 0
    try:
        while True:
            try:
                reader.GetNext()
            except tb_errors.OutOfRangeError:
                return
            except tb_errors.DataLossError as exc:
                # A truncated last record is what a run still being written looks like;
                # anything else (a bad checksum, garbage from the start) is a corrupt file.
                if good and "truncated" in str(exc):
                    return
                raise RunReadError(f"{file_path}: corrupt TensorBoard event file ({exc})") from None
            good += 1
            yield reader.record()
    finally:
        reader.file_handle.close()


def iter_events(file_path: str) -> Iterator[event_pb2.Event]:
    """Events of one file, through TensorBoard's read-time compat layers (``simple_value`` to tensor)."""
    initial_metadata: dict[str, summary_pb2.SummaryMetadata] = {}
    for record in _raw_records(file_path):
        try:
            event = event_pb2.Event.FromString(record)
        except Exception as exc:  # protobuf's DecodeError; a record that is not an Event
            raise RunReadError(f"{file_path}: corrupt TensorBoard event file ({exc})") from None
        yield from dataclass_compat.migrate_event(data_compat.migrate_event(event), initial_metadata)


def _scalar(value: summary_pb2.Summary.Value, plugin: str | None) -> float | None:
    if not value.HasField("tensor"):
        return None
    if plugin not in (None, scalar_metadata.PLUGIN_NAME):
        return None
    try:
        array = tensor_util.make_ndarray(value.tensor)
    except Exception:  # dtypes numpy cannot hold (resources, variants) are not scalars anyway
        return None
    if array.shape != () or array.dtype.kind not in _NUMERIC_KINDS:
        return None
    return float(array.item()) if array.dtype.kind != "b" else float(bool(array.item()))


_Points = list[tuple[float, int, float]]  # (wall time, step, value)


def _read_files(files: list[str]) -> tuple[dict[str, _Points], list[tuple[str, int, str]]]:
    scalars: dict[str, _Points] = {}
    texts: list[tuple[str, int, str]] = []
    for file_path in files:
        plugins: dict[str, str] = {}  # metadata is written with the first value of a tag only
        for event in iter_events(file_path):
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name:
                    plugins[value.tag] = value.metadata.plugin_data.plugin_name
                plugin = plugins.get(value.tag)
                if plugin == "text" and value.HasField("tensor"):
                    array = tensor_util.make_ndarray(value.tensor)
                    item = array.reshape(-1)[0] if array.size else b""
                    texts.append((value.tag, int(event.step),
                                  item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)))
                    continue
                number = _scalar(value, plugin)
                if number is not None:
                    scalars.setdefault(value.tag, []).append((event.wall_time, int(event.step), number))
    return scalars, texts


def _sorted(points: _Points) -> list[tuple[int, float]]:
    # Python's sort is stable: points of one step keep their order of writing.
    return [(step, value) for _, step, value in sorted(points, key=lambda p: p[1])]


def read_run(path: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard run folder (or one event file), by tag, sorted by step.

    Several event files in one folder (a resumed run, or this library's sink writing next to
    Keras' ``TensorBoard`` callback) are merged. When ``path`` holds no event file itself but
    several runs below it (Keras' ``train/`` and ``validation/``), each tag is prefixed with
    its run (``train/epoch_loss``); with one run below it, tags are left as they are.

    Raises:
        RunReadError: nothing at ``path``, no event file, or a corrupt event file.
    """
    runs = event_files(path)
    merged: dict[str, list[tuple[int, float]]] = {}
    for run, files in runs.items():
        scalars, _ = _read_files(files)
        prefix = f"{run}/" if len(runs) > 1 else ""
        for tag, points in scalars.items():
            merged[prefix + tag] = _sorted(points)
    return merged


def read_texts(path: str) -> list[tuple[str, int, str]]:
    """Every text summary (markdown reports) in the run(s) at ``path``: ``(tag, step, text)``."""
    out: list[tuple[str, int, str]] = []
    runs = event_files(path)
    for run, files in runs.items():
        prefix = f"{run}/" if len(runs) > 1 else ""
        out.extend((prefix + tag, step, text) for tag, step, text in _read_files(files)[1])
    return out

