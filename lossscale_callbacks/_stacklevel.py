"""Warnings that point at the user's code: the ``stacklevel`` of the first frame outside this library.

Example:
    >>> user_stacklevel() >= 1
    True
"""

from __future__ import annotations

import sys

__all__ = ["user_stacklevel"]

# The frameworks that call our callbacks and monitors (Keras' CallbackList, Lightning's hooks, the
# Trainer's CallbackHandler): a warning raised in a callback points past them, at the user's line.
_CALLERS = frozenset({"keras", "tensorflow", "tf_keras", "jax", "torch", "lightning", "pytorch_lightning",
                      "lightning_fabric", "transformers", "accelerate"})


def _package(frame: object) -> str:
    return frame.f_globals.get("__name__", "").split(".")[0]  # type: ignore[attr-defined]


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this library and the
    frameworks that called it (``model.fit(...)``, ``trainer.fit(...)``, not Keras' ``callback_list.py``).

    Library frames are those of the core and of the integrations (``lossscale_callbacks.*``). When only
    framework frames follow (a framework's own command line), it points at the first of them.
    """
    frame = sys._getframe(1)  # the caller of this function is the one about to warn
    level = 1
    while frame is not None and _package(frame) == "lossscale_callbacks":
        frame = frame.f_back
        level += 1
    first_outside = level
    while frame is not None and _package(frame) in _CALLERS:
        frame = frame.f_back
        level += 1
    return level if frame is not None else first_outside
