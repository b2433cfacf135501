"""The TensorBoard run reader: checksums verified, damage reported, layouts decoded as protobuf decodes."""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from lossscale_callbacks import _metrics as m
from lossscale_callbacks.report._run_readers import RunReadError
from lossscale_callbacks.tensorboard._reader import (
    FileReading,
    iter_record_batches,
    layout_of,
    masked_crc32c_rows,
    read_run,
)
from lossscale_callbacks.tensorboard._sink import TensorBoardSink


@given(st.lists(st.binary(min_size=0, max_size=70), min_size=1, max_size=20), st.integers(0, 69))
def test_the_vectorised_crc_is_tensorboards_masked_crc32c(blobs, length):
    rows = [b[:length].ljust(length, b"\x07") for b in blobs]
    array = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), length)
    assert masked_crc32c_rows(array).tolist() == [masked_crc32c(r) for r in rows]


# ----------------------------------------------------------------------------- layouts against protobuf

_SCALAR = tensor_shape_pb2.TensorShapeProto()


def _value(tag: str, kind: str, number: float) -> summary_pb2.Summary.Value:
    if kind == "simple":
        return summary_pb2.Summary.Value(tag=tag, simple_value=number)
    if kind == "float":  # as TensorBoardSink and tf.summary write it
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=_SCALAR, float_val=[number])
    elif kind == "bfloat16":  # stored as its bits, as TensorFlow writes it
        bits = int(np.asarray(number, dtype=ml_dtypes.bfloat16).view(np.uint16))
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_BFLOAT16, tensor_shape=_SCALAR, half_val=[bits])
    else:
        tensor = tensor_util.make_tensor_proto(np.asarray(number, dtype={
            "double": np.float64, "half": np.float16, "int64": np.int64}[kind]))
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor)


def _expected(value: summary_pb2.Summary.Value, number: float) -> float:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.tensor.dtype == types_pb2.DT_BFLOAT16:  # TensorBoard's make_ndarray has no bfloat16
        return float(np.asarray(number, dtype=ml_dtypes.bfloat16))
    return float(tensor_util.make_ndarray(value.tensor))


_EVENTS = st.lists(st.tuples(
    st.integers(-(2**40), 2**40),
    st.lists(st.tuples(st.sampled_from(["loss_scale/scale", "loss_scale/skipped_steps", "batch_loss",
                                        "loss_scale/x"]),
                       st.sampled_from(["simple", "float", "double", "half", "bfloat16", "int64"]),
                       st.integers(-1000, 1000)), min_size=1, max_size=4),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(_EVENTS, st.floats(0, 1e9))
def test_the_reader_reads_what_protobuf_reads(tmp_path_factory, events, wall_time):
    folder = tmp_path_factory.mktemp("events")
    path = folder / "events.out.tfevents.1.host"
    expected: dict[str, list[tuple[int, float]]] = {}
    with open(path, "wb") as handle:
        writer = RecordWriter(handle)
        writer.write(event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2").SerializeToString())
        for step, values in events:
            summary = summary_pb2.Summary(value=[_value(tag, kind, n * 0.5) for tag, kind, n in values])
            event = event_pb2.Event(wall_time=wall_time + step, step=step, summary=summary)
            writer.write(event.SerializeToString())
            for value, (_, _, n) in zip(summary.value, values, strict=True):
                if "loss_scale/" in value.tag:
                    expected.setdefault(value.tag, []).append((step, _expected(value, n * 0.5)))
    series = read_run(str(path))
    assert dict(series) == expected and series.damage == [] and series.notes == []


def test_records_of_one_layout_share_everything_but_their_numbers():
    def record(step, scale):
        value = summary_pb2.Summary.Value(tag=m.SCALE, tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_FLOAT, tensor_shape=_SCALAR, float_val=[scale]))
        return event_pb2.Event(wall_time=step * 1.5, step=step, summary=summary_pb2.Summary(value=[value]))

    data = record(300, 1024.0).SerializeToString()
    layout = layout_of(data)
    assert layout is not None and layout.values[0][0] == m.SCALE
    same = np.frombuffer(record(301, 2.0**31).SerializeToString(), dtype=np.uint8)
    assert not ((same ^ layout.reference) & layout.mask).any()
    other_length = record(3, 1.0).SerializeToString()  # step 3 is one varint byte, 300 two
    assert len(other_length) != len(data)
    text = summary_pb2.Summary.Value(tag="loss_scale/policy", tensor=tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING, tensor_shape=_SCALAR, string_val=[b"| setting | value |"]))
    text_event = event_pb2.Event(step=1, summary=summary_pb2.Summary(value=[text]))
    assert layout_of(text_event.SerializeToString()) is None
    assert layout_of(event_pb2.Event(file_version="brain.Event:2").SerializeToString()) is None


# ------------------------------------------------------------------------------------ damage and ends


@pytest.fixture
def run(tmp_path):
    from lossscale_callbacks._policy import DynamicPolicy
    from lossscale_callbacks._update import initial_state, next_state
    from lossscale_callbacks.loop._logging_loop import LoggingLoop

    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=1000)
    loop = LoggingLoop(policy, sinks=[TensorBoardSink(tmp_path / "run")], health=None, echo=None)
    state = initial_state(policy)
    for _ in range(300):
        state = next_state(policy, state, True)
        if int(state.steps) % 10 == 0:  # the end of a log interval
            loop.observe(state)
    loop.close()
    (path,) = (tmp_path / "run").iterdir()
    return path


