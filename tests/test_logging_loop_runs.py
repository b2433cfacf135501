"""LoggingLoop owns the interval rule, the sinks it opens and their checks, restarts and policy changes.

Issue 20 (one logging path) and issue 24 (restarts never overwrite, inputs and arguments checked at
construction): each test drives the real loop; the dashboard files are read back with their own readers.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from lossscale_callbacks import _metrics as m
from lossscale_callbacks._extras import MissingExtraError
from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy
from lossscale_callbacks._sinks import InMemorySink
from lossscale_callbacks.loop._logging_loop import LoggingLoop


def _host(steps, skipped, scale=1024.0, growth=0):
    return {"steps": steps, "skipped_steps": skipped, "scale": scale, "growth_counter": growth,
            "hysteresis_left": 1}


# ------------------------------------------------------------------ arguments, checked at construction

@pytest.mark.parametrize("kwargs, match", [
    ({"sinks": None}, "sinks must be an iterable"),
    ({"sinks": "memory"}, "sinks must be an iterable"),
    ({"sinks": [object()]}, "sinks: .* no callable write"),
    ({"tensorboard": ""}, "tensorboard must be None or a non-empty"),
    ({"tensorboard": 3}, "tensorboard must be"),
    ({"wandb": "yes"}, "wandb must be None, a bool, or a dict"),
    ({"wandb": {"mode": "nonsense"}}, r"wandb: mode must be one of \[.*'offline'"),
    ({"wandb": {"projekt": "x"}}, "wandb: init_kwargs must be arguments of wandb.init"),
    ({"writer": 1}, "writer"),
    ({"stop": 3}, "stop"),
    ({"echo": "print"}, "echo"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoggingLoop(DynamicPolicy(), **kwargs)


def test_a_bad_run_sink_is_refused_by_start():
    loop = LoggingLoop(DynamicPolicy(), echo=None)
    with pytest.raises(ValueError, match="sinks must be an iterable"):
        loop.start(sinks=None)


HIDE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == {package!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Refuse())
from lossscale_callbacks.loop._logging_loop import LoggingLoop
from lossscale_callbacks._extras import MissingExtraError
try:
    LoggingLoop(**{kwargs!r})
except MissingExtraError as exc:
    print("MissingExtraError:", exc)
"""


@pytest.mark.parametrize("package, kwargs", [("tensorboard", {"tensorboard": "runs/x"}),
                                             ("wandb", {"wandb": True}),
                                             ("google", {"tensorboard": "runs/x"})])
def test_a_missing_extra_is_reported_at_construction_with_the_pip_command(package, kwargs):
    """The package hidden in a fresh process, as in an install without the extra (protobuf: 'google')."""
    code = HIDE.format(package=package, kwargs=kwargs)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    extra = "wandb" if package == "wandb" else "tensorboard"
    assert out.stdout.startswith("MissingExtraError:"), out.stdout + out.stderr[-2000:]
    assert f'pip install "lossscale-callbacks[{extra}]"' in out.stdout
    assert issubclass(MissingExtraError, ImportError)


# ------------------------------------------------------------------ owned sinks and runs

def test_owned_sinks_are_opened_per_run_and_closed_at_its_end(tmp_path):
    from lossscale_callbacks.tensorboard._reader import read_run

    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), tensorboard=tmp_path / "tb", sinks=[memory], echo=None, health=None)
    assert not (tmp_path / "tb").exists()  # nothing is created before the first write
    loop.observe(_host(10, 0))
    loop.finish(_host(20, 1))
    assert not memory.closed  # the caller's sink is flushed, not closed
    first = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert len(first) == 1 and read_run(str(tmp_path / "tb"))["loss_scale/steps"] == [(10, 10.0), (20, 20.0)]
    loop.start()  # a second run (a second fit): a new event file
    loop.observe(_host(30, 1))
    loop.finish()
    assert len(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))) == 2
    loop.close()
    assert memory.closed


def test_a_run_that_never_finished_has_its_owned_sinks_closed_by_the_next_start(tmp_path):
    loop = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path), echo=None, health=None)
    loop.observe(_host(10, 0))  # ... and the run raised before finish()
    crashed = loop.sinks.sinks[0]
    assert crashed.path is not None and not crashed._writer._file.closed
    loop.start()
    assert crashed._writer._file is None  # released before the next run opened its own


