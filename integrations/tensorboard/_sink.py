"""TensorBoard sink: loss-scale metrics as scalars, reports as markdown text, a ready "Loss scale" view.

Writes TensorBoard event files with the ``tensorboard`` package alone (its protobuf classes; the
records framed and a step's scalars encoded by :mod:`lossscale_callbacks.tensorboard._records`):
neither TensorFlow nor torch is imported, so the sink costs nothing to import and works in a plain
NumPy loop, a Keras run and a Lightning run alike.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import warnings
from collections.abc import Mapping, Sequence

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata

from lossscale_callbacks.integration import (
    DASHBOARD_CHARTS,
    DASHBOARD_SECTION,
    POLICY_TAG,
    ManagedSink,
    check_number,
    user_stacklevel,
)
from lossscale_callbacks.tensorboard._records import RecordFile, ScalarEncoder

__all__ = ["LAYOUT_CATEGORY", "LogDirRemovedWarning", "TensorBoardSink", "loss_scale_layout"]

LAYOUT_CATEGORY = DASHBOARD_SECTION
_SCALAR_SHAPE = tensor_shape_pb2.TensorShapeProto()
_file_ids = itertools.count()


class LogDirRemovedWarning(UserWarning):
    """The event file (its log directory) was deleted while the sink wrote it; a new one was started."""


def loss_scale_layout() -> layout_pb2.Layout:
    """The Custom Scalars layout: one "Loss scale" section with a chart per metric, log2 scale first."""
    charts = [layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=[f"^{tag}$"]))
              for title, tag in DASHBOARD_CHARTS]
    return layout_pb2.Layout(category=[layout_pb2.Category(title=LAYOUT_CATEGORY, chart=charts)])


class _EventFileWriter:
    """Appends events to one event file, opened on the first write (a sink that never writes leaves none).

    Writes go through a buffered file on the calling thread: one event per ``write`` (all
    metrics of a step in one summary) costs tens of microseconds, paid once per log interval.
    The buffer reaches the disk on :meth:`flush`, on :meth:`close`, and with the first write
    that comes ``flush_secs`` or more after the last flush (there is no background thread),
    so a running TensorBoard sees the run progress one log interval late at most.
    """

    def __init__(self, log_dir: str, flush_secs: float, filename_suffix: str) -> None:
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self.filename_suffix = filename_suffix
        # Two threads writing the first event at once (a training thread and a monitoring one)
        # must not open two files: opening and every write hold this lock.
        self._lock = threading.RLock()
        self.path: str | None = None
        self._file = None
        self._records: RecordFile | None = None
        self._described: set[str] = set()
        self._encoder = ScalarEncoder(self._described, self._scalar)
        self._last_flush = 0.0
        self._last_step = 0
        self._policy_text: str | None = None  # written again into a file that replaces a deleted one

    def _removed(self) -> bool:
        """Whether the open event file was deleted (its folder removed): one ``fstat``, no path lookup."""
        return self._file is not None and os.fstat(self._file.fileno()).st_nlink == 0

    def _reopen_removed(self) -> None:
        """A deleted file takes every later write with it: warn, and go on in a new file in a new folder.

        Starting again (rather than giving up) keeps the rest of the run, which is what someone who
        cleaned a folder mid-run still wants to see; the policy text goes into the new file too, so
        the report can read the run's bounds from it.
        """
        gone, handle = self.path, self._file
        self._file, self._records = None, None
        try:
            handle.close()
        except OSError:  # the data it held is gone with the file; nothing to save
            pass
        warnings.warn(f"[lossscale-callbacks] the TensorBoard event file {gone} was deleted (its log "
                      "directory removed) while this run wrote it: what it held is lost; writing on into a "
                      f"new event file in {self.log_dir}.", LogDirRemovedWarning,
                      stacklevel=user_stacklevel())
        self._open()
        if self._policy_text is not None:
            self._text(POLICY_TAG, self._policy_text)

    def _open(self) -> RecordFile:
        if self._records is not None:
            if not self._removed():
                return self._records
            self._reopen_removed()
            assert self._records is not None
            return self._records
        os.makedirs(self.log_dir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_file_ids)}{self.filename_suffix}")
        path = os.path.join(self.log_dir, name)
        handle = open(path, "wb")  # kept open for the life of the sink; closed in close()
        self._file, self.path = handle, path
        self._records = RecordFile(handle)
        self._described = set()
        self._encoder.reset(self._described)
        self._emit(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        layout = loss_scale_layout().SerializeToString()
        value = summary_pb2.Summary.Value(
            tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
            metadata=custom_scalar_metadata.create_summary_metadata(),
            tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=_SCALAR_SHAPE,
                                          string_val=[layout]),
        )
        self._emit(event_pb2.Event(wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=[value])))
        self._file.flush()
        self._last_flush = time.monotonic()
        return self._records

    def _emit(self, event: event_pb2.Event) -> None:
        assert self._records is not None
        self._records.write(event.SerializeToString())

    def _metadata(self, tag: str, plugin: str) -> summary_pb2.SummaryMetadata | None:
        # Like tf.summary, describe a tag once per file; readers carry it forward.
        if tag in self._described:
            return None
        self._described.add(tag)
        if plugin == "text":
            return text_metadata.create_summary_metadata(display_name=None, description=None)
        if plugin == "histograms":
            return histogram_metadata.create_summary_metadata(display_name=None, description=None)
        return scalar_metadata.create_summary_metadata(display_name=None, description=None)

    def _scalar(self, tag: str, value: float) -> summary_pb2.Summary.Value:
        # float32, as tf.summary writes scalars: TensorBoard's default (fast, Rust) loader drops
        # float64 ones. Loss scales are powers of two and the counts are far below 2**24, so both
        # are exact; only the skip rate rounds (to 7 significant digits).
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=_SCALAR_SHAPE,
                                        float_val=[value])
        return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=self._metadata(tag, "scalars"))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        with self._lock:
            records = self._open()
            self._last_step = int(step)
            values = {tag: float(value) for tag, value in metrics.items()}
            records.write(self._encoder.event(time.time(), self._last_step, values))
            self._maybe_flush()

    def write_text(self, tag: str, markdown: str) -> None:
        with self._lock:
            self._open()
            self._text(tag, markdown)
            if tag == POLICY_TAG:
                self._policy_text = markdown
            self._maybe_flush()

    def _text(self, tag: str, markdown: str) -> None:
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=_SCALAR_SHAPE,
                                        string_val=[markdown.encode("utf-8")])
        value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=self._metadata(tag, "text"))
        self._emit(event_pb2.Event(wall_time=time.time(), step=self._last_step,
                                   summary=summary_pb2.Summary(value=[value])))

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        # tf.summary.histogram's format: a [k, 3] float64 tensor of (left edge, right edge, count),
        # which TensorBoard's default loader reads.
        with self._lock:
            self._open()
            rows = [(float(edges[i]), float(edges[i + 1]), float(c)) for i, c in enumerate(counts)]
            dim = tensor_shape_pb2.TensorShapeProto.Dim
            shape = tensor_shape_pb2.TensorShapeProto(dim=[dim(size=len(rows)), dim(size=3)])
            tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_shape=shape,
                                            double_val=[v for row in rows for v in row])
            metadata = self._metadata(tag, "histograms")
            value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)
            self._emit(event_pb2.Event(wall_time=time.time(), step=int(step),
                                       summary=summary_pb2.Summary(value=[value])))
            self._maybe_flush()

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_secs:
            self.flush()
            self._last_flush = now

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                if self._removed():
                    self._open()  # warns, and carries on in a new file
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            handle, self._file, self._records = self._file, None, None
            if handle is not None:
                handle.close()  # flushes first; the next write opens a new file


class TensorBoardSink(ManagedSink):
    """Writes the loss-scale metrics to TensorBoard event files, with a ready "Loss scale" view.

    Scalars use the metric schema's names (``loss_scale/scale``, ``loss_scale/log2_scale``,
    ``loss_scale/growth_counter``, ``loss_scale/skipped_steps``, ``loss_scale/skipped_in_interval``,
    ``loss_scale/skip_rate``) against the step axis of optimizer steps *attempted* (skipped steps
    included), as float32 tensors like ``tf.summary`` writes them, which TensorBoard's default
    loader reads (it drops float64 scalars). :meth:`write_text` stores markdown reports for the
    Text tab, among them the policy (settings and bounds), written once per run by the logging
    loop. A Custom Scalars layout puts every metric into one "Loss scale" section, the scale's
    exponent (``log2_scale``) first, so the scale is readable instead of hugging zero on an axis
    up to 2**24.

    ``log_dir`` may be the same folder Keras' ``TensorBoard`` callback writes to (e.g.
    ``logs/train``): each writer has its own event file and TensorBoard merges them.

    A write costs a few microseconds plus about one per value (``benchmarks/sink_write.py``): the
    records' checksum in C (``google-crc32c``, with the ``tensorboard`` extra) and a step's scalars
    encoded without a protobuf object per value (:mod:`lossscale_callbacks.tensorboard._records`).

    Neither TensorFlow nor torch is imported. Nothing is created until the first write, and
    only on rank 0 (see :func:`lossscale_callbacks._ranks.process_rank`); writes from several
    threads go to one file. A failure (the folder cannot be created, the disk is full) is warned
    once and disables the sink; training and the other sinks go on. The file is flushed on
    :meth:`flush`, on :meth:`close`, by the first write that comes ``flush_secs`` or more after
    the last flush (no background thread: the values of the last write wait for the next write,
    :meth:`flush` or :meth:`close`), and closed at interpreter exit.

    A log directory deleted while the sink writes (a cleanup script, a user emptying ``runs/``)
    takes the open event file with it, and every later write would go to a file nobody can read.
    The sink notices before its next write (the file has no link left; one ``fstat``), warns once
    with a :class:`LogDirRemovedWarning` and goes on in a new event file in a recreated folder,
    with the policy text again: the rest of the run is kept, rather than dropped by a sink that
    stops. What the deleted file held is gone.

    Args:
        log_dir: the run folder to write into (created when needed).
        flush_secs: a write flushes the file when the last flush is at least this many
            seconds old (0: every write flushes).
        filename_suffix: appended to the event file's name.
        all_ranks: write on every rank (give each rank its own ``log_dir`` then).

    Raises:
        ValueError: an argument is invalid (``log_dir`` empty, ``flush_secs`` negative...), named.

    Example:
        >>> from lossscale_callbacks.tensorboard import TensorBoardSink
        >>> sink = TensorBoardSink("runs/fp16")  # doctest: +SKIP
        >>> sink.write(100, {"loss_scale/scale": 32768.0, "loss_scale/skip_rate": 0.01})  # doctest: +SKIP
        >>> sink.close()  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_secs: float = 5.0, filename_suffix: str = "",
                 all_ranks: bool = False) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise ValueError(f"log_dir must be a non-empty path (str or os.PathLike), got {log_dir!r}")
        check_number("flush_secs", flush_secs, 0.0)
        if not isinstance(filename_suffix, str):
            raise ValueError(f"filename_suffix must be a str, got {filename_suffix!r}")
        self.log_dir = os.fspath(log_dir)
        self._writer = _EventFileWriter(self.log_dir, float(flush_secs), filename_suffix)
        super().__init__(self._writer, name=f"TensorBoard ({self.log_dir})", all_ranks=all_ranks)

    @property
    def path(self) -> str | None:
        """The event file being written (None before the first write or on other ranks)."""
        return self._writer.path

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        """A histogram for the Histograms/Distributions tabs (``len(edges) == len(counts) + 1``)."""
        self._call("write_histogram", step, tag, edges, counts)

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.log_dir!r})"
