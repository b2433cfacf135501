"""The interval clock of the logging loop: when an interval ends, the one rule of every integration.

An interval ends when the step count passes a multiple of ``log_every`` (crossing, not landing on it: a
call may come several steps later), or when ``every_seconds`` passed since the last read and the count
moved. The count is the integration's: optimizer steps, or Keras' batch index in the epoch.

Example:
    >>> clock = IntervalClock(log_every=10)
    >>> [step for step in range(1, 31) if clock.due(step)]
    [10, 20, 30]
    >>> clock.restart(-1)  # a count that starts again (Keras, at each epoch): its step 0 ends one
    >>> clock.due(0), clock.due(9), clock.due(12)
    (True, False, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lossscale_callbacks._validation import INT64_MAX, check_int, check_number

__all__ = ["IntervalClock", "check_log_every"]


def check_log_every(log_every: Any, *, optional: bool = True) -> int | None:
    """``log_every`` checked, the one rule of every integration: an integer >= 1, or ``None`` where
    ``optional`` (an integration with another interval rule: a trainer's own, or ``every_seconds``).

    Raises:
        ValueError: ``log_every`` is not an integer >= 1 (or ``None`` where allowed), naming it.

    Example:
        >>> check_log_every(100), check_log_every(None)
        (100, None)
    """
    if log_every is None and optional:
        return None
    return check_int("log_every", log_every)


class IntervalClock:
    """When an interval ends: every ``log_every`` steps of the integration's count, or every
    ``every_seconds`` of ``clock`` (checked here, naming the argument).

    Raises:
        ValueError: ``log_every``, ``every_seconds`` or ``clock`` is invalid, naming it.
    """

    def __init__(self, log_every: int | None = None, every_seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log_every = check_log_every(log_every)
        self.every_seconds = (None if every_seconds is None else
                              check_number("every_seconds", every_seconds, 0.0, float("inf"), low_open=True))
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock
        self.start()

    def start(self) -> None:
        """A new run: the count starts at 0 and the seconds at now."""
        self._mark = 0
        self.read()

    def read(self) -> None:
        """A read happened now: ``every_seconds`` counts from here."""
        self._last_read_time = self.clock()

    def due(self, step: int) -> bool:
        """Whether an interval ends at ``step`` (see the module); a count that went back without
        :meth:`restart` starts again just before ``step``."""
        if type(step) is not int or step < -1:  # called every step: the full check only when needed
            step = check_int("step", step, -1, INT64_MAX)
        previous, self._mark = self._mark, step
        if step < previous:
            previous = step - 1
        if step == previous:
            return False
        if self.log_every is not None and step // self.log_every > previous // self.log_every:
            return True
        return self.every_seconds is not None and self.clock() - self._last_read_time >= self.every_seconds

    def restart(self, at: int) -> None:
        """The count starts again at ``at``: the next multiple of ``log_every`` it passes ends an interval."""
        self._mark = check_int("at", at, -1, INT64_MAX)
