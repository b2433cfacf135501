"""The interval clock of the logging loop: when an interval ends, the one rule of every integration.

An interval ends when the step count passes a multiple of ``log_every`` (crossing, not landing on it: a
call may come several steps later), or when ``every_seconds`` passed since the last read and the count
moved. The count is the integration's, and on every integration ``log_every=N`` counts optimizer steps
(skipped ones included); the intervals that are not a count are ``every=``: ``"epoch"`` (at the end of each
epoch) and ``"trainer"`` (at the trainer's own log events), where an integration has them.
:func:`interval_args` is the one place an integration's ``log_every``/``every`` are sorted out (the old
spellings warn); the loop checks ``log_every`` itself.

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
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lossscale_callbacks._stacklevel import user_stacklevel
from lossscale_callbacks._validation import INT64_MAX, check_int, check_number

__all__ = ["EVERY", "IntervalClock", "check_log_every", "interval_args"]

# The intervals that are not a count of optimizer steps, by their one spelling.
EVERY = ("epoch", "trainer")


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


def interval_args(owner: str, log_every: Any, every: Any, *, allowed: tuple[str, ...] = (),
                  default: tuple[int | None, str | None] = (None, None),
                  deprecated: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """An integration's ``(log_every, every)``, sorted out once: ``log_every`` is handed on to the loop,
    which checks it; ``every`` is one of ``allowed`` (of :data:`EVERY`) or ``None``.

    Args:
        owner: the integration's class name, for the messages.
        log_every, every: as given (``None``: not given); ``log_every`` as for ``LoggingLoop``.
        allowed: the ``every`` values the integration has (none: ``log_every`` is its only interval).
        default: ``(log_every, every)`` when neither is given (``(None, None)``: one must be given).
        deprecated: an old spelling of ``log_every`` -> the ``every`` it meant: still works, with a
            ``FutureWarning`` that names the new spelling.

    Raises:
        ValueError: ``every`` is not one of ``allowed``, both are given, or neither (without a default).

    Example:
        >>> interval_args("Monitor", 50, None, allowed=("epoch",))
        (50, None)
        >>> interval_args("Monitor", None, None, allowed=("epoch", "trainer"), default=(None, "trainer"))
        (None, 'trainer')
    """
    if isinstance(log_every, str) and log_every in (deprecated or {}):
        new = (deprecated or {})[log_every]
        if every is not None:
            raise ValueError(f"{owner}: log_every={log_every!r} is the old spelling of every={new!r}; "
                             f"give every= alone")
        warnings.warn(f"{owner}(log_every={log_every!r}) is deprecated and will stop working: write "
                      f"{owner}(every={new!r}); log_every=N now counts N optimizer steps on every "
                      "integration", FutureWarning, stacklevel=user_stacklevel())
        log_every, every = None, new
    if every is not None and every not in allowed:
        choices = f"one of {list(allowed)} or None" if allowed else "None (it has no other interval)"
        raise ValueError(f"every must be {choices}, got {every!r}")
    if log_every is not None and every is not None:
        raise ValueError(f"{owner}: give log_every=N (optimizer steps) or every={every!r}, not both")
    if log_every is None and every is None:
        log_every, every = default
        if log_every is None and every is None:
            if allowed:
                raise ValueError(f"{owner} needs log_every=N (optimizer steps) or every= one of "
                                 f"{list(allowed)}")
            check_log_every(None, optional=False)  # no other interval: the loop's words for a missing count
    return log_every, every


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
