"""Read a W&B offline run back from its ``.wandb`` file, with the protobuf classes in ``wandb.proto``.

The ``.wandb`` file is a LevelDB-style log: a 7-byte header (``:W&B``, magic ``0xBEE1``,
version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of the chunk type
and data, length, type: full/first/middle/last). Each reassembled record is a serialized
``wandb.proto.wandb_internal_pb2.Record``. W&B no longer ships a Python reader for it (the
file is written by its Go service), so this module decodes the framing itself and leaves
the record contents to W&B's own protobuf classes. The file is read one block at a time and a
record longer than 16 MiB is never held (it is left out, as damage): memory stays bounded whatever
the file holds. A file that ends inside a record (a run still being written, or a copy cut short)
is read up to there with a note, by the rule every reader shares
(:func:`~lossscale_callbacks.report._run_readers.ended_inside_record`); so is a run without its exit record.

History values are JSON (W&B stores ``1024.0`` as ``1024``); every number is returned as a
float. A metric put on a custom axis with ``define_metric(..., step_metric=...)`` is returned
against that axis (``loss_scale/*`` against ``loss_scale/step``, the optimizer steps
attempted); other metrics against W&B's ``_step``.

Example:
    >>> from lossscale_callbacks.wandb._reader import read_run, read_run_info
    >>> read_run("wandb/offline-run-20250101_120000-abc123")["loss_scale/scale"][:1]  # doctest: +SKIP
    [(100, 32768.0)]
    >>> info = read_run_info("wandb/offline-run-20250101_120000-abc123")  # doctest: +SKIP
    >>> info.summary["loss_scale/final_scale"]  # doctest: +SKIP
    32768.0
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

from wandb.proto import wandb_internal_pb2

from lossscale_callbacks.integration import (
    GROWTH_INTERVAL,
    MAX_SCALE,
    MIN_SCALE,
    SCALE,
    RunReadError,
    RunSeries,
    ended_inside_record,
)

__all__ = [
    "RunInfo",
    "RunReadError",
    "find_run_file",
    "iter_records",
    "read_run",
    "read_run_info",
    "read_tables",
    "wait_until_finished",
]

_HEADER = struct.Struct("<4sHB")
_IDENT, _MAGIC, _VERSION = b":W&B", 0xBEE1, 0
_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_MAX_RECORD = 16 * 2**20  # a record is held whole to be parsed: longer ones are left out
_READ = 32 * _BLOCK  # bytes read at once (whole blocks)
_STEP = "_step"


def find_run_file(path: str) -> str:
    """The ``.wandb`` file of the run at ``path``.

    ``path`` may be the file itself, the run folder (``offline-run-*``/``run-*``), or a
    ``wandb/`` folder (or its parent) holding exactly one run.

    Raises:
        RunReadError: nothing at ``path``, no run there, or several runs to choose from.
    """
    if not os.path.exists(path):
        raise RunReadError(f"{path}: no such file or folder")
    if os.path.isfile(path):
        if not path.endswith(".wandb"):
            raise RunReadError(f"{path}: not a W&B run file (expected a .wandb file)")
        return path
    here = sorted(f for f in os.listdir(path) if f.endswith(".wandb"))
    if len(here) == 1:
        return os.path.join(path, here[0])
    if len(here) > 1:
        raise RunReadError(f"{path}: several .wandb files ({', '.join(here)}); name one")
    folder = os.path.join(path, "wandb") if os.path.isdir(os.path.join(path, "wandb")) else path
    runs = sorted(
        d for d in os.listdir(folder)
        if d.startswith(("offline-run-", "run-")) and os.path.isdir(os.path.join(folder, d))
        and any(f.endswith(".wandb") for f in os.listdir(os.path.join(folder, d)))
    )
    if not runs:
        raise RunReadError(f"{path}: no W&B run here (no .wandb file, no offline-run-* folder)")
    if len(runs) > 1:
        raise RunReadError(f"{path}: {len(runs)} W&B runs here ({', '.join(runs[:3])}"
                           f"{', ...' if len(runs) > 3 else ''}); name one run folder")
    return find_run_file(os.path.join(folder, runs[0]))


def _chunk_crc(kind: int, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF


@dataclasses.dataclass
class _Framing:
    """Where the chunk walk of one file stands: the record being put together, and what was found."""

    path: str
    damage: list[str]
    notes: list[str]
    produced: int = 0
    pending: bytearray | None = None  # the chunks so far of a record that spans blocks
    started: int = 0  # the byte where the pending (or the oversized) record starts
    oversized: bool = False  # stepping over a record longer than _MAX_RECORD

    def cut_short(self, offset: int) -> None:
        at = self.started if self.pending is not None or self.oversized else offset
        self.notes.append(ended_inside_record(self.path, at, self.produced))

    def take(self, kind: int, body: memoryview, at: int) -> bytes | None:
        """One chunk's data: the record it completes, or None (held, or stepped over: see the module)."""
        if kind in (_FULL, _FIRST):
            self.pending, self.oversized, self.started = None, False, at
            if kind == _FULL:
                self.produced += 1
                return bytes(body)
            self.pending = bytearray(body)
            return None
        if self.pending is None and not self.oversized:
            raise RunReadError(f"{self.path}: corrupt W&B run file (record continues nothing at byte {at})")
        if self.pending is not None and len(self.pending) + len(body) > _MAX_RECORD:
            self.damage.append(f"{self.path}: the record at byte {self.started} is longer than the "
                               f"{_MAX_RECORD} bytes this reader holds at once (left out)")
            self.pending, self.oversized = None, True
        if self.pending is not None:
            self.pending += body
        if kind != _LAST:
            return None
        record, self.pending, self.oversized = self.pending, None, False
        self.produced += record is not None
        return None if record is None else bytes(record)


