"""TensorBoardSink: exact round trip through TensorBoard's reader, layout, rank 0, failures, a real server."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_scripts import load_script

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._sinks import SinkFailureWarning
from lossscale_callbacks.tensorboard import TensorBoardSink
from lossscale_callbacks.tensorboard._reader import RunReadError, iter_events, read_run, read_texts
from lossscale_callbacks.tensorboard._sink import LAYOUT_CATEGORY, _EventFileWriter

PYTHON = sys.executable


def load_example():
    return load_script("examples/plain_loop_sinks.py")


def series_of(written, name):
    return [(step, metrics[name]) for step, metrics in written if name in metrics]


def test_round_trip_every_value_step_by_step(tmp_path):
    example = load_example()
    sink = TensorBoardSink(tmp_path / "run")
    written = example.train([sink], steps=1500, log_every=50)
    assert len(written) == 30
    series = read_run(str(tmp_path / "run"))
    for name in m.METRIC_NAMES:
        # float32, as TensorBoard's default loader needs: scales (powers of two) and counts are exact,
        # a skip rate such as 1/50 rounds to the nearest float32.
        assert series[name] == [(s, float(np.float32(v))) for s, v in series_of(written, name)], name
    for name in (m.SCALE, m.GROWTH_COUNTER, m.SKIPPED_STEPS, m.SKIPPED_IN_INTERVAL, m.STEPS):  # the counts
        assert series[name] == [(s, float(v)) for s, v in series_of(written, name)], name
    # The policy's bounds: written once (the policy table), not as a series at every interval.
    assert series["loss_scale/min_scale"] == [(50, 1.0)]
    assert series["loss_scale/max_scale"] == [(50, 2.0**24)]
    texts = read_texts(str(tmp_path / "run"))
    assert [(tag, step) for tag, step, _ in texts] == [("loss_scale/policy", 50),
                                                       ("loss_scale/summary", 1500)]
    assert "| growth_interval | 200 |" in texts[0][2]
    assert texts[1][2].startswith("Loss scaling: 1500 optimizer steps")


def test_scalars_are_float32_tensors_as_tf_summary_writes_them(tmp_path):
    from tensorboard.compat.proto import types_pb2

    sink = TensorBoardSink(tmp_path)
    sink.write(3, {m.SCALE: 2.0**15, m.SKIP_RATE: 0.1})
    sink.close()
    values = [v for e in iter_events(sink.path) for v in e.summary.value if v.tag.startswith("loss_scale/")]
    assert {v.tag: v.tensor.dtype for v in values} == {m.SCALE: types_pb2.DT_FLOAT,
                                                        m.SKIP_RATE: types_pb2.DT_FLOAT}


def test_two_threads_writing_first_open_one_file(tmp_path):
    import threading

    for attempt in range(20):
        folder = tmp_path / str(attempt)
        sink = TensorBoardSink(folder)
        barrier = threading.Barrier(2)

        def write(step, sink=sink, barrier=barrier):
            barrier.wait()
            sink.write(step, {m.SCALE: float(step)})

        threads = [threading.Thread(target=write, args=(step,)) for step in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sink.close()
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1
        assert sorted(read_run(str(folder))[m.SCALE]) == [(1, 1.0), (2, 2.0)]


def test_a_fifo_named_like_an_event_file_is_skipped_not_opened(tmp_path):
    sink = TensorBoardSink(tmp_path / "run")
    sink.write(1, {m.SCALE: 2.0})
    sink.close()
    os.mkfifo(tmp_path / "events.out.tfevents.fifo")
    (tmp_path / "deep").mkdir()
    os.mkfifo(tmp_path / "deep" / "events.out.tfevents.fifo")
    code = f"from lossscale_callbacks.tensorboard._reader import read_run; print(read_run({str(tmp_path)!r}))"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "loss_scale/scale" in out.stdout


def layouts_of(path):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    layouts = []
    for event in iter_events(path):
        for value in event.summary.value:
            if value.tag == "custom_scalars__config__":
                assert value.metadata.plugin_data.plugin_name == "custom_scalars"
                layouts.append(layout_pb2.Layout.FromString(tensor_util.make_ndarray(value.tensor).item()))
    return layouts


def test_custom_scalars_layout_has_one_loss_scale_section_on_log2_scale(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write(10, {m.SCALE: 4.0})
    sink.close()
    layouts = layouts_of(sink.path)
    assert len(layouts) == 1
    (category,) = layouts[0].category
    assert category.title == LAYOUT_CATEGORY
    charts = [(chart.title, list(chart.multiline.tag)) for chart in category.chart]
    assert charts == [(title, [f"^{tag}$"]) for title, tag in m.DASHBOARD_CHARTS]
    assert charts[0][1] == ["^loss_scale/log2_scale$"]  # readable, not a line hugging zero up to 2**24


def test_shares_a_run_folder_with_another_writer(tmp_path):
    # Keras' TensorBoard callback writes its own event file into the same folder; both are read.
    other = TensorBoardSink(tmp_path, filename_suffix=".keras")
    other.write(5, {"epoch_loss": 0.5})
    sink = TensorBoardSink(tmp_path)
    sink.write(5, {m.SCALE: 8.0})
    other.close()
    sink.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    # Both files are read; the reader keeps only the loss-scale series (the report needs nothing else).
    assert read_run(str(tmp_path)) == {m.SCALE: [(5, 8.0)]}
    other = TensorBoardSink(tmp_path / "keras", filename_suffix=".keras")
    other.write(5, {"loss_scale/scale": 16.0})
    other.close()
    assert read_run(str(tmp_path / "keras")) == {m.SCALE: [(5, 16.0)]}


def test_nothing_is_created_before_the_first_write_and_write_after_close_reopens(tmp_path):
    sink = TensorBoardSink(tmp_path / "lazy")
    assert not (tmp_path / "lazy").exists() and sink.path is None
    sink.write(1, {m.SCALE: 2.0})
    sink.close()
    sink.write(2, {m.SCALE: 4.0})
    sink.close()
    assert len(list((tmp_path / "lazy").iterdir())) == 2
    assert read_run(str(tmp_path / "lazy"))[m.SCALE] == [(1, 2.0), (2, 4.0)]


def test_flush_makes_values_visible_while_the_file_is_open(tmp_path):
    sink = TensorBoardSink(tmp_path, flush_secs=3600)
    sink.write(1, {m.SCALE: 2.0})
    sink.write(2, {m.SCALE: 4.0})
    sink.flush()
    assert read_run(str(tmp_path))[m.SCALE] == [(1, 2.0), (2, 4.0)]
    sink.close()


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    sink = TensorBoardSink(tmp_path / "rank1")
    sink.write(1, {m.SCALE: 2.0})
    sink.write_text("t", "x")
    sink.close()
    assert not (tmp_path / "rank1").exists()
    monkeypatch.setenv("RANK", "0")
    sink = TensorBoardSink(tmp_path / "rank0")
    sink.write(1, {m.SCALE: 2.0})
    sink.close()
    assert read_run(str(tmp_path / "rank0")) == {m.SCALE: [(1, 2.0)]}


def test_unwritable_folder_warns_once_and_disables(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, so no folder can be made under it (also when running as root)")
    sink = TensorBoardSink(blocker / "sub")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            sink.write(step, {m.SCALE: 2.0})
        sink.write_text("t", "x")
        sink.flush()
        sink.close()
    failures = [w for w in caught if issubclass(w.category, SinkFailureWarning)]
    assert len(failures) == 1
    assert "TensorBoard" in str(failures[0].message) and sink.disabled


def test_full_disk_mid_run_warns_once(tmp_path, monkeypatch):
    sink = TensorBoardSink(tmp_path)
    sink.write(1, {m.SCALE: 2.0})
    handle = sink._writer._file

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sink._writer._records, "_handle", type("Full", (), {"write": full, "flush": full,
                                                                            "close": handle.close})())
    with pytest.warns(SinkFailureWarning, match="No space left") as caught:
        for step in range(2, 10):
            sink.write(step, {m.SCALE: 2.0})
        sink.close()
    assert len([w for w in caught if issubclass(w.category, SinkFailureWarning)]) == 1
    # the disabled sink still released its file on close()
    assert handle.closed and sink._writer._file is None


@pytest.mark.parametrize("kwargs, message", [
    ({"log_dir": ""}, "log_dir must be a non-empty path"),
    ({"log_dir": 3}, "log_dir must be a non-empty path"),
    ({"log_dir": "x", "flush_secs": -1}, r"flush_secs must be in \[0, inf\]"),
    ({"log_dir": "x", "min_scale": 1.0}, "unexpected keyword argument"),
])
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TensorBoardSink(**kwargs)


def test_importing_the_sink_imports_neither_tensorflow_nor_torch(tmp_path):
    code = (
        "import sys\n"
        "from lossscale_callbacks.tensorboard import TensorBoardSink\n"
        "from lossscale_callbacks.tensorboard._reader import read_run\n"
        f"s = TensorBoardSink({str(tmp_path)!r})\n"
        "s.write(1, {'loss_scale/scale': 2.0}); s.write_text('t', 'x'); s.close()\n"
        f"assert read_run({str(tmp_path)!r})['loss_scale/scale'] == [(1, 2.0)]\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('tensorflow', 'torch', 'keras'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_closed_at_interpreter_exit_without_close(tmp_path):
    code = (
        "from lossscale_callbacks.tensorboard import TensorBoardSink\n"
        f"s = TensorBoardSink({str(tmp_path)!r}, flush_secs=3600)\n"
        "for i in range(1, 101): s.write(i, {'loss_scale/scale': float(i)})\n"
    )
    subprocess.run([PYTHON, "-c", code], timeout=60, check=True)
    assert read_run(str(tmp_path))[m.SCALE] == [(i, float(i)) for i in range(1, 101)]


def test_the_sink_is_not_kept_alive_by_the_exit_hook(tmp_path):
    import gc
    import weakref

    sink = TensorBoardSink(tmp_path)
    sink.write(1, {m.SCALE: 2.0})
    ref = weakref.ref(sink)
    del sink
    gc.collect()
    assert ref() is None


def test_reader_errors(tmp_path):
    with pytest.raises(RunReadError, match="no such file"):
        read_run(str(tmp_path / "missing"))
    with pytest.raises(RunReadError, match="no TensorBoard run"):
        read_run(str(tmp_path))
    bad = tmp_path / "events.out.tfevents.1.host"
    bad.write_bytes(random.Random(5).randbytes(200))
    with pytest.raises(RunReadError, match="corrupt"):
        read_run(str(tmp_path))


def test_reader_reads_simple_value_scalars_and_several_runs(tmp_path):
    # torch's SummaryWriter (Lightning's TensorBoardLogger) writes simple_value; tensors with metadata
    # on the first value only (tf.summary, Keras) are what TensorBoardSink itself writes.
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "torch"))
    for step in range(3):
        writer.add_scalar(m.SCALE, 2.0 ** (10 + step), step * 10)
    writer.close()
    assert read_run(str(tmp_path / "torch"))[m.SCALE] == [(0, 1024.0), (10, 2048.0), (20, 4096.0)]
    # several runs below a folder (Keras' train/ and validation/) are told apart by prefix
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(1, {m.SCALE: 2.0})
    sink.close()
    both = read_run(str(tmp_path))
    assert both["torch/" + m.SCALE][0] == (0, 1024.0) and both["tb/" + m.SCALE] == [(1, 2.0)]


def test_a_log_directory_deleted_mid_run_warns_once_and_the_rest_of_the_run_is_kept(tmp_path):
    """Issue 24: on main the later writes went to the unlinked file, without a word."""
    import shutil

    from lossscale_callbacks.tensorboard._sink import LogDirRemovedWarning

    run = tmp_path / "run"
    sink = TensorBoardSink(run, flush_secs=0)
    sink.write_text("loss_scale/policy", "| setting | value |\n|---|---|\n| min_scale | 1.0 |")
    sink.write(1, {m.SCALE: 2.0})
    shutil.rmtree(run)
    with pytest.warns(LogDirRemovedWarning, match="was deleted") as caught:
        for step in range(2, 6):
            sink.write(step, {m.SCALE: 4.0})
    sink.write_text("loss_scale/summary", "done")
    sink.close()
    assert [w.category for w in caught] == [LogDirRemovedWarning] and not sink.disabled  # once, no failure
    assert read_run(str(run))[m.SCALE] == [(s, 4.0) for s in range(2, 6)]
    assert [tag for tag, _, _ in read_texts(str(run))] == ["loss_scale/policy", "loss_scale/summary"]


@settings(max_examples=300, deadline=None)
@given(step=st.one_of(st.just(0), st.integers(-(2**63), 2**63 - 1)),
       wall_time=st.one_of(st.just(0.0), st.floats(0, 2e9)),
       metrics=st.dictionaries(st.text(min_size=0, max_size=12),
                               st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                         st.sampled_from([3.5e38, -3.5e38, 3.4028235e38, 1e-46, -0.0])),
                               max_size=6),
       described_share=st.floats(0, 1))
def test_scalar_events_are_encoded_exactly_as_protobuf_serializes_them(step, wall_time, metrics,
                                                                       described_share):
    """The direct encoding of a step's scalars is byte for byte the serialized protobuf ``Event``, tags
    described before (no metadata) or not (their first value carries it), any step, any float."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from lossscale_callbacks.tensorboard._records import ScalarEncoder, crc32c

    writer = _EventFileWriter("unused", 1.0, "")
    tags = list(metrics)
    writer._described.update(tags[: round(described_share * len(tags))])
    reference = _EventFileWriter("unused", 1.0, "")
    reference._described.update(writer._described)
    values = [reference._scalar(tag, value) for tag, value in metrics.items()]
    expected = event_pb2.Event(wall_time=wall_time, step=step,
                               summary=summary_pb2.Summary(value=values)).SerializeToString()
    encoder = ScalarEncoder(writer._described, writer._scalar)
    assert encoder.event(wall_time, step, metrics) == expected
    assert writer._described == reference._described == set(tags)
    # The checksum the records carry is CRC-32C (the check value of "123456789").
    assert crc32c(b"123456789") == 0xE3069283
