"""WandbSink: exact round trip via the offline .wandb file, step axis, summary, tables, alerts, offline."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import time
import warnings

import pytest
import wandb
from repo_scripts import load_script

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks import _metrics as m
from lossscale_callbacks._health import Verdict
from lossscale_callbacks.wandb import WandbSink
from lossscale_callbacks.wandb._reader import (
    RunReadError,
    read_run,
    read_run_info,
    read_tables,
    wait_until_finished,
)
from lossscale_callbacks.wandb._sink import (
    FINAL_SCALE,
    OVERALL_SKIP_RATE,
    STEP_METRIC,
    TOTAL_SKIPPED_STEPS,
    WandbOfflineWarning,
)


def load_example():
    return load_script("examples/plain_loop_sinks.py")


def read_finished(path):
    """The series of a run just finished: run.finish() can return before W&B's writer flushed the file."""
    wait_until_finished(str(path))
    return read_run(str(path))


def series_of(written, name):
    return [(step, metrics[name]) for step, metrics in written if name in metrics]


@pytest.fixture(autouse=True)
def no_run_left_behind():
    yield
    if wandb.run is not None:
        wandb.run.finish()


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_round_trip_every_value_step_by_step(tmp_path):
    example = load_example()
    sink = WandbSink(project="t", dir=str(tmp_path), mode="offline")
    written = example.train([sink], steps=1500, log_every=50)
    assert len(written) == 30 and wandb.run is None  # the sink finished the run it started
    series = read_finished(tmp_path)
    for name in m.METRIC_NAMES:
        assert series[name] == series_of(written, name), name
    # The policy's bounds are written once, into the config (the reader gives them back as one point).
    assert series["loss_scale/min_scale"] == [(50, 1.0)]
    info = read_run_info(str(tmp_path / "wandb"))
    assert info.finished
    # The fp8 scales' family shares the optimizer-step axis (defined up front: a run may add an fp8 monitor).
    assert info.step_metrics == {"loss_scale/*": STEP_METRIC, "fp8/*": STEP_METRIC}
    last_step, last = written[-1]
    assert info.summary[FINAL_SCALE] == last[m.SCALE]
    assert info.summary[TOTAL_SKIPPED_STEPS] == last[m.SKIPPED_STEPS]
    assert info.summary[OVERALL_SKIP_RATE] == pytest.approx(last[m.SKIPPED_STEPS] / last_step)
    assert info.config["loss_scale"] == {"type": "dynamic", **example.DynamicPolicy(
        initial_scale=2.0**16, growth_interval=200).to_config()}
    ((tag, _, columns, rows),) = read_tables(str(tmp_path))
    assert (tag, columns) == ("loss_scale/summary", ["step", "markdown"])
    assert rows[0][0] == 1500 and rows[0][1].startswith("Loss scaling: 1500 optimizer steps")


def test_the_loss_scale_axis_is_independent_of_wandb_step(tmp_path):
    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    sink = WandbSink()
    for i in range(3):
        run.log({"train/loss": 1.0 / (i + 1)})  # another logger advances _step too
        sink.write(1000 * (i + 1), {m.SCALE: 2.0 ** (10 + i)})
    sink.close()
    assert wandb.run is run  # a run the sink found is left open
    run.finish()
    series = read_finished(tmp_path)
    assert series[m.SCALE] == [(1000, 1024.0), (2000, 2048.0), (3000, 4096.0)]
    assert series["train/loss"] == [(0, 1.0), (2, 0.5), (4, 1.0 / 3)]


def test_a_given_run_is_used_and_not_finished(tmp_path):
    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    sink = WandbSink(run)
    sink.write(7, {m.SCALE: 8.0})
    sink.close()
    assert sink.run is None and wandb.run is run
    run.finish()
    assert read_finished(tmp_path)[m.SCALE] == [(7, 8.0)]


