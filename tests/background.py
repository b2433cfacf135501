"""Slow subprocess runs started at the start of the session, run while pytest runs the other tests.

Several modules read their results from one long subprocess (a Keras backend's check scripts, the Ray
session, a docs page's script). On a machine with few cores, pytest's own process leaves a core mostly
idle; these runs use it. A module asks for its runs by defining::

    def start_in_background(items, tmp_path_factory) -> None:
        background.submit(key, argv, env=..., timeout=..., order=...)  # what the session's ``items`` need

which the session fixture of ``conftest.py`` calls once, before the first test, when the module has tests
in the session (``pytest tests/test_fp8_core.py`` starts nothing; a module naming a Keras check script as
``KERAS_CHECKS`` gets ``keras_backend_runs.start_in_background``). Its tests then call
``background.wait(key)``: the run's exit status and output, as ``subprocess.run`` gives them, so a failure
in a background run fails the tests that read it, with its output. A run that was not submitted (the
tests selected otherwise, or ``LOSSSCALE_TEST_LANES=0``) is not waited for: the test runs it itself, as
without this file. The runs wait in one queue and run one at a time (``LOSSSCALE_TEST_LANES`` at a time),
in the order of the first test that reads each; a test that asks for a run no lane has started runs it
at once itself. ``conftest.py`` moves these modules' tests to the end of the session, so that their runs
are done by then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Finished:
    """What ``subprocess.run(..., capture_output=True, text=True)`` gives, and how long the run took."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def failure(self, limit: int = 3000) -> str:
        """The output's tails, for an assertion message."""
        head = f"timed out after {self.seconds:.0f} s" if self.timed_out else f"exit status {self.returncode}"
        return f"{head}\n{self.stdout[-limit:]}\n{self.stderr[-(2 * limit):]}"


@dataclass
class _Run:
    key: object
    argv: list[str]
    env: dict | None
    timeout: float
    cwd: str | None
    order: int
    claimed: bool = False
    proc: subprocess.Popen | None = None
    done: threading.Event = field(default_factory=threading.Event)
    finished: Finished | None = None


class Runs:
    """A queue of subprocess runs, run by ``lanes`` threads in ``order``, or by whoever waits first."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self._lock = threading.Lock()
        self._runs: dict[object, _Run] = {}
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self.finished: list[tuple[object, float]] = []  # (key, seconds) of the runs that ended

    def submit(self, key: object, argv: list[str], *, env: dict | None = None, timeout: float,
               cwd: str | None = None, order: int = 0) -> None:
        """Queue a run under ``key`` (a second submit of a key is ignored; nothing is queued without lanes);
        ``order``: the index of the first test that reads it (lower runs first)."""
        with self._lock:
            if self.lanes > 0 and key not in self._runs:
                self._runs[key] = _Run(key, list(argv), env, timeout, cwd, order)

    def submitted(self, key: object) -> bool:
        """Whether ``key`` was submitted (its tests then ``wait`` for it)."""
        return key in self._runs

    def start(self) -> None:
        """Start the lanes on what was submitted."""
        for _ in range(self.lanes):
            thread = threading.Thread(target=self._lane, name="background-runs", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait(self, key: object) -> Finished:
        """The finished run under ``key``: waited for, or run here and now when no lane has started it."""
        run = self._runs[key]
        if self._claim(run):
            self._execute(run)
        run.done.wait()
        return run.finished

    def result(self, key: object, argv: list[str], *, env: dict | None = None, timeout: float,
               cwd: str | None = None) -> Finished:
        """The run under ``key``: waited for when it was submitted, else ``argv`` run here and now (its
        test selected alone, or ``LOSSSCALE_TEST_LANES=0``), with the same timeout and the same kill."""
        if key not in self._runs:
            with self._lock:
                self._runs[key] = _Run(key, list(argv), env, timeout, cwd, 0)
        return self.wait(key)

    def stop(self) -> None:
        """Queued runs dropped, running ones killed with their children (a session stopped early, ``-x``)."""
        with self._lock:
            self._stopped = True
            for run in self._runs.values():
                run.claimed = True
                if run.proc is not None and run.proc.poll() is None:
                    _kill(run.proc)
        for thread in self._threads:
            thread.join(timeout=30)

    def _claim(self, run: _Run) -> bool:
        with self._lock:
            if run.claimed:
                return False
            run.claimed = True
            return True

    def _lane(self) -> None:
        while True:
            with self._lock:
                waiting = sorted((r for r in self._runs.values() if not r.claimed), key=lambda r: r.order)
                if not waiting:
                    return
                run = waiting[0]
                run.claimed = True
            self._execute(run)

    def _execute(self, run: _Run) -> None:
        start = time.perf_counter()
        timed_out = False
        try:
            with self._lock:
                if self._stopped:
                    raise RuntimeError("the session ended before this run started")
                # a session of its own: a timeout or the end stops its children too (Ray's workers)
                run.proc = subprocess.Popen(run.argv, env=run.env, cwd=run.cwd, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            start_new_session=True)
            try:
                stdout, stderr = run.proc.communicate(timeout=run.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(run.proc)
                stdout, stderr = run.proc.communicate()
            run.finished = Finished(run.argv, run.proc.returncode, stdout, stderr,
                                    time.perf_counter() - start, timed_out)
        except Exception as error:  # whatever it is, the waiting test reports it
            seconds = time.perf_counter() - start
            run.finished = Finished(run.argv, -1, "", f"could not run: {error!r}", seconds)
        finally:
            if run.finished is None:  # interrupted (^C): the session's end kills the process
                run.finished = Finished(run.argv, -1, "", "interrupted", time.perf_counter() - start)
            with self._lock:
                self.finished.append((run.key, run.finished.seconds))
            run.done.set()

    def summary(self) -> str | None:
        """One line: how many runs went beside the tests, their seconds, the longest ones."""
        if not self.finished:
            return None
        ranked = sorted(self.finished, key=lambda finished: -finished[1])
        longest = ", ".join(f"{key} {seconds:.0f} s" for key, seconds in ranked[:5])
        total = sum(seconds for _, seconds in self.finished)
        return f"background runs: {len(self.finished)}, {total:.0f} s in all; the longest: {longest}"


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


# The session's runs: ``LOSSSCALE_TEST_LANES`` at a time beside pytest (default 1; 0: none, each module runs
# its own in its tests, as it would without this file).
SESSION = Runs(int(os.environ.get("LOSSSCALE_TEST_LANES", "1")))
submit, submitted, wait, result = SESSION.submit, SESSION.submitted, SESSION.wait, SESSION.result
