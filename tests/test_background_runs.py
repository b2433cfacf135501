"""The queue of background runs (``tests/background.py``) that the slow modules' subprocesses go through:
what a test reads back is what ``subprocess.run`` would give, failures and timeouts included."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import background
import pytest


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_lane_runs_the_queue_in_order_and_the_waiting_test_reads_status_and_output(tmp_path):
    runs = background.Runs(lanes=1)
    log = tmp_path / "log"
    for key, order in (("b", 2), ("a", 1)):
        runs.submit(key, _python(f"open({str(log)!r}, 'a').write('{key}'); print('out {key}')"), timeout=60,
                    order=order)
    runs.submit("bad", _python("import sys; print('partial'); sys.exit('boom')"), timeout=60, order=3)
    runs.start()
    # The lane alone runs the queue here: a test that waited for "b" before the lane claimed "a" would run
    # "b" itself, at once (wait's own rule, tested below), and the order would be the race's.
    for thread in runs._threads:
        thread.join(timeout=120)
    assert runs.wait("b").stdout == "out b\n" and runs.wait("a").returncode == 0
    bad = runs.wait("bad")
    assert (bad.returncode, bad.stdout, bad.stderr, bad.timed_out) == (1, "partial\n", "boom\n", False)
    assert "exit status 1" in bad.failure() and "boom" in bad.failure()
    assert log.read_text() == "ab"  # the lower order first
    runs.stop()
    assert sorted(key for key, _ in runs.finished) == ["a", "b", "bad"]


def test_a_run_no_lane_started_runs_in_the_waiting_test_and_a_second_submit_is_ignored():
    runs = background.Runs(lanes=1)  # never started
    runs.submit("x", _python("print(1)"), timeout=60)
    runs.submit("x", _python("print(2)"), timeout=60)
    assert runs.submitted("x") and runs.wait("x").stdout == "1\n"


def test_without_lanes_nothing_is_queued_and_the_tests_run_their_own():
    runs = background.Runs(lanes=0)
    runs.submit("x", _python("print(1)"), timeout=60)
    assert not runs.submitted("x")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _child_pid(path) -> int:
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(path.read_text())


_SPAWNS_A_CHILD = ("import subprocess, sys, time; "
                   "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                   "open({path!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(120)")


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
        try:  # reaped by init once its parent is gone; a zombie of ours would still answer
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return not _alive(pid)


def test_a_timeout_kills_the_run_and_its_children_and_says_so(tmp_path):
    runs = background.Runs(lanes=1)
    runs.submit("slow", _python(_SPAWNS_A_CHILD.format(path=str(tmp_path / "pid"))), timeout=3)
    runs.start()
    slow = runs.wait("slow")
    assert slow.timed_out and slow.returncode != 0 and slow.stdout == "started\n"
    assert "timed out after 3 s" in slow.failure()
    assert _gone(_child_pid(tmp_path / "pid"))


def test_the_sessions_end_kills_what_still_runs(tmp_path):
    runs = background.Runs(lanes=1)
    runs.submit("slow", _python(_SPAWNS_A_CHILD.format(path=str(tmp_path / "pid"))), timeout=300)
    runs.submit("queued", _python("print(1)"), timeout=60, order=1)
    runs.start()
    child = _child_pid(tmp_path / "pid")
    started = time.monotonic()
    runs.stop()
    assert time.monotonic() - started < 30 and _gone(child)
    assert runs.wait("slow").returncode != 0
    assert "queued" not in dict(runs.finished)  # dropped, never started


@pytest.mark.parametrize("lanes", [0, 1])
def test_the_session_queue_follows_the_environment(lanes, monkeypatch, tmp_path):
    monkeypatch.setenv("LOSSSCALE_TEST_LANES", str(lanes))
    code = "import background; print(background.SESSION.lanes)"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout == f"{lanes}\n"