def test_no_api_key_runs_offline_with_one_message(tmp_path, no_credentials):
    sink = WandbSink(project="t", dir=str(tmp_path))
    with pytest.warns(WandbOfflineWarning, match="no W&B API key") as caught:
        for step in (10, 20, 30):
            sink.write(step, {m.SCALE: float(step)})
    assert len(caught) == 1 and "wandb sync" in str(caught[0].message)
    assert sink.run.settings.mode == "offline"
    sink.close()
    assert read_finished(tmp_path)[m.SCALE] == [(10, 10.0), (20, 20.0), (30, 30.0)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_an_unreachable_server_means_offline_at_once(tmp_path, no_credentials, monkeypatch):
    # With a key but no network, wandb.init would wait 90 s; the sink decides in one connect.
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    sink = WandbSink(project="t", dir=str(tmp_path))
    start = time.monotonic()
    with pytest.warns(WandbOfflineWarning, match="cannot be reached") as caught:
        sink.write(1, {m.SCALE: 2.0})
        sink.write(2, {m.SCALE: 4.0})
    assert time.monotonic() - start < 60 and len(caught) == 1  # not the 90 s of wandb.init's wait
    assert sink.run.settings.mode == "offline"
    sink.close()
    assert read_finished(tmp_path)[m.SCALE] == [(1, 2.0), (2, 4.0)]


def test_online_init_failure_falls_back_offline(tmp_path, no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr("lossscale_callbacks.wandb._sink._unreachable_server", lambda timeout: None)
    real_init, modes = wandb.init, []

    def init(**kwargs):
        modes.append(kwargs.get("mode"))
        if kwargs.get("mode") != "offline":
            raise wandb.errors.CommError("network is unreachable")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    sink = WandbSink(project="t", dir=str(tmp_path))
    with pytest.warns(WandbOfflineWarning, match="network is unreachable"):
        sink.write(1, {m.SCALE: 2.0})
    sink.close()
    assert modes == [None, "offline"]
    assert "unreachable" in sink.offline_reason
    assert read_finished(tmp_path)[m.SCALE] == [(1, 2.0)]


def test_alerts_map_verdicts_and_a_refused_alert_costs_no_metric(tmp_path):
    sink = WandbSink(project="t", dir=str(tmp_path), mode="offline")
    sink.write(1, {m.SCALE: 2.0})
    sent = []
    sink.run.alert = lambda **kwargs: sent.append(kwargs)
    sink.alert_verdict(Verdict("skip_rate", "stop", 500, "too many skipped steps"))
    sink.alert_verdict(Verdict("consecutive_skips", "warn", 600, "in a row"))
    assert [(a["level"], a["text"]) for a in sent] == [("ERROR", "too many skipped steps"),
                                                       ("WARN", "in a row")]
    assert sent[0]["title"] == "Loss scale: skip rate at step 500"

    def refuse(**kwargs):
        raise RuntimeError("alerts need an online run")

    sink.run.alert = refuse
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.alert("t", "x")
        sink.alert("t", "y")
        sink.write(2, {m.SCALE: 4.0})
    assert len(caught) == 1 and "alert could not be sent" in str(caught[0].message)
    assert not sink.disabled
    sink.close()
    assert read_finished(tmp_path)[m.SCALE] == [(1, 2.0), (2, 4.0)]


def test_health_problems_of_the_logging_loop_raise_alerts_once(tmp_path):
    """The rules are the loop's (the integration's health=), judged once; the sink only alerts."""
    from lossscale_callbacks import LoggingLoop

    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    sent = []
    run.alert = lambda **kwargs: sent.append(kwargs)
    loop = LoggingLoop(DynamicPolicy(), sinks=[WandbSink(run)], health="warn", echo=None)
    with pytest.warns(UserWarning):
        for step in range(100, 1600, 100):  # collapsed: at the minimum, every step skipped
            loop.observe({"steps": step, "scale": 1.0, "growth_counter": 0, "hysteresis_left": 0,
                          "skipped_steps": step})
    titles = [a["title"] for a in sent]
    assert titles == ["Loss scale: consecutive skips at step 100", "Loss scale: skip rate at step 1100",
                      "Loss scale: stuck at min scale at step 1100"]
    assert {a["level"] for a in sent} == {"WARN"} and "bf16" in sent[0]["text"]
    sent.clear()
    quiet = LoggingLoop(DynamicPolicy(), sinks=[WandbSink(run)], health=None, echo=None)
    quiet.observe({"steps": 100, "scale": 1.0, "growth_counter": 0, "hysteresis_left": 0,
                   "skipped_steps": 100})
    loop.close()
    quiet.close()
    assert sent == []


def test_only_rank_zero_starts_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")

    def init(**kwargs):
        raise AssertionError("rank 3 must not start a W&B run")

    monkeypatch.setattr(wandb, "init", init)
    sink = WandbSink(project="t", dir=str(tmp_path), mode="offline")
    sink.write(1, {m.SCALE: 2.0})
    sink.write_text("t", "x")
    sink.alert("t", "x")
    sink.close()
    assert sink.run is None and not sink.disabled


@pytest.mark.parametrize("args, kwargs, message", [
    ((object(),), {}, "run must be a wandb Run"),
    ((), {"not_an_init_argument": 1}, "init_kwargs must be arguments of wandb.init"),
    ((), {"min_scale": 1.0}, "init_kwargs must be arguments of wandb.init"),
    ((), {"summary_secs": -1}, r"summary_secs must be in \[0, inf\]"),
])
def test_bad_arguments_raise_value_error(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        WandbSink(*args, **kwargs)


def test_a_failing_summary_update_still_finishes_the_run(tmp_path):
    sink = WandbSink(project="t", dir=str(tmp_path), mode="offline")
    sink.write(1, {m.SCALE: 2.0})
    run = sink.run

    class BrokenSummary:
        def update(self, values):
            raise RuntimeError("summary refused")

    sink._backend.run = type("Run", (), {"summary": BrokenSummary(), "finish": run.finish})()
    with pytest.warns(UserWarning, match="summary refused"):
        sink.close()
    assert sink.disabled and sink.run is None and wandb.run is None  # finished all the same
    assert read_finished(tmp_path)[m.SCALE] == [(1, 2.0)]


def test_bad_alert_level_raises_value_error():
    with pytest.raises(ValueError, match="level"):
        WandbSink(mode="offline").alert("t", "x", level="LOUD")


def test_finished_at_interpreter_exit_without_close(tmp_path):
    code = (
        "from lossscale_callbacks.wandb import WandbSink\n"
        f"s = WandbSink(project='t', dir={str(tmp_path)!r}, mode='offline')\n"
        "for i in range(1, 21): s.write(i, {'loss_scale/scale': float(i), 'loss_scale/skipped_steps': 1.0})\n"
    )
    subprocess.run([sys.executable, "-c", code], timeout=120, check=True, env={**os.environ})
    info = wait_until_finished(str(tmp_path))
    assert info.summary[FINAL_SCALE] == 20.0
    assert read_finished(tmp_path)[m.SCALE] == [(i, float(i)) for i in range(1, 21)]


def _one_run(folder):
    sink = WandbSink(project="t", dir=str(folder), mode="offline")
    sink.write(1, {m.SCALE: 2.0})
    sink.close()
    (path,) = folder.glob("wandb/offline-run-*/*.wandb")
    wait_until_finished(str(path))
    return path


def test_reader_errors(tmp_path):
    with pytest.raises(RunReadError, match="no such file"):
        read_run(str(tmp_path / "missing"))
    with pytest.raises(RunReadError, match="no W&B run"):
        read_run(str(tmp_path))
    bad = tmp_path / "run-x.wandb"
    header = b":W&B\xe1\xbe\x00"
    rng = random.Random(7)
    for _ in range(200):  # random bytes after a valid header (seeded: the same bytes every run)
        tail = rng.randbytes(100)
        bad.write_bytes(header + tail)
        # A random chunk header with a known kind (1 to 4) and a length that fits the 32 KiB block but
        # runs past the end of the file is what a copy cut short looks like, and is named so; anything
        # else is corrupt.
        _, length, kind = struct.unpack_from("<IHB", tail)
        cut_short = kind in (1, 2, 3, 4) and len(tail) - 7 < length <= 32 * 1024 - 7 - 7
        with pytest.raises(RunReadError, match="not one whole record" if cut_short else "corrupt"):
            read_run(str(bad))
    # Both kinds on purpose: a FULL chunk claiming 500 bytes of 93, and a kind no writer uses.
    bad.write_bytes(header + struct.pack("<IHB", 0, 500, 1) + bytes(93))
    with pytest.raises(RunReadError, match="not one whole record"):
        read_run(str(bad))
    bad.write_bytes(header + struct.pack("<IHB", 0, 10, 9) + bytes(93))
    with pytest.raises(RunReadError, match="corrupt W&B run file \\(bad chunk header"):
        read_run(str(bad))
    good = _one_run(tmp_path / "good")
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle
    bad.write_bytes(bytes(data))
    with pytest.raises(RunReadError, match="corrupt"):
        read_run(str(bad))
    bad.write_bytes(b"not a wandb file at all")
    with pytest.raises(RunReadError, match="bad header"):
        read_run(str(tmp_path))


def test_reader_refuses_to_guess_between_runs(tmp_path):
    for _ in range(2):
        sink = WandbSink(project="t", dir=str(tmp_path), mode="offline")
        sink.write(1, {m.SCALE: 2.0})
        run_dir = os.path.dirname(sink.run.dir)
        sink.close()
        wait_until_finished(run_dir)
    with pytest.raises(RunReadError, match="2 W&B runs"):
        read_run(str(tmp_path))
    (one, _) = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert read_run(str(one))[m.SCALE] == [(1, 2.0)]
