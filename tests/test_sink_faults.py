"""Fault isolation: a broken dashboard costs one warning; training and the other dashboard get everything."""

from __future__ import annotations

import warnings

import pytest
import wandb
from repo_scripts import load_script

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._sinks import InMemorySink, SinkFailureWarning
from lossscale_callbacks.tensorboard import TensorBoardSink
from lossscale_callbacks.tensorboard._reader import read_run as read_tensorboard
from lossscale_callbacks.wandb import WandbSink
from lossscale_callbacks.wandb._reader import read_run as read_wandb
from lossscale_callbacks.wandb._reader import wait_until_finished

STEPS, LOG_EVERY = 1000, 50


def train(sinks):
    module = load_script("examples/plain_loop_sinks.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = module.train(sinks, steps=STEPS, log_every=LOG_EVERY)
    failures = [w for w in caught if issubclass(w.category, SinkFailureWarning)]
    return written, failures


def assert_every_value(series, written, float32=False):
    import numpy as np

    for name in m.METRIC_NAMES:
        # TensorBoard scalars are float32 (what its default loader reads): compare at that precision.
        expected = [(step, float(np.float32(metrics[name])) if float32 else metrics[name])
                    for step, metrics in written]
        assert series[name] == expected, name


@pytest.fixture(autouse=True)
def no_run_left_behind():
    yield
    if wandb.run is not None:
        wandb.run.finish()


def test_unwritable_log_folder_leaves_wandb_with_every_value(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a regular file: nothing can be created under it, even by root")
    memory = InMemorySink()
    written, failures = train([
        TensorBoardSink(blocker / "logs"),
        WandbSink(project="t", dir=str(tmp_path), mode="offline"),
        memory,
    ])
    assert len(written) == STEPS // LOG_EVERY  # training ran to the end
    assert len(failures) == 1 and "TensorBoard" in str(failures[0].message)
    wait_until_finished(str(tmp_path))
    assert_every_value(read_wandb(str(tmp_path)), written)
    assert len(memory.records) == len(written)


def test_failing_wandb_init_leaves_tensorboard_with_every_value(tmp_path, monkeypatch):
    def broken_init(**kwargs):
        raise wandb.errors.UsageError("wandb.init failed on purpose")

    monkeypatch.setattr(wandb, "init", broken_init)
    written, failures = train([
        WandbSink(project="t", dir=str(tmp_path), mode="offline"),
        TensorBoardSink(tmp_path / "logs"),
    ])
    assert len(written) == STEPS // LOG_EVERY
    assert len(failures) == 1
    assert "W&B" in str(failures[0].message) and "on purpose" in str(failures[0].message)
    assert_every_value(read_tensorboard(str(tmp_path / "logs")), written, float32=True)


def test_a_bare_sink_in_a_plain_loop_is_guarded_too(tmp_path):
    # No SinkGroup around it: the sink itself warns once and goes quiet.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    sink = TensorBoardSink(blocker / "logs")
    with pytest.warns(SinkFailureWarning) as caught:
        for step in range(1, 101):
            sink.write(step, {m.SCALE: 2.0})
        sink.write_text("loss_scale/summary", "done")
        sink.close()
    assert len([w for w in caught if issubclass(w.category, SinkFailureWarning)]) == 1
