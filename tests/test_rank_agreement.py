"""Rank agreement: every rank's state gathered at the log interval, a metric, a health rule, the words.

The unit tests feed the logging loop gathered states by hand (one process); the slow test runs
four gloo processes (``lightning_scripts/rank_agreement.py``, about 30 s on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import warnings

import background
import pytest

from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop
from lossscale_callbacks._health import LossScaleHealthError, LossScaleHealthWarning, SkipRate
from lossscale_callbacks._metrics import RANKS_DISAGREE, RANKS_TAG
from lossscale_callbacks._state import LossScaleState
from lossscale_callbacks.loop._rank_agreement import (
    RankedState,
    RanksDisagree,
    RankStates,
    split_health,
)
from lossscale_callbacks.report._run_report import build_report

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_scripts", "rank_agreement.py")
TEARDOWN = os.path.join(os.path.dirname(__file__), "torch_scripts", "gather_teardown.py")
NO_CUDA = dict(os.environ, CUDA_VISIBLE_DEVICES="")
_FOUR_RANKS_OUT: list = []  # the folder of the four ranks' run in the background runs
TEARDOWN_TEST = "test_freeing_a_ddp_model_after_a_gather_does_not_hang"


def start_in_background(items, tmp_path_factory) -> None:
    """The two multi-process runs (the four ranks, 150 gather teardowns: 35 s) beside the other tests
    (``tests/background.py``), where a test of this module asks for them."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return
    mine = [(i, item) for i, item in enumerate(items) if item.module.__name__ == __name__]
    ranks = next((i for i, item in mine if "four_ranks" in getattr(item, "fixturenames", ())), None)
    if ranks is not None:
        out = tmp_path_factory.mktemp("ranks")
        background.submit("four ranks", [sys.executable, SCRIPT, str(out)], env=NO_CUDA, timeout=240,
                          order=ranks)
        _FOUR_RANKS_OUT.append(out)
    teardown = next((i for i, item in mine if item.originalname == TEARDOWN_TEST), None)
    if teardown is not None:
        background.submit("gather teardown", _teardown_command(), env=NO_CUDA, timeout=240, order=teardown)


def _teardown_command() -> list[str]:
    return [sys.executable, TEARDOWN, "150"]  # it hung within 150 rounds before the gather waited


def _state(steps, scale=1024.0, skipped=0, growth=None):
    return LossScaleState(scale, steps if growth is None else growth, 1, skipped, steps)


def _ranked(steps, *rows):
    return RankedState(_state(steps, *rows[0][:1]), RankStates.from_rows(rows))


def test_rank_states_group_and_name_the_ranks():
    ranks = RankStates.from_rows([[8.0, 1, 0, 5], [8.0, 1, 0, 5], [4.0, 0, 1, 5], [8.0, 1, 0, 5]])
    assert ranks.world_size == 4 and ranks.differing() == [2]
    assert ranks.describe() == ("ranks 0, 1, 3: scale 8, growth counter 1, 0 of 5 steps skipped; "
                                "rank 2: scale 4, growth counter 0, 1 of 5 steps skipped")
    assert RankStates.from_rows([[float("nan"), 0, 0, 1]] * 2).differing() == []  # NaN == NaN here
    with pytest.raises(ValueError, match="rank 1 holds 3 numbers"):
        RankStates.from_rows([[1.0, 0, 0, 1], [1.0, 0, 0]])
    with pytest.raises(ValueError, match="rank 0's counts must be whole numbers"):
        RankStates.from_rows([[1.0, 0.5, 0, 1]])
    with pytest.raises(ValueError, match="action must be one of"):
        RanksDisagree("shout")


def test_ranked_state_is_a_state_and_pickles():
    state = _ranked(5, [8.0, 5, 0, 5], [8.0, 5, 0, 5])
    assert isinstance(state, LossScaleState) and state == _state(5, 8.0)
    back = pickle.loads(pickle.dumps(state))
    assert back == state and back.ranks == state.ranks


def test_split_health_takes_the_rank_rule_out():
    assert split_health("raise") == ("raise", RanksDisagree("raise"))
    assert split_health(True)[1] == RanksDisagree() and split_health(None) == (None, None)
    rule = SkipRate()
    assert split_health([rule, RanksDisagree("stop")]) == ([rule], RanksDisagree("stop"))
    assert split_health([rule]) == ([rule], None) and split_health(RanksDisagree()) == ([], RanksDisagree())