def _block_chunks(block: memoryview, start: int,
                  framing: _Framing) -> Iterator[tuple[int, memoryview, int] | int]:
    """The chunks of one block as ``(kind, data, offset)``, or the offset where the file ends inside one."""
    pos = _HEADER.size if start == 0 else 0
    while _BLOCK - pos >= _CHUNK.size and pos < len(block):  # a shorter block tail is padding
        if pos + _CHUNK.size > len(block):
            yield start + pos
            return
        crc, length, kind = _CHUNK.unpack_from(block, pos)
        if kind == 0 and length == 0 and crc == 0:  # zero padding to the end of the block
            return
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or length > _BLOCK - pos - _CHUNK.size:
            raise RunReadError(f"{framing.path}: corrupt W&B run file (bad chunk header at byte "
                               f"{start + pos})")
        body = block[pos + _CHUNK.size: pos + _CHUNK.size + length]
        if len(body) < length:
            yield start + pos
            return
        if _chunk_crc(kind, body) != crc:
            raise RunReadError(f"{framing.path}: corrupt W&B run file (bad checksum at byte {start + pos})")
        yield kind, body, start + pos
        pos += _CHUNK.size + length


def _raw_records(file_path: str, damage: list[str], notes: list[str]) -> Iterator[bytes]:
    """The file's records, reassembled from its chunks, read 1 MiB (32 blocks) at a time."""
    framing = _Framing(file_path, damage, notes)
    with open(file_path, "rb") as fh:
        head = fh.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise RunReadError(f"{file_path}: corrupt W&B run file (shorter than its header)")
        if _HEADER.unpack(head) != (_IDENT, _MAGIC, _VERSION):
            raise RunReadError(f"{file_path}: corrupt W&B run file (bad header {head!r})")
        start = 0
        fh.seek(0)
        while data := fh.read(_READ):
            view = memoryview(data)
            for at in range(0, len(data), _BLOCK):
                for chunk in _block_chunks(view[at: at + _BLOCK], start, framing):
                    if isinstance(chunk, int):
                        framing.cut_short(chunk)
                        return
                    record = framing.take(*chunk)
                    if record is not None:
                        yield record
                start += min(_BLOCK, len(data) - at)
    if framing.pending is not None or framing.oversized:
        framing.cut_short(start)


