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

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata as importlib_metadata
from typing import Any

from lossscale_callbacks._engine_sniff import ENGINE_LOG, looks_like_engine_log
from lossscale_callbacks.extras import EXTRAS, install_hint
from lossscale_callbacks.run_discovery import TENSORBOARD, WANDB, is_regular_file, kind_of_file

__all__ = [
    "GROWTH_INTERVAL",
    "MAX_SCALE",
    "MIN_SCALE",
    "READER_GROUP",
    "NoLossScaleError",
    "Reader",
    "RunReadError",
    "RunSeries",
    "Series",
    "available_readers",
    "load_reader",
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
    """A path holds no readable run: nothing there, no run in the folder, a corrupt file, no reader.

    Attributes:
        install: the pip command that installs a missing reader, or None.
    """

    def __init__(self, message: str, *, install: str | None = None) -> None:
        super().__init__(message)
        self.install = install


class NoLossScaleError(RunReadError):
    """The run was read, but it holds no loss-scale series on the optimizer-step axis."""


class RunSeries(dict[str, list[tuple[int, float]]]):
    """A reader's series, in the order they were written, plus what the reader has to say about them.

    ``damage``: records found damaged and left out (one sentence each); ``notes``: what is worth
    saying but is no damage (a file that ends inside a record: a run still being written). A plain
    dict from a reader means it has nothing to say.

    Example:
        >>> series = RunSeries({"loss_scale/scale": [(100, 1024.0)]}, damage=["record 7: bad checksum"])
        >>> series["loss_scale/scale"], series.damage, series.notes
        ([(100, 1024.0)], ['record 7: bad checksum'], [])
    """

    def __init__(self, series: Mapping[str, list[tuple[int, float]]] | None = None,
                 damage: Iterable[str] = (), notes: Iterable[str] = ()) -> None:
        super().__init__(series or {})
        self.damage = list(damage)
        self.notes = list(notes)


_LABELS = {TENSORBOARD: "TensorBoard", WANDB: "W&B"}
_ANY_READER = f"{install_hint(TENSORBOARD)} reads TensorBoard runs, {install_hint(WANDB)} W&B offline runs"


@functools.cache
def _entry_points() -> dict[str, Any]:
    # Looked up once a process: a sweep of a thousand runs would otherwise scan every installed
    # distribution a thousand times.
    return {entry.name: entry for entry in importlib_metadata.entry_points(group=READER_GROUP)}


def _install(name: str) -> str | None:
    return install_hint(name) if name in EXTRAS else None


def available_readers() -> dict[str, Reader]:
    """The run readers installed in this environment, by name (``tensorboard``, ``wandb``, ...).

    A reader whose integration cannot be imported (its outside package is missing) is left out.
    """
    readers: dict[str, Reader] = {}
    for name in _entry_points():
        try:
            readers[name] = load_reader(name)
        except RunReadError:
            continue
    return readers


def load_reader(name: str) -> Reader:
    """The reader called ``name`` (an entry point of the ``lossscale_callbacks.readers`` group).

    Raises:
        RunReadError: no such reader, or its package is missing; ``install`` says what to install.
    """
    label = _LABELS.get(name, name)
    entry = _entry_points().get(name)
    if entry is None:
        raise RunReadError(f"no {label} run reader is installed", install=_install(name))
    try:
        return entry.load()
    except ImportError as exc:
        hint = _install(name)
        raise RunReadError(f"the {label} run reader cannot be loaded ({exc})"
                           + (f"; install it with: {hint}" if hint else ""), install=hint) from None


def _guess_order(path: str) -> list[str]:
    """Every installed reader, the one the path's name suggests first (TensorBoard's when it says nothing);
    the engine-log reader only for a file whose content is another engine's log (it reads any text)."""
    engine_log = is_regular_file(path) and looks_like_engine_log(path)
    names = [name for name in _entry_points() if name != ENGINE_LOG or engine_log]
    first = ENGINE_LOG if engine_log else kind_of_file(path) or TENSORBOARD
    return sorted(names, key=lambda name: name != first)


def read_series(path: str, kind: str | None = None) -> tuple[str, Series]:
    """Read the run at ``path``; return ``(reader name, series)``.

    ``kind`` names the reader (as :func:`~lossscale_callbacks.run_discovery.discover_runs` finds
    it); ``None`` tries every installed reader, the likeliest first. Readers are imported only when
    used (reading a TensorBoard run never imports W&B).

    Raises:
        RunReadError: the path does not exist, the reader is not installed (``install`` says what
            to install), or the reader found no run or a corrupt file.
    """
    if not os.path.lexists(path):
        raise RunReadError(f"{path}: no such file or folder")
    if kind is not None:
        return kind, load_reader(kind)(path)
    order = _guess_order(path)
    if not order:
        raise RunReadError(f"{path}: no run reader is installed; {_ANY_READER}",
                           install=install_hint(TENSORBOARD))
    errors: list[RunReadError] = []
    for name in order:
        try:
            return name, load_reader(name)(path)
        except RunReadError as exc:
            errors.append(exc)
    if all(exc.install for exc in errors):  # not one reader could be loaded
        raise RunReadError(f"{path}: no installed reader could be loaded ({'; '.join(map(str, errors))})",
                           install=errors[0].install)
    # The reader that fits the path best (tried first) has the clearest message.
    raise next(exc for exc in errors if not exc.install)