def test_the_loop_writes_the_metric_and_reports_each_stretch_once():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(initial_scale=1024.0), sinks=[memory], writer=True, echo=None)
    agree = [[1024.0, 10, 0, 10]] * 3
    with pytest.warns(LossScaleHealthWarning, match=r"rank\(s\) 1 differ from rank 0"):
        loop.observe(_ranked(10, *agree))
        loop.observe(_ranked(20, [1024.0, 20, 0, 20], [512.0, 2, 1, 20], [1024.0, 20, 0, 20]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same stretch: not reported again
        loop.observe(_ranked(30, [1024.0, 30, 0, 30], [512.0, 12, 1, 30], [1024.0, 30, 0, 30]))
        loop.observe(_ranked(40, *[[1024.0, 40, 0, 40]] * 3))
    assert memory.series(RANKS_DISAGREE) == [(10, 0), (20, 1), (30, 1), (40, 0)]
    assert [(v.rule, v.step) for v in loop.verdicts] == [("ranks_disagree", 20)]
    assert [tag for tag, _ in memory.texts].count(RANKS_TAG) == 1
    assert "rank 1: scale 512" in dict(memory.texts)[RANKS_TAG]
    assert loop.rank_metrics() == {RANKS_DISAGREE: 0}  # for a trainer's own metrics
    text = loop.finish()
    assert "disagreed 1 time(s) in 4 compared read(s), first at step 20" in text
    assert "[ranks_disagree at step 20]" in text


def test_one_process_writes_no_rank_metric_and_says_nothing():
    memory = InMemorySink()
    loop = LoggingLoop(None, sinks=[memory], writer=True, echo=None)
    loop.observe(_state(10))
    assert memory.series(RANKS_DISAGREE) == [] and loop.rank_metrics() == {}
    assert "ranks" not in loop.finish()


@pytest.mark.parametrize(("health", "raises"), [("raise", True), ([RanksDisagree("raise")], True),
                                                 ([SkipRate()], False), (None, False)])
def test_the_rule_follows_health(health, raises):
    loop = LoggingLoop(None, health=health, writer=True, echo=None)
    loop.observe(_ranked(10, [8.0, 10, 0, 10], [8.0, 10, 0, 10]))
    differing = _ranked(20, [8.0, 20, 0, 20], [8.0, 20, 0, 10])
    if raises:
        with pytest.raises(LossScaleHealthError, match=r"rank\(s\) 1 differ"):
            loop.observe(differing)
    else:
        loop.observe(differing)
        assert loop.verdicts == [] and loop.rank_disagreements[0][0] == 20


def test_a_resumed_baseline_is_compared():
    loop = LoggingLoop(None, writer=True, echo=None)
    with pytest.warns(LossScaleHealthWarning, match=r"rank\(s\) 3 differ"):
        loop.baseline(_ranked(20, *[[8.0, 20, 0, 20]] * 3, [8.0, 10, 0, 10]))


def test_the_report_says_the_ranks_disagreed():
    series = {"loss_scale/scale": [(10, 8.0), (20, 8.0), (30, 8.0)],
              RANKS_DISAGREE: [(10, 0.0), (20, 2.0), (30, 2.0)]}
    report = build_report("run", series)
    assert [(v.rule, v.step) for v in report.verdicts] == [("ranks_disagree", 20)]
    assert "at 2 of 3 log interval(s), first at step 20 (2 rank(s) differed" in report.text()
    series[RANKS_DISAGREE] = [(10, 0.0), (20, 0.0), (30, 0.0)]
    assert build_report("run", series).healthy


def test_one_process_gathers_nothing():
    torch = pytest.importorskip("torch")
    from lossscale_callbacks.loop._rank_agreement import RankedState
    from lossscale_callbacks.torch import LossScaler, ScalerReader

    state = ScalerReader(LossScaler(device="cpu")).read()
    # A state (carrying the interval's outcomes), but no ranks: nothing was gathered, no group made.
    assert isinstance(state, LossScaleState) and not isinstance(state, RankedState)
    assert not hasattr(state, "ranks") and not torch.distributed.is_initialized()
    assert state.outcomes.steps == 0


def test_a_gather_waits_until_its_tensors_are_let_go(monkeypatch):
    torch = pytest.importorskip("torch")
    import threading
    import time

    from lossscale_callbacks.torch import _rank_gather

    free = torch.zeros(4)
    started = time.monotonic()
    _rank_gather._released([free])
    assert time.monotonic() - started < 0.1  # nothing holds it: at once
    held = torch.zeros(4, requires_grad=True)
    graph = [held * held]  # the autograd graph holds `held`, as gloo's worker holds a collective's
    assert held._use_count() > 1
    threading.Timer(0.2, graph.clear).start()
    started = time.monotonic()
    _rank_gather._released([held])
    assert 0.15 < time.monotonic() - started < 1.5 and held._use_count() == 1
    monkeypatch.setattr(_rank_gather, "_RELEASE_WAIT_S", 0.05)
    graph.append(held * held)
    started = time.monotonic()
    _rank_gather._released([held])  # never let go: the wait is bounded
    assert time.monotonic() - started < 0.5


@pytest.mark.slow
def test_freeing_a_ddp_model_after_a_gather_does_not_hang(tmp_path):
    pytest.importorskip("torch")
    proc = background.result("gather teardown", _teardown_command(), env=NO_CUDA, timeout=240)
    assert not proc.timed_out, proc.failure()
    assert proc.returncode == 0 and "done 150" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    pytest.importorskip("torch")
    out = _FOUR_RANKS_OUT[0] if background.submitted("four ranks") else tmp_path_factory.mktemp("ranks")
    proc = background.result("four ranks", [sys.executable, SCRIPT, str(out)], env=NO_CUDA, timeout=240)
    assert not proc.timed_out, proc.failure()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def load(mode):
        return [json.loads((out / f"{mode}_rank{rank}.json").read_text()) for rank in range(4)]

    return load


@pytest.mark.slow
def test_four_ranks_unreduced_flag_is_reported_naming_the_rank(four_ranks):
    runs = four_ranks("unreduced")
    assert runs[2]["state"]["scale"] != runs[0]["state"]["scale"] == runs[1]["state"]["scale"]
    for run in runs:  # every rank judges alike (a "raise" or "stop" acts everywhere)
        assert [v[:2] for v in run["verdicts"]] == [["ranks_disagree", 10]]  # the Inf was at step 8
        assert "rank(s) 2 differ from rank 0" in run["verdicts"][0][2]
        assert "rank 2: scale 512" in run["verdicts"][0][2]
    assert runs[0]["disagree"] == [[10, 1], [20, 1], [30, 1]] and runs[1]["disagree"] == []  # rank 0 writes
    assert "disagreed 1 time(s)" in runs[0]["summary"]


@pytest.mark.slow
def test_four_ranks_reduced_flag_agree_for_500_steps(four_ranks):
    runs = four_ranks("reduced")
    assert all(run["state"] == runs[0]["state"] for run in runs) and runs[0]["state"]["skipped_steps"] == 4
    for run in runs:
        assert run["verdicts"] == [] and run["rank_reads"] == 50  # the final read at step 500 adds nothing
    assert [v for _, v in runs[0]["disagree"]] == [0] * 50
    assert "compared at 50 read(s) and always agreed" in runs[0]["summary"]


@pytest.mark.slow
def test_four_ranks_one_resumed_from_an_older_checkpoint(four_ranks):
    runs = four_ranks("resumed")
    assert runs[3]["state"]["steps"] == 30 and runs[0]["state"]["steps"] == 40  # and nothing hung
    for rank, run in enumerate(runs):
        # reported at the resume (the baseline read), at each rank's own step
        assert [v[:2] for v in run["verdicts"]] == [["ranks_disagree", 10 if rank == 3 else 20]]
        assert "rank(s) 3 differ from rank 0" in run["verdicts"][0][2]
    assert runs[0]["disagree"] == [[30, 1], [40, 1]]


@pytest.mark.slow
def test_no_host_read_or_collective_inside_the_step(four_ranks):
    for run in four_ranks("counted"):
        steps = run["per_step"]
        quiet = [s for s in steps if not s["read"]]
        reads = [s for s in steps if s["read"]]
        assert [s["step"] for s in reads] == [10, 20, 30]
        assert all(s["collectives"] == [] and s["host_reads"] == 0 for s in quiet)
        # one small collective per interval; the state read and the gathered numbers: 3 host reads
        assert all(s["collectives"] == ["all_gather"] for s in reads)
        assert all(s["host_reads"] <= 3 for s in reads), reads