def iter_records(path: str, damage: list[str] | None = None,
                 notes: list[str] | None = None) -> Iterator[wandb_internal_pb2.Record]:
    """Every record of the run at ``path`` (see :func:`find_run_file`), in the order written.

    A file that ends inside a record (a run still being written, or a copy cut short) is read up to
    there and a sentence saying so goes to ``notes``; a record too long to hold is left out and said
    in ``damage`` (see the module).

    Raises:
        RunReadError: no run at ``path``, a corrupt file, or one without a whole record.
    """
    file_path = find_run_file(path)
    for raw in _raw_records(file_path, [] if damage is None else damage, [] if notes is None else notes):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(raw)
        except Exception as exc:  # protobuf's DecodeError
            raise RunReadError(f"{file_path}: corrupt W&B run file (undecodable record: {exc})") from None
        yield record


def _path(item: Any) -> list[str]:
    return [item.key] if item.key else list(item.nested_key)


def _decode(value_json: str) -> Any:
    try:
        return json.loads(value_json)
    except ValueError:
        return value_json


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _set(target: dict[str, Any], item: Any, value: Any) -> None:
    # W&B splits a logged dict (a table's metadata, a nested config) into nested keys.
    *parents, last = _path(item)
    for key in parents:
        child = target.get(key)
        if not isinstance(child, dict):
            child = target[key] = {}
        target = child
    target[last] = value


def _remove(target: dict[str, Any], item: Any) -> None:
    *parents, last = _path(item)
    for key in parents:
        target = target.get(key)
        if not isinstance(target, dict):
            return
    target.pop(last, None)


@dataclasses.dataclass
class RunInfo:
    """What an offline run holds besides its history.

    Attributes:
        file: the ``.wandb`` file read.
        run_id: W&B's run id.
        config: the run config (``wandb.config``), values decoded from JSON.
        summary: the run summary (``run.summary``) as written last, values decoded from JSON.
        step_metrics: metric name or glob -> its ``step_metric`` from ``define_metric``.
        history: every logged row, values decoded from JSON.
        finished: whether the run wrote its exit record.
        damage: records left out (one sentence each).
        notes: what is worth saying but is no damage (a file that ends early, a run not finished).
    """

    file: str
    run_id: str = ""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    step_metrics: dict[str, str] = dataclasses.field(default_factory=dict)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    finished: bool = False
    damage: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def step_metrics_of(self, name: str) -> list[str]:
        """The step metrics ``define_metric`` gave ``name``, most specific first (exact name, then the
        longest matching glob: ``loss_scale/*`` before a logger's catch-all ``*``)."""
        found = [self.step_metrics[name]] if name in self.step_metrics else []
        globs = [(pattern, step_metric) for pattern, step_metric in self.step_metrics.items()
                 if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern)]
        found += [step_metric for _, step_metric in sorted(globs, key=lambda g: -len(g[0]))]
        return found


def read_run_info(path: str) -> RunInfo:
    """Config, summary, metric definitions and history rows of the offline run at ``path``.

    Raises:
        RunReadError: no run at ``path`` or a corrupt file.
    """
    info = RunInfo(file=find_run_file(path))
    seen = False
    for record in iter_records(info.file, info.damage, info.notes):
        seen = True
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info.run_id = record.run.run_id
            for item in record.run.config.update:
                _set(info.config, item, _decode(item.value_json))
        elif kind == "config":
            for item in record.config.update:
                _set(info.config, item, _decode(item.value_json))
            for item in record.config.remove:
                _remove(info.config, item)
        elif kind == "summary":
            for item in record.summary.update:
                _set(info.summary, item, _decode(item.value_json))
            for item in record.summary.remove:
                _remove(info.summary, item)
        elif kind == "metric":
            metric = record.metric
            name = metric.name or metric.glob_name
            if name and metric.step_metric:
                info.step_metrics[name] = metric.step_metric
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set(row, item, _decode(item.value_json))
            info.history.append(row)
        elif kind == "exit":
            info.finished = True
    if not seen:
        raise RunReadError(f"{info.file}: the W&B run file holds no record yet")
    if not info.finished and not info.notes:
        info.notes.append(f"{info.file} holds no exit record (a run still being written, or a copy cut "
                          "short): read up to there")
    # W&B keeps its own bookkeeping in the config; users never set it.
    info.config.pop("_wandb", None)
    return info


