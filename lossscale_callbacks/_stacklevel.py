"""Warnings that point at the user's code: the ``stacklevel`` of the first frame outside this library.

Example:
    >>> user_stacklevel() >= 1
    True
"""

from __future__ import annotations

import sys

__all__ = ["user_stacklevel"]


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this library.

    Library frames are those of the core and of the integrations (``lossscale_callbacks.*``).
    """
    frame = sys._getframe(1)  # the caller of this function is the one about to warn
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "lossscale_callbacks":
        frame = frame.f_back
        level += 1
    return level