def _records(path):
    """``(offset, data)`` of the records the reader keeps, in file order."""
    reading = FileReading(str(path))
    batches = iter_record_batches(str(path), b"loss_scale/", reading)
    records = [(int(offset), group.data(i)) for groups in batches
               for group in groups for i, offset in enumerate(group.offsets)]
    return sorted(records), reading


def _scale_offset(path, step):
    """The file offsets of the record written at ``step`` and of its float32 scale (2**15)."""
    for offset, data in _records(path)[0]:
        event = event_pb2.Event.FromString(data)
        if event.step == step and any(v.tag == m.SCALE for v in event.summary.value):
            return offset, offset + 12 + data.index(struct.pack("<f", 2.0**15))
    raise AssertionError(step)


def _flip(path, offset, bit):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_flipped_bit_is_damage_not_a_scale_of_2_to_the_31(run):
    record, scale = _scale_offset(run, 150)
    _flip(run, scale + 3, 3)  # 0x47000000 (2**15) -> 0x4f000000 (2**31)
    series = read_run(str(run.parent))
    scales = dict(series[m.SCALE])
    assert 150 not in scales and max(scales.values()) == 2.0**15 and len(scales) == 29
    assert series.damage == [f"{run}: the record at byte {record} fails its checksum (left out)"]


def test_a_damaged_length_loses_the_rest_of_the_file_and_says_so(run):
    records, _ = _records(run)
    offset = next(o for o, d in records if event_pb2.Event.FromString(d).step == 200)
    _flip(run, offset + 1, 0)  # the length of the record of step 200
    series = read_run(str(run.parent))
    assert [s for s, _ in series[m.SCALE]] == list(range(10, 200, 10))
    (damage,) = series.damage
    assert f"the length of the record at byte {offset} fails its checksum" in damage


def test_a_file_cut_inside_a_record_is_read_up_to_there_with_a_note(run):
    records, _ = _records(run)
    offset = next(o for o, d in records if event_pb2.Event.FromString(d).step == 250)
    run.write_bytes(run.read_bytes()[: offset + 30])
    series = read_run(str(run.parent))
    assert series[m.SCALE][-1][0] == 240 and series.damage == []
    (note,) = series.notes
    assert f"ends inside the record at byte {offset}" in note


def test_a_file_whose_first_record_is_damaged_is_corrupt(run):
    _flip(run, 20, 0)  # inside the file-version record
    with pytest.raises(RunReadError, match=r"corrupt TensorBoard event file .*fails its checksum"):
        read_run(str(run.parent))


def test_series_keep_the_order_written_when_the_steps_go_back(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step, scale in ((10, 8.0), (20, 16.0), (10, 2.0), (20, 4.0), (30, 8.0)):
        sink.write(step, {m.SCALE: scale})
    sink.close()
    assert read_run(str(tmp_path))[m.SCALE] == [(10, 8.0), (20, 16.0), (10, 2.0), (20, 4.0), (30, 8.0)]


def test_a_nan_or_inf_value_is_read_as_written(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write(1, {m.SCALE: math.inf, m.SKIP_RATE: math.nan})
    sink.close()
    series = read_run(str(tmp_path))
    assert series[m.SCALE] == [(1, math.inf)] and math.isnan(series[m.SKIP_RATE][0][1])