def test_run_sinks_join_one_run_and_a_non_writer_opens_no_owned_sink(tmp_path):
    run_sink, memory = InMemorySink(), InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path / "tb"), sinks=[memory], echo=None)
    loop.start(writer=False, sinks=[run_sink])
    loop.observe(_host(10, 0))
    loop.finish()
    assert run_sink.records == [] and memory.records == [] and not (tmp_path / "tb").exists()
    loop.start(writer=True)
    loop.observe(_host(10, 0))
    assert len(memory.records) == 1 and run_sink.records == []  # the run sink belonged to the last run


def test_each_run_of_a_wandb_loop_is_its_own_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lossscale_callbacks.wandb._reader import read_run, wait_until_finished

    monkeypatch.setenv("WANDB_MODE", "offline")
    loop = LoggingLoop(DynamicPolicy(), wandb={"dir": str(tmp_path), "project": "t", "mode": "offline"},
                       echo=None, health=None)
    for run in range(2):
        loop.start()
        loop.observe(_host(10 * (run + 1), 0))
        loop.finish()
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2
    for path in runs:
        wait_until_finished(path)
    assert sorted(read_run(p)["loss_scale/steps"][0][0] for p in runs) == [10, 20]


# ------------------------------------------------------------------ the interval rule

def test_due_crosses_multiples_and_restart_interval_starts_the_count_again():
    loop = LoggingLoop(DynamicPolicy(), log_every=4, echo=None)
    loop.restart_interval(-1)  # Keras, at an epoch's start: batch 0 ends an interval
    assert [b for b in range(10) if loop.due(b)] == [0, 4, 8]
    loop.restart_interval(-1)
    assert [b for b in (1, 3, 5, 7) if loop.due(b)] == [1, 5]  # steps_per_execution=2: batches 1, 3, ...
    loop.restart_interval(20)  # a monitor resumed at step 20
    assert [s for s in range(21, 30) if loop.due(s)] == [24, 28]
    assert not loop.due(29)  # nothing new since the last call (29)
    assert loop.due(8)  # a count that went back on its own: 8 is a multiple, counted as new


def test_bad_steps_are_refused_by_due():
    loop = LoggingLoop(DynamicPolicy(), log_every=4, echo=None)
    for bad in (2.5, "3", None, -2):
        with pytest.raises(ValueError, match="step"):
            loop.due(bad)


# ------------------------------------------------------------------ restarts (segments)

def test_steps_going_back_start_a_segment_that_is_marked_never_overwritten():
    """The issue's case: 500 steps, an old checkpoint at 300 loaded, trained on to 500 again."""
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health="warn")
    for step in range(100, 501, 100):
        loop.observe(_host(step, 0, scale=2.0**22))
    assert all(m.SEGMENT not in metrics for _, metrics in memory.records)  # never without a restart
    loop.observe(_host(310, 21, scale=1.0))  # the checkpoint's own counts
    for step in (400, 500):
        loop.observe(_host(step, 21 + (step - 310) // 10, scale=1.0))
    with pytest.warns(match=r"10\.00% of the last 190 optimizer steps"):  # judged on the new segment only
        text = loop.finish()
    steps = [s for s, _ in memory.records]
    # Issue 30: the segment continues the sinks' axis after 500 (a chart drew both at 310..500).
    assert steps == [100, 200, 300, 400, 500, 501, 591, 691]
    assert [metrics[m.STEPS] for _, metrics in memory.records] == [100, 200, 300, 400, 500, 310, 400, 500]
    segments = [metrics.get(m.SEGMENT) for _, metrics in memory.records]
    assert segments == [None] * 5 + [1, 1, 1]
    first = memory.records[5][1]
    assert m.SKIPPED_IN_INTERVAL not in first and m.SKIP_RATE not in first  # its interval is unknown
    assert memory.records[6][1][m.SKIPPED_IN_INTERVAL] == 9 and memory.records[6][1][m.SKIP_RATE] == 0.1
    restarts = [md for tag, md in memory.texts if tag == m.RESTART_TAG]
    assert len(restarts) == 1 and "from 500 (0 skipped) back to 310 (21 skipped)" in restarts[0]
    assert loop.segment == 1 and loop.restarts == [(500, 310)]
    assert "restarted 1 time(s) (optimizer steps from 500 back to 310)" in text


def test_skips_that_a_continuous_run_cannot_have_also_start_a_segment():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health=None)
    loop.observe(_host(290, 0))
    loop.observe(_host(300, 21))  # 21 skips in 10 steps: a new scaler, not an interval
    assert loop.segment == 1 and memory.records[-1][1][m.SEGMENT] == 1
    assert m.SKIP_RATE not in memory.records[-1][1]


def test_a_baseline_that_goes_back_starts_the_segment_and_the_next_interval_is_known():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health=None)
    loop.observe(_host(20, 2))
    loop.baseline(_host(3, 0))  # a checkpoint of step 3 loaded into the monitor
    loop.observe(_host(10, 1))
    step, metrics = memory.records[-1]
    # The segment began at 3 (the baseline): its step 10 lands 7 after the highest step written, 20.
    assert (step, metrics[m.SEGMENT], metrics[m.SKIPPED_IN_INTERVAL], metrics[m.SKIP_RATE]) == (27, 1, 1,
                                                                                                1 / 7)
    assert metrics[m.STEPS] == 10
    assert [tag for tag, _ in memory.texts].count(m.RESTART_TAG) == 1


