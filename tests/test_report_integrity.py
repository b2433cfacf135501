"""What the report trusts (issue 24): damage is reported, not read as data; a restarted run is told apart.

Each test fails on main at 52cfc0a: there a flipped bit was a loss scale of 2**31, a scale outside the
policy's bounds was data, and a scaler reset mid-run was merged by step into "300 steps, final scale 1".
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import wandb

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._cli import main
from lossscale_callbacks._policy import DynamicPolicy
from lossscale_callbacks._update import initial_state, next_state
from lossscale_callbacks.loop._logging_loop import LoggingLoop
from lossscale_callbacks.report._run_report import build_report, split_segments
from lossscale_callbacks.tensorboard._sink import TensorBoardSink
from lossscale_callbacks.wandb._reader import wait_until_finished
from lossscale_callbacks.wandb._sink import WandbSink


def _steps(loop, policy, state, steps, p_inf, rng, every=10):
    # observe() at every interval's end, also when the steps went back: what a logging loop that kept
    # its sink across a scaler reset writes (a new scaler, an old checkpoint loaded).
    for _ in range(steps):
        state = next_state(policy, state, bool(rng.random() >= p_inf))
        if int(state.steps) % every == 0:
            loop.observe(state)
    return state


def _collapse_then_a_new_scaler(sink):
    """The issue's run: 300 steps that collapse to scale 1, then a new scaler trains 200 clean steps to
    2**22 (4.19e6), through one logging loop and one sink."""
    policy = DynamicPolicy(initial_scale=2.0**14, growth_interval=25)
    loop = LoggingLoop(policy, sinks=[sink], health=None, echo=None)
    rng = np.random.default_rng(0)
    collapsed = _steps(loop, policy, initial_state(policy), 300, 0.5, rng)
    assert float(collapsed.scale) == 1.0
    final = _steps(loop, policy, initial_state(policy), 200, 0.0, rng)
    loop.close()
    assert (int(final.steps), float(final.scale), int(final.skipped_steps)) == (200, 2.0**22, 0)
    return final


def _the_reset_is_reported_right(payload):
    assert (payload["steps"], payload["final_scale"], payload["skipped_steps"]) == (200, 2.0**22, 0)
    assert payload["healthy"] and payload["max_scale_seen"] == 2.0**22
    first, latest = payload["segments"]
    assert (first["first_step"], first["last_step"], first["final_scale"]) == (10, 300, 1.0)
    assert not first["healthy"] and first["skipped_steps"] > 100
    assert (latest["first_step"], latest["last_step"], latest["log_points"]) == (10, 200, 20)
    assert "Restarts: the step count went back 1 time(s)" in payload["summary"]
    assert "segment 0: steps 10 to 300 (30 log points)" in payload["summary"]
    assert "the latest segment (1, steps 10 to 200)" in payload["summary"]
    assert [s["index"] for s in payload["segments"]] == [0, 1]  # as the loop's loss_scale/segment counts


def test_a_scaler_reset_mid_run_is_reported_as_a_new_segment(tmp_path, capsys):
    _collapse_then_a_new_scaler(TensorBoardSink(tmp_path))
    assert main(["report", str(tmp_path), "--json"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)["runs"]
    _the_reset_is_reported_right(payload)
    assert main(["report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Optimizer steps attempted: 200" in text and "final 4.1943e+06 (2^22.0)" in text


def test_a_scaler_reset_in_a_wandb_run_is_reported_as_a_new_segment(tmp_path, capsys):
    _collapse_then_a_new_scaler(WandbSink(project="t", dir=str(tmp_path), mode="offline"))
    if wandb.run is not None:
        wandb.run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wait_until_finished(str(run_dir))
    capsys.readouterr()
    assert main(["report", str(run_dir), "--json"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)["runs"]
    _the_reset_is_reported_right(payload)


def test_an_old_checkpoint_loaded_is_a_new_segment_from_its_step(tmp_path, capsys):
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=50)
    loop = LoggingLoop(policy, sinks=[TensorBoardSink(tmp_path)], health=None, echo=None)
    rng = np.random.default_rng(3)
    checkpoint = _steps(loop, policy, initial_state(policy), 300, 0.01, rng)
    _steps(loop, policy, checkpoint, 200, 0.01, rng)  # to step 500, then the step-300 checkpoint is loaded
    final = _steps(loop, policy, checkpoint, 300, 0.01, rng)
    loop.close()
    assert main(["report", str(tmp_path), "--json"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)["runs"]
    assert (payload["steps"], payload["final_scale"]) == (600, float(final.scale))
    assert payload["skipped_steps"] == int(final.skipped_steps)
    assert [(s["first_step"], s["last_step"]) for s in payload["segments"]] == [(10, 500), (310, 600)]


def test_a_restarted_job_writing_a_new_file_into_the_folder_is_a_new_segment(tmp_path, capsys):
    policy = DynamicPolicy(initial_scale=2.0**14, growth_interval=25)
    rng = np.random.default_rng(0)
    for steps, p_inf, name in ((300, 0.5, "events.out.tfevents.9999999999.later"),
                               (200, 0.0, "events.out.tfevents.0000000001.sooner")):
        sink = TensorBoardSink(tmp_path / "tmp")
        loop = LoggingLoop(policy, sinks=[sink], health=None, echo=None)
        _steps(loop, policy, initial_state(policy), steps, p_inf, rng)
        loop.close()
        (tmp_path / "tmp" / sink.path.rsplit("/", 1)[1]).rename(tmp_path / name)  # names say the opposite
    assert main(["report", str(tmp_path), "--json"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)["runs"]
    _the_reset_is_reported_right(payload)


def test_segments_cut_every_series_the_same_way_and_keep_the_policy():
    series = {
        m.SCALE: [(10, 8.0), (20, 16.0), (10, 2.0), (20, 4.0)],
        m.SKIPPED_STEPS: [(10, 1.0), (20, 1.0), (10, 0.0), (20, 0.0)],
        "loss_scale/min_scale": [(10, 1.0)],
        "loss_scale/skips/grad_inf": [(20, 1.0), (20, 2.0), (10, 1.0)],  # written twice at one step
        "loss_scale/late": [(20, 5.0)],  # began in the latest segment only
    }
    first, latest = split_segments(series)
    assert first[m.SCALE] == [(10, 8.0), (20, 16.0)] and latest[m.SKIPPED_STEPS] == [(10, 0.0), (20, 0.0)]
    assert first["loss_scale/min_scale"] == latest["loss_scale/min_scale"] == [(10, 1.0)]
    assert first["loss_scale/skips/grad_inf"] == [(20, 1.0), (20, 2.0)]
    assert "loss_scale/late" not in first and latest["loss_scale/late"] == [(20, 5.0)]


def test_the_restart_marker_starts_a_segment_where_the_steps_alone_do_not_say(capsys):
    # A new scaler whose steps went on above the old ones: only the logging loop's marker tells.
    scale = [(10, 8.0), (20, 16.0), (30, 2.0), (40, 4.0)]
    series = {m.SCALE: scale, m.SKIPPED_STEPS: [(10, 5.0), (20, 9.0), (30, 0.0), (40, 0.0)],
              "loss_scale/segment": [(30, 2.0), (40, 2.0)]}
    first, latest = split_segments(series)
    assert first[m.SCALE] == scale[:2] and latest[m.SKIPPED_STEPS] == [(30, 0.0), (40, 0.0)]
    report = build_report("r", series)
    assert (report.steps, report.skipped_steps, len(report.segments)) == (40, 0, 2)
    misaligned = {**series, "loss_scale/segment": [(35, 2.0)]}  # not the scale's writes: not trusted
    assert len(split_segments(misaligned)) == 1


# ------------------------------------------------------------------------------------------- damage


@pytest.fixture
def policy_run(tmp_path):
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=1000)
    sink = TensorBoardSink(tmp_path)
    loop = LoggingLoop(policy, sinks=[sink], health=None, echo=None)
    _steps(loop, policy, initial_state(policy), 300, 0.0, np.random.default_rng(0))
    return tmp_path, sink, loop


def test_a_flipped_bit_is_reported_as_damage_not_as_a_scale(policy_run, capsys):
    folder, _, loop = policy_run
    loop.close()
    (path,) = folder.iterdir()
    data = bytearray(path.read_bytes())
    at = data.rindex(struct.pack("<f", 2.0**15))  # the scale of the last interval
    data[at + 3] ^= 0x08  # 2**15 -> 2**31
    path.write_bytes(bytes(data))
    assert main(["report", str(folder), "--json"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)["runs"]
    assert payload["max_scale_seen"] == 2.0**15 and payload["steps"] == 290
    (damage,) = payload["damage"]
    assert "fails its checksum (left out)" in damage
    assert main(["report", str(folder), "--fail-unhealthy"]) == 1
    captured = capsys.readouterr()
    assert "Damaged records, left out (1)" in captured.out and "1 damaged" in captured.err


def test_a_scale_outside_the_policys_bounds_is_damage_not_data(policy_run, capsys):
    folder, sink, loop = policy_run
    sink.write(310, {m.SCALE: 2.0**31, m.SKIPPED_STEPS: 0.0})  # a well-formed record, written wrong
    loop.close()
    assert main(["report", str(folder), "--json"]) == 0
    (payload,) = json.loads(capsys.readouterr().out)["runs"]
    assert payload["max_scale_seen"] == 2.0**15 and payload["steps"] == 300
    assert payload["damage"] == ["step 310: a loss scale of 2.14748e+09 (2^31.0) is outside the policy's "
                                 "bounds [1, 1.67772e+07]: damage, not data (left out)"]
    assert 310 not in dict(payload["series"][m.SCALE])


def test_the_bounds_allow_a_float32_rounding_of_the_policys_own(tmp_path):
    series = {m.SCALE: [(10, float(np.float32(0.1)))], "loss_scale/min_scale": [(0, 0.1)],
              "loss_scale/max_scale": [(0, 0.1)]}
    assert build_report("r", series).damage == ()