def read_run(path: str) -> RunSeries:
    """The history of a W&B offline run: every numeric metric, by name, in the order logged.

    A restarted run's steps go back (an old checkpoint loaded, a new scaler); the order is kept so
    that the report can tell the restarts apart.

    The step of a value is its ``step_metric`` (from ``define_metric``) in the same row when
    it has one, else W&B's ``_step``. W&B's own keys (``_step``, ``_runtime``, ``_timestamp``)
    and non-numeric values (tables, media) are left out.

    Records left out and an early end are said in the result's ``damage`` and ``notes``.

    Raises:
        RunReadError: nothing at ``path``, no run there, or a corrupt ``.wandb`` file.
    """
    info = read_run_info(path)
    series = RunSeries(damage=info.damage, notes=info.notes)
    for row in info.history:
        for name, raw in row.items():
            if name.startswith("_"):
                continue
            value = _number(raw)
            if value is None:
                continue
            # The most specific axis this row carries (a row logged by our sink has loss_scale/step).
            axis = next((a for a in info.step_metrics_of(name) if a in row), _STEP)
            step = _number(row.get(axis, row.get(_STEP)))
            if step is None or not math.isfinite(step):
                continue
            series.setdefault(name, []).append((int(step), value))
    # The policy is in the run config (written once); older runs logged the bounds as series.
    policy = info.config.get("loss_scale")
    if isinstance(policy, dict) and series.get(SCALE):
        first = series[SCALE][0][0]
        low, high = policy.get("min_scale", policy.get("scale")), policy.get("max_scale", policy.get("scale"))
        if _number(low) is not None and _number(high) is not None:
            series.setdefault(MIN_SCALE, [(first, float(low))])
            series.setdefault(MAX_SCALE, [(first, float(high))])
        if _number(policy.get("growth_interval")) is not None:
            series.setdefault(GROWTH_INTERVAL, [(first, float(policy["growth_interval"]))])
    return series


def read_tables(path: str) -> list[tuple[str, int, list[str], list[list[Any]]]]:
    """Every ``wandb.Table`` logged in the run, as ``(key, _step, columns, rows)``, in the order logged.

    The table contents are read from the run's ``files/`` folder, where W&B stores them.
    """
    info = read_run_info(path)
    files = os.path.join(os.path.dirname(info.file), "files")
    tables = []
    for row in info.history:
        for key, value in row.items():
            if isinstance(value, dict) and value.get("_type") == "table-file" and "path" in value:
                try:
                    with open(os.path.join(files, value["path"]), encoding="utf-8") as fh:
                        content = json.load(fh)
                except (OSError, ValueError) as exc:
                    raise RunReadError(f"{info.file}: table {key!r} cannot be read ({exc})") from None
                tables.append((key, int(row.get(_STEP, 0)), list(content.get("columns", [])),
                               [list(r) for r in content.get("data", [])]))
    return tables


def wait_until_finished(path: str, timeout: float = 60.0) -> RunInfo:
    """Wait until the run file at ``path`` holds its exit record, and return its :class:`RunInfo`.

    ``run.finish()`` returns when W&B's service has the run's last records, which can be a
    moment before its writer has flushed them to the ``.wandb`` file. Read a run that was
    just finished through this function.

    Raises:
        RunReadError: no run at ``path``, a corrupt file, or no exit record within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = read_run_info(path)
            if info.finished:
                return info
        except RunReadError:
            if not os.path.exists(path) or time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:
            raise RunReadError(f"{path}: the W&B run did not finish within {timeout:g} s")
        time.sleep(0.05)