def test_the_health_rules_judge_the_new_segment_from_scratch():
    loop = LoggingLoop(DynamicPolicy(), echo=None, health="warn")
    with pytest.warns(match="optimizer steps were all skipped"):
        for step in range(10, 70, 10):
            loop.observe(_host(step, step, scale=1.0))
    loop.observe(_host(5, 0))  # restarted from a healthy checkpoint
    assert [s.step for s in loop.health.history] == [5]
    with pytest.warns(match="optimizer steps were all skipped"):  # the same problem again: said again
        for step in range(15, 80, 10):
            loop.observe(_host(step, step - 5, scale=1.0))
    assert [v.rule for v in loop.verdicts] == ["consecutive_skips", "consecutive_skips"]


def test_start_forgets_the_segments_of_the_previous_run():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health=None)
    loop.observe(_host(20, 0))
    loop.observe(_host(10, 0))
    loop.start()
    loop.observe(_host(5, 0))  # a new run begins at its own steps: no segment
    assert loop.segment == 0 and m.SEGMENT not in memory.records[-1][1]


# ------------------------------------------------------------------ a policy that changes

def test_after_set_policy_the_loop_judges_against_the_new_policy():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(min_scale=1.0, growth_interval=2000), sinks=[memory], echo=None)
    loop.observe(_host(10, 0, scale=4.0))
    loop.set_policy(DynamicPolicy(initial_scale=8.0, min_scale=4.0, growth_interval=5))
    snap = loop.observe(_host(20, 0, scale=4.0))
    assert snap.at_min_scale  # 4 is the new policy's minimum
    decreasing = next(r for r in loop.health.rules if type(r).__name__ == "ScaleOnlyDecreases")
    assert decreasing.min_steps == 10  # two of the new growth intervals
    policies = [md for tag, md in memory.texts if tag == "loss_scale/policy"]
    assert len(policies) == 2 and "| min_scale | 4.0 |" in policies[1]
    loop.set_policy(FixedPolicy(8.0))
    assert "ScaleOnlyDecreases" not in [type(r).__name__ for r in loop.health.rules]
    assert loop.tracker.last.step == 20  # the snapshots so far are kept


def test_os_pathlike_log_dir_is_accepted(tmp_path):
    loop = LoggingLoop(DynamicPolicy(), tensorboard=tmp_path / "x", echo=None, health=None)
    loop.observe(_host(1, 0))
    loop.close()
    assert os.listdir(tmp_path / "x")


def test_a_run_level_verdict_is_given_again_for_a_new_segment():
    loop = LoggingLoop(DynamicPolicy(), echo=None, health="warn")
    with pytest.warns(match="were skipped for Inf/NaN gradients"):
        for step in range(100, 1400, 100):
            loop.observe(_host(step, step // 10))  # 10 % skipped: fires once the window is full
        loop.observe(_host(200, 20))  # restarted from an older checkpoint
        for step in range(300, 900, 100):
            loop.observe(_host(step, step // 10))
        loop.finish()  # the new segment, shorter than the window, is judged at the end
    assert [v.rule for v in loop.verdicts] == ["skip_rate", "skip_rate"]


def test_a_loop_that_has_not_written_holds_no_file_or_run_and_pickles(tmp_path):
    """Lightning pickles the callbacks for ddp_spawn: a monitor's loop must pickle before training."""
    import pickle

    loop = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path / "tb"),
                       wandb={"dir": str(tmp_path), "mode": "offline"}, echo=None)
    copy = pickle.loads(pickle.dumps(loop))
    assert copy.log_every is None and not (tmp_path / "tb").exists()
    pytest.importorskip("lightning")
    from lossscale_callbacks.lightning._monitor import LossScaleMonitor

    pickle.dumps(LossScaleMonitor(tensorboard=str(tmp_path / "tb")))


def test_a_restart_never_lands_on_written_steps_of_a_tensorboard_chart(tmp_path):
    """Issue 30: after a restart the new segment was written at steps 100..200 again, one chart drew both."""
    pytest.importorskip("tensorboard")
    from lossscale_callbacks.report._run_report import build_report
    from lossscale_callbacks.tensorboard._reader import read_run

    loop = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path), echo=None, health=None)
    for step in (100, 200, 300):
        loop.observe(_host(step, 0))
    loop.baseline(_host(100, 0))  # an old checkpoint loaded
    for step in (200, 300):
        loop.observe(_host(step, 1))
    loop.finish()
    series = read_run(str(tmp_path))
    scale_steps = [step for step, _ in series[m.SCALE]]
    assert scale_steps == [100, 200, 300, 400, 500] and scale_steps == sorted(set(scale_steps))
    assert [int(v) for _, v in series[m.STEPS]] == [100, 200, 300, 200, 300]
    report = build_report(str(tmp_path), series)
    assert [(s.index, s.first_step, s.last_step) for s in report.segments] == [(0, 100, 300), (1, 200, 300)]


