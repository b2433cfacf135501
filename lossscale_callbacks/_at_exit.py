"""Closing sinks at interpreter exit without keeping them alive: atexit holds a weak reference per sink.

Example:
    >>> from lossscale_callbacks._sinks import InMemorySink
    >>> sink = InMemorySink()
    >>> close_at_exit(sink)   # closed at exit unless closed before
    >>> forget_at_exit(sink)  # ... which its close() says with this
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

__all__ = ["close_at_exit", "forget_at_exit"]

_open_sinks: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def _close_one(ref: weakref.ref[Any]) -> None:
    sink = ref()
    if sink is None:
        return
    with _lock:
        if sink not in _open_sinks:
            return  # closed by its user already
        _open_sinks.discard(sink)
    try:
        sink.close()
    except Exception:  # nothing useful can be done about a failing sink at exit
        pass


def close_at_exit(sink: Any) -> None:
    """Close ``sink`` at interpreter exit unless it was closed (or garbage-collected) before.

    atexit keeps only a weak reference, so registering never keeps a sink alive. Each sink
    registers when it opens, i.e. after its backend (a W&B run) set up its own exit hooks, and
    atexit runs hooks newest first: the sink is closed while its backend still works.
    """
    with _lock:
        if sink in _open_sinks:
            return
        _open_sinks.add(sink)
    atexit.register(_close_one, weakref.ref(sink))


def forget_at_exit(sink: Any) -> None:
    """Undo :func:`close_at_exit` (the sink was closed by its user)."""
    with _lock:
        _open_sinks.discard(sink)
