"""Run readers: the plain series a run on disk holds, read by the integration that knows its format.

A *reader* turns a run on disk into plain series, ``{tag: [(step, value), ...]}``. Readers live
in the sink integrations (``lossscale_callbacks.tensorboard.reader``,
``lossscale_callbacks.wandb.reader``) and are found through the ``lossscale_callbacks.readers``
entry-point group, so the core never imports TensorBoard or W&B.

Example:
    >>> sorted(available_readers())  # doctest: +SKIP
    ['tensorboard', 'wandb']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from importlib import metadata as importlib_metadata
from typing import Any

__all__ = [
    "GROWTH_INTERVAL",
    "MAX_SCALE",
    "MIN_SCALE",
    "READER_GROUP",
    "Reader",
    "RunReadError",
    "Series",
    "available_readers",
    "read_series",
]

Series = dict[str, list[tuple[int, float]]]
Reader = Callable[[str], Series]

READER_GROUP = "lossscale_callbacks.readers"

# Bounds written next to the scale by the sinks when the policy is known (not part of the
# five-metric schema, which every framework fills; these come from the policy, not the state).
MIN_SCALE = "loss_scale/min_scale"
MAX_SCALE = "loss_scale/max_scale"
# The policy's growth interval, read back from the policy a run wrote (a one-point series).
GROWTH_INTERVAL = "loss_scale/growth_interval"


class RunReadError(ValueError):
    """A path holds no readable run: nothing there, no run in the folder, or a corrupt file."""


def _entry_points() -> dict[str, Any]:
    return {entry.name: entry for entry in importlib_metadata.entry_points(group=READER_GROUP)}


def available_readers() -> dict[str, Reader]:
    """The run readers installed in this environment, by name (``tensorboard``, ``wandb``, ...).

    A reader whose integration cannot be imported (its outside package is missing) is left out.
    """
    readers: dict[str, Reader] = {}
    for name, entry in _entry_points().items():
        try:
            readers[name] = entry.load()
        except Exception:  # an integration whose package is not installed is simply not offered
            continue
    return readers


def _looks_like_wandb(path: str) -> bool:
    if path.endswith(".wandb"):
        return True
    if os.path.isdir(path):
        base = os.path.basename(os.path.normpath(path))
        if base.startswith(("offline-run-", "run-")) or base == "wandb":
            return True
        return any(name.endswith(".wandb") for name in os.listdir(path)) or os.path.isdir(
            os.path.join(path, "wandb"))
    return False


def read_series(path: str, readers: Mapping[str, Reader] | None = None) -> tuple[str, Series]:
    """Read the run at ``path`` with the reader that fits it; return ``(reader name, series)``.

    Readers are imported only when tried (reading a TensorBoard run never imports W&B).

    Raises:
        RunReadError: the path does not exist, no reader is installed for it, or the reader
            found no run or a corrupt file.
    """
    if not os.path.exists(path):
        raise RunReadError(f"{path}: no such file or folder")
    loaders: dict[str, Callable[[], Reader]]
    if readers is None:
        loaders = {name: entry.load for name, entry in _entry_points().items()}
    else:
        loaders = {name: (lambda r=r: r) for name, r in readers.items()}
    if not loaders:
        raise RunReadError("no run reader is installed: install lossscale-callbacks[tensorboard] or [wandb]")
    # W&B runs are recognisable by name; everything else is tried as TensorBoard first.
    wandb_like = _looks_like_wandb(path)
    order = sorted(loaders, key=lambda name: 0 if (name == "wandb") == wandb_like else 1)
    errors: list[str] = []
    for name in order:
        try:
            reader = loaders[name]()
        except Exception:  # its outside package is not installed
            continue
        try:
            return name, reader(path)
        except RunReadError as exc:
            errors.append(str(exc))
    if not errors:
        raise RunReadError(f"{path}: no installed reader could be loaded ({', '.join(order)})")
    if len(errors) > 1 and all(" run here" in e for e in errors):
        raise RunReadError(f"{path}: no TensorBoard or W&B run here "
                           "(no events.out.tfevents.* file, no .wandb file)")
    # The reader that fits the path best (tried first) has the clearest message.
    raise RunReadError(errors[0])