def test_a_second_read_at_one_step_with_other_counts_is_ignored_with_one_warning():
    """Issue 30: observe() at a repeated step with other counts wrote a second record (as a 'restart')."""
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health=None)
    loop.observe(_host(10, 2))
    with pytest.warns(RuntimeWarning, match="second read at optimizer step 10 has other counts") as caught:
        first = loop.observe(_host(10, 3))
        loop.observe(_host(10, 1))
        loop.baseline(_host(10, 0))
    assert len(caught) == 1 and caught[0].filename == __file__
    assert first.skipped_steps == 2 and loop.segment == 0 and loop.restarts == []
    assert [step for step, _ in memory.records] == [10]
    loop.observe(_host(20, 3))  # the run goes on from the first read
    step, metrics = memory.records[-1]
    assert step == 20 and metrics[m.SKIPPED_IN_INTERVAL] == 1


def test_a_short_run_says_in_a_few_words_that_its_skip_rate_was_not_judged():
    """Issue 30: every short run printed the long 'only 0 steps came after the 100-step warm-up' line."""
    loop = LoggingLoop(DynamicPolicy(), echo=None, log_every=10)
    for step in range(10, 41, 10):
        loop.observe(_host(step, 2))  # two skips while the scale settled, in the warm-up
    text = loop.finish()
    assert "the skip rate (0 logged steps after the warm-up, 100 needed)" in text
    assert "came after" not in text
    loop.start()
    for step in range(10, 151, 10):
        loop.observe(_host(step, 0 if step <= 120 else 2))  # skips after the warm-up: they matter
    text = loop.finish()
    assert "only 50 steps came after the 100-step warm-up (at least 100 are needed); overall 1.33%" in text


def test_two_writers_at_once_in_one_folder_are_told_apart_from_a_restart(tmp_path, capsys):
    """Issue 30: two processes logging into one folder at the same time were reported as a 'restart'."""
    pytest.importorskip("tensorboard")
    from lossscale_callbacks._cli import main
    from lossscale_callbacks.tensorboard._reader import RunReadError, read_run

    first = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path / "both"), echo=None, health=None)
    second = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path / "both"), echo=None, health=None)
    for step in (100, 200, 300):  # interleaved: each writer still writes after the other opened
        first.observe(_host(step, 0))
        second.observe(_host(step, 0))
    first.finish()
    second.finish()
    with pytest.raises(RunReadError, match="two writers wrote the loss scale into this folder at the same"):
        read_run(str(tmp_path / "both"))
    main(["report", str(tmp_path / "both")])
    out = capsys.readouterr()
    assert "two writers" in out.out + out.err and "restarted" not in out.out
    # One after the other (a job resumed from a checkpoint): a restart, as before.
    for steps in ((100, 200, 300), (200, 300)):
        loop = LoggingLoop(DynamicPolicy(), tensorboard=str(tmp_path / "resumed"), echo=None, health=None)
        for step in steps:
            loop.observe(_host(step, 0))
        loop.finish()
    assert [step for step, _ in read_run(str(tmp_path / "resumed"))[m.SCALE]] == [100, 200, 300, 200, 300]


def test_a_restart_whose_sink_steps_went_on_is_not_shifted():
    """A new scaler in a run whose own logging step goes on (Lightning's): nothing to move."""
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(), sinks=[memory], echo=None, health=None)
    loop.observe(_host(50, 0), sink_step=50)
    loop.observe(_host(10, 0), sink_step=60)  # the scaler was replaced; the logging step went on
    loop.observe(_host(20, 0), sink_step=70)
    assert [step for step, _ in memory.records] == [50, 60, 70] and loop.segment == 1
