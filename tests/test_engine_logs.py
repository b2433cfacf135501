"""``report`` on other engines' logs: the same numbers and verdicts as our own run of the same trajectory.

Each engine's log is written in that engine's exact line formats (``engine_log_writers``, each format
cited from the engine's source with its version) for a known trajectory of the core's update rule;
the same log points go through our own ``LoggingLoop`` into TensorBoard. Both are found and read the
way ``report`` does (discovery by content, the reader entry points, ``build_report``) and must say
the same: steps, scales, skip counts and health verdicts. Runtime: about 10 s on one CPU core.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from engine_log_writers import apex_log, deepspeed_log, fairseq_log, loop_run, megatron_log, trajectory

from lossscale_callbacks._cli import main
from lossscale_callbacks._metrics import MetricsTracker
from lossscale_callbacks._policy import DynamicPolicy
from lossscale_callbacks.report._report_cli import READ, judge_run
from lossscale_callbacks.report._run_readers import ENGINE_LOG, discover_runs

pytest.importorskip("tensorboard")

# A burst of 70 consecutive overflows (more than ConsecutiveSkips' 50) that takes the scale to its
# minimum, after a few early overflows; hysteresis 2 for the engines that have it (DeepSpeed, Megatron).
BURST = {5, 6, 7, 30, 31, 32, 33, *range(200, 270)}
FAIRSEQ_OVERFLOWS = {5, 6, 7, *range(40, 400, 5)}  # fairseq stops at its minimum: a skip rate of 20% instead
APEX_OVERFLOWS = {1, 2, 3, *range(4004, 4080)}  # to the minimum: apex prints "... to 1.0" there


def _report(path):
    (found,) = discover_runs(str(path))
    outcome = judge_run(found)
    assert outcome.status == READ, outcome.reason
    return found, outcome.report


def _same(engine, truth):
    """Everything the report says about the trajectory, the reader's notes aside. The scale's range holds
    our run's at least: an engine's log prints every level, also those between two of our log points."""
    for name in ("steps", "skipped_steps", "skip_rate", "final_scale", "min_scale", "steps_at_min_scale",
                 "log_points"):
        assert getattr(engine, name) == getattr(truth, name), name
    assert engine.min_scale_seen <= truth.min_scale_seen and engine.max_scale_seen >= truth.max_scale_seen
    assert [(v.rule, v.step, v.message) for v in engine.verdicts] == \
        [(v.rule, v.step, v.message) for v in truth.verdicts]
    assert [(s.step, s.scale, s.skipped_steps, s.skipped_in_interval) for s in engine.snapshots] == \
        [(s.step, s.scale, s.skipped_steps, s.skipped_in_interval) for s in truth.snapshots]
    assert engine.health == truth.health


def _cases():
    megatron = trajectory(BURST, 400, initial=2.0**12, growth_interval=10, hysteresis=2)
    deepspeed = trajectory(BURST, 400, initial=2.0**12, growth_interval=10, hysteresis=2)
    fairseq = trajectory(FAIRSEQ_OVERFLOWS, 500, initial=2.0**7, growth_interval=4)
    apex = trajectory(APEX_OVERFLOWS, 4100)
    return {
        "megatron": (megatron_log(megatron, 10), None, "Megatron-LM"),
        # DeepSpeed prints its config at start: its scale_window lets the growths it prints no line for
        # be placed (growth_interval and min_scale go to the report as for our own policy).
        "deepspeed": (deepspeed_log(deepspeed, 10, 2.0**12, window=10),
                      DynamicPolicy(initial_scale=2.0**12, growth_interval=10, hysteresis=2,
                                    max_scale=2.0**32),
                      "DeepSpeed"),
        "fairseq": (fairseq_log(fairseq, 10), None, "fairseq"),
        "apex": (apex_log(apex), None, "apex"),
    }


@pytest.mark.parametrize("engine", ["megatron", "deepspeed", "fairseq", "apex"])
def test_an_engines_log_reports_like_our_own_run_of_the_same_trajectory(tmp_path, engine):
    (text, points), policy, label = _cases()[engine]
    log = tmp_path / "train.log"
    log.write_text(text)
    loop_run(str(tmp_path / "ours"), points, policy)
    found, report = _report(log)
    _, truth = _report(tmp_path / "ours")
    assert found.kind == ENGINE_LOG and report.reader == ENGINE_LOG
    _same(report, truth)
    assert truth.verdicts, "the trajectory is meant to be judged unhealthy"
    assert report.notes[0].startswith(f"Read as {label}'s log")


def test_apex_says_its_steps_are_lower_bounds(tmp_path):
    (text, _), _, _ = _cases()["apex"]
    (tmp_path / "apex.out").write_text(text)
    _, report = _report(tmp_path / "apex.out")
    assert "printed no step number" in report.notes[0] and "lower bound" in report.notes[0]


def test_deepspeed_without_its_config_keeps_the_last_printed_scale_and_says_so(tmp_path):
    states = trajectory({5, 6, 7, 30, 31, 32, 33}, 100, initial=1024.0, growth_interval=10, hysteresis=2)
    text, points = deepspeed_log(states, 10, 1024.0)
    (tmp_path / "ds.log").write_text(text)
    _, report = _report(tmp_path / "ds.log")
    scales = [scale for _, scale in report.series["loss_scale/scale"]]
    truth = [scale for _, scale, _ in points]
    assert all(got <= want for got, want in zip(scales, truth, strict=True)) and scales != truth
    assert [int(v) for _, v in report.series["loss_scale/skipped_steps"]] == [p[2] for p in points]
    assert "prints no line when the scale grows" in report.notes[0] and "grew unseen" in report.notes[0]


def test_deepspeed_stop_at_minimum_and_a_counter_that_disagrees_are_said(tmp_path):
    prefix = "[2025-02-21 12:00:00,000] [INFO] "
    lines = [f"{prefix}[loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
             f"Attempted loss scale: {2 ** (k + 1)}, reducing to {2 ** k}" for k in range(3, -1, -1)]
    lines += [f"{prefix}[logging.py:128:log_dist] [Rank 0] step=10, skipped=6, lr=[0.001], mom=[0.9]",
              "Traceback (most recent call last):",
              "Exception: Current loss scale already at minimum - cannot decrease scale anymore. "
              "Exiting run."]
    (tmp_path / "ds.log").write_text("\n".join(lines) + "\n")
    _, report = _report(tmp_path / "ds.log")
    said = " ".join(report.notes)
    assert "Current loss scale already at minimum" in said
    assert "skipped counter says 6 at step 10, but the log holds 4 overflow line(s)" in said
    assert report.steps == 10 and report.skipped_steps == 6 and report.final_scale == 1.0


def test_megatron_nan_iterations_not_counted_as_skipped_are_said(tmp_path):
    states = trajectory({5}, 40, initial=1024.0, growth_interval=1000)
    text, _ = megatron_log(states, 10, nan_not_skipped=frozenset({23}))
    (tmp_path / "megatron.txt").write_text(text)
    _, report = _report(tmp_path / "megatron.txt")
    assert report.skipped_steps == 1
    said = " ".join(report.notes)
    assert "iteration 30: 1 NaN iteration(s) but 0 skipped" in said and "Megatron-LLM#33" in said
    assert "Megatron-LLM#33" in report.text()


def test_a_mixed_log_reads_every_known_line_and_counts_the_unknown_ones(tmp_path, capsys):
    states = trajectory({5, 6, 7, 30, 31, 32, 33}, 100, initial=1024.0, growth_interval=10, hysteresis=2)
    text, points = megatron_log(states, 10)
    lines = text.splitlines()
    mixed = ["Building model ...", "> number of parameters on (tensor, pipeline) model parallel rank: 12345"]
    for i, line in enumerate(lines):
        mixed += [line, f"  validation loss at iteration {i}: 2.3", "\x1b[32mtqdm 50%|#####     |\x1b[0m"]
    # a format variant no engine prints (made up), and one the reader does not know (apex's old amp.init)
    mixed.insert(5, "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1024, lowering to 512")
    mixed.insert(9, "Gradient overflow, skipping update")
    # the last line cut in the middle, as a log still being written ends
    truncated = " iteration      110/  100000 | consumed samples:        28160 | loss sca"
    (tmp_path / "train.log").write_text("\n".join(mixed) + "\n" + truncated)
    assert main(["report", str(tmp_path / "train.log"), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert [p[0] for p in run["series"]["loss_scale/scale"]] == [p[0] for p in points]
    assert run["steps"] == 100 and run["skipped_steps"] == 7
    said = " ".join(run["notes"])
    assert "1 line(s) speak of loss scaling in a format this reader does not know" in said
    assert "lowering to 512" in said
    # apex's amp.init wording is known since issue 37: another engine's line, read but not the series
    assert "1 apex line(s) in the same log were read but not used for the series" in said
    assert f"the file ends inside line {len(mixed) + 1}" in said


def test_report_finds_engine_logs_by_content_in_a_folder(tmp_path):
    states = trajectory({5}, 40, initial=1024.0, growth_interval=1000)
    runs = tmp_path / "runs"
    (runs / "checkpoint-40").mkdir(parents=True)
    (runs / "slurm-1234.out").write_text(megatron_log(states, 10)[0])
    (runs / "ds" / "logs").mkdir(parents=True)
    (runs / "ds" / "logs" / "stdout").write_text(deepspeed_log(states, 10, 1024.0)[0])
    (runs / "notes.txt").write_text("nothing about training here\n")
    (runs / "config.json").write_text('{"fp16": {"loss_scale": 0}}')  # a config, not a state
    (runs / "checkpoint-40" / "optimizer.pt").write_bytes(b"\0loss_scale" * 100)
    _trainer_state(runs / "checkpoint-40" / "trainer_state.json", states, every=10)
    found = discover_runs(str(runs))
    assert [(os.path.relpath(f.path, runs), f.kind) for f in found] == [
        ("checkpoint-40/trainer_state.json", ENGINE_LOG), ("ds/logs/stdout", ENGINE_LOG),
        ("slurm-1234.out", ENGINE_LOG)]
    assert all(judge_run(f).status == READ for f in found)


def _trainer_state(path, states, every, grad_norm=True, ours=True):
    """A trainer_state.json as transformers' TrainerState.save_to_json writes it (the real class), with
    the logs our LossScaleCallback adds (the tracker's metrics, as in its on_log)."""
    transformers = pytest.importorskip("transformers")
    tracker, history = MetricsTracker(min_scale=1.0), []
    for step, scale, skipped, _, overflow in states:
        if step % every:
            continue
        entry = {"loss": 2.3, "learning_rate": 1e-4, "epoch": step / 100, "step": step}
        if grad_norm:
            entry["grad_norm"] = math.inf if overflow else 1.5
        if ours:
            entry.update(tracker.observe({"steps": step, "scale": scale, "growth_counter": 0,
                                          "hysteresis_left": 1, "skipped_steps": skipped}).metrics())
        history.append(entry)
    state = transformers.TrainerState(global_step=states[-1][0], max_steps=states[-1][0], log_history=history)
    state.save_to_json(str(path))


def test_a_trainer_state_with_our_callback_reports_like_our_own_run(tmp_path):
    states = trajectory(BURST, 400, initial=2.0**12, growth_interval=10)
    _trainer_state(tmp_path / "trainer_state.json", states, every=10)
    points = [(s, scale, skipped) for s, scale, skipped, _, _ in states if s % 10 == 0]
    loop_run(str(tmp_path / "ours"), points)
    _, report = _report(tmp_path / "trainer_state.json")
    _, truth = _report(tmp_path / "ours")
    _same(report, truth)
    assert truth.verdicts and report.notes[0].startswith("Read as a Transformers Trainer state")


def test_a_trainer_state_without_our_callback_says_what_grad_norm_shows(tmp_path):
    """The stock state is read (issue 37): its steps, and its non-finite grad_norm entries as skipped steps,
    a lower bound at logging_steps 10; the Trainer logs no scale, so the report holds none."""
    states = trajectory({10, 20, 25}, 40, initial=1024.0)
    _trainer_state(tmp_path / "trainer_state.json", states, every=10, ours=False)
    (found,) = discover_runs(str(tmp_path / "trainer_state.json"))
    outcome = judge_run(found)
    assert outcome.status == READ
    report = outcome.report
    assert (report.steps, report.skipped_steps, report.scale_known, report.healthy) == (40, 2, False, False)
    said = report.text()
    assert "2 of the 4 logged steps show a non-finite grad_norm (steps 10, 20)" in said
    assert "not known" in said and "Loss scale: not in this log" in said


def test_a_non_finite_grad_norm_where_our_callback_saw_no_skip_is_said(tmp_path):
    states = trajectory({10}, 40, initial=1024.0)
    _trainer_state(tmp_path / "trainer_state.json", states, every=10)
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    state["log_history"][2]["grad_norm"] = math.nan  # step 30: the scaler skipped nothing there
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    _, report = _report(tmp_path / "trainer_state.json")
    assert report.skipped_steps == 1
    said = " ".join(report.notes)
    assert "non-finite grad_norm at step(s) 30 where the callback counted no skipped step" in said


def test_an_engine_log_gets_the_same_picture(tmp_path):
    pytest.importorskip("matplotlib")
    (text, _), _, _ = _cases()["megatron"]
    (tmp_path / "train.log").write_text(text)
    assert main(["report", str(tmp_path / "train.log"), "--png", str(tmp_path / "scale.png")]) == 0
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def _megatron_lines(count):
    states = trajectory(set(range(5, count, 97)), count, initial=2.0**16, growth_interval=50)
    return megatron_log(states, 1)[0]


def test_reading_grows_linearly_with_the_lines(tmp_path):
    """Four times the lines take about four times as long (well under 8x: no quadratic step)."""
    from lossscale_callbacks.report._engine_logs import read_run

    small, large = tmp_path / "small.log", tmp_path / "large.log"
    small.write_text(_megatron_lines(5_000))
    large.write_text(_megatron_lines(20_000))

    def best(path):
        # CPU time, best of 5: a busy shared machine stretches wall time, not the work done (a
        # quadratic step would make the ratio about 16, linear work about 4).
        times = []
        for _ in range(5):
            start = time.process_time()
            read_run(str(path))
            times.append(time.process_time() - start)
        return min(times)

    assert best(large) / best(small) < 8.0


@pytest.mark.slow
def test_a_real_trainers_state_reports_like_its_tensorboard_run(tmp_path):
    """A tiny GPT-2 trained by a real Trainer in fp16 on the CPU, overflows injected at known steps: its
    checkpoint's trainer_state.json (our callback's logs in log_history) and the TensorBoard run the
    Trainer wrote give the same report. About 15 s on a quiet machine. (Without our callback the
    Trainer has no loss scaler on the CPU at all, Accelerate's fp16 there being float32: that case is
    the TrainerState test above.)"""
    pytest.importorskip("transformers")
    from hf_scripts import tiny_trainer as tiny

    from lossscale_callbacks.transformers._callback import LossScaleTrainerCallback

    policy = DynamicPolicy(initial_scale=1024.0, growth_interval=3)
    trainer = tiny.trainer(str(tmp_path / "ours"), inject_at=(2, 5, 8, 9), save_strategy="steps",
                           save_steps=12)
    LossScaleTrainerCallback(policy=policy, echo=None).attach(trainer)
    trainer.train()
    found, state = _report(tmp_path / "ours" / "checkpoint-12" / "trainer_state.json")
    _, board = _report(tmp_path / "ours" / "runs")
    assert found.kind == ENGINE_LOG and (state.steps, state.skipped_steps) == (12, 4)
    for name in ("steps", "skipped_steps", "final_scale", "min_scale_seen", "max_scale_seen", "log_points"):
        assert getattr(state, name) == getattr(board, name), name
    assert [(v.rule, v.step) for v in state.verdicts] == [(v.rule, v.step) for v in board.verdicts]

