"""Run readers: the plain series a run on disk holds, read by the integration that knows its format.

A *reader* turns a run on disk into plain series, ``{tag: [(step, value), ...]}``. Readers live
in the sink integrations (``lossscale_callbacks.tensorboard._reader``,
``lossscale_callbacks.wandb._reader``) and are found through the ``lossscale_callbacks.readers``
entry-point group, so the core never imports TensorBoard or W&B.

Example:
    >>> load_reader("tensorboard").__name__  # doctest: +SKIP
    'read_run'
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata as importlib_metadata
from typing import Any

from lossscale_callbacks._extras import declared_extras, install_hint
from lossscale_callbacks._metrics import GROWTH_INTERVAL, MAX_SCALE, MIN_SCALE

__all__ = [
    "ENGINE_LOG",
    "GROWTH_INTERVAL",
    "LEVELS",
    "MAX_SCALE",
    "MIN_SCALE",
    "READER_GROUP",
    "TENSORBOARD",
    "WANDB",
    "FoundRun",
    "NoLossScaleError",
    "Reader",
    "ReplayedRun",
    "RunReadError",
    "RunSeries",
    "Series",
    "discover_runs",
    "ended_inside_record",
    "is_event_file_name",
    "is_regular_file",
    "kind_of_file",
    "load_reader",
    "looks_like_engine_log",
    "read_series",
]

# ----------------------------------------
# Find every run at or below a path: TensorBoard run folders and W&B runs, recognised by their file names.
#
# Discovery looks at names only and opens no file, so every run is found whether or not its reader
# is installed, its files can be read, or they hold what their names promise; the report lists each
# one, read or with the reason it was not. What counts as a run:
#
# * a folder with event files (``*tfevents*``) directly in it: one TensorBoard run (its sub-folders
#   are runs of their own);
# * an ``offline-run-*``/``run-*`` folder with a ``.wandb`` file: one W&B run (its ``files/`` and
#   ``logs/`` belong to it); any other ``.wandb`` file is a W&B run by itself;
# * a folder that cannot be listed (no permission): reported, since runs may be inside;
# * any other file that is another engine's log or a Trainer state by its first 64 KiB (DeepSpeed, apex,
#   fairseq, Megatron-LM, ``trainer_state.json``; :func:`looks_like_engine_log`): the one exception to
#   names only.
#
# Symbolic links to folders are followed once: a link to a folder outside the tree is walked under
# the link's name, a link to a folder inside it (W&B's ``latest-run``) is the same run and is not
# listed twice, and link loops end. Only regular files count: a FIFO or socket named like an event
# file is ignored, since opening it would block.


TENSORBOARD, WANDB = "tensorboard", "wandb"
# Every scale an engine's log printed, each at its step or a bounded one (the picture draws them; the log
# points judged are those of the engine's counters).
LEVELS = "loss_scale/levels"

_WANDB_RUN_FOLDERS = ("offline-run-", "run-")


@dataclasses.dataclass(frozen=True)
class FoundRun:
    """One run found on disk.

    Attributes:
        path: the run's folder, or its file (an event file or a ``.wandb`` file given or found alone).
        kind: the reader that reads it (``"tensorboard"``, ``"wandb"``), or None when its name does
            not say (a file given directly: every installed reader is tried).
        problem: why the path could not even be looked into (a folder that cannot be listed), or None.
    """

    path: str
    kind: str | None
    problem: str | None = None


# ---------------------------------------- another engine's log, by its first 64 KiB

ENGINE_LOG = "engine_log"
_HEAD_BYTES = 64 * 1024
# Files that are never a log: checkpoints, arrays, data sets, archives, pictures.
_NOT_LOGS = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".npy", ".npz", ".pkl", ".pickle", ".h5",
             ".keras", ".onnx", ".msgpack", ".gz", ".zip", ".tar", ".png", ".jpg", ".svg", ".pdf", ".wandb",
             ".csv", ".tsv", ".parquet", ".arrow", ".model", ".yaml", ".yml", ".py")
# What each engine prints once at start, so a log is recognised before its first loss-scale line:
# deepspeed/__init__.py initialize (log_dist "DeepSpeed info: version=..."), deepspeed/runtime/engine.py
# ("DeepSpeedEngine configuration"), megatron/training/arguments.py _print_args("arguments", ...),
# fairseq's logger names (fairseq_cli/train.py format "%(asctime)s | %(levelname)s | %(name)s | ..."),
# apex/amp/frontend.py initialize ("Selected optimization level ..."); versions as in _engine_formats.
_BANNERS = ("DeepSpeed info: version=", "DeepSpeedEngine configuration",
            "------------------------ arguments ------------------------", "| fairseq_cli.train |",
            "| fairseq.trainer |", "Selected optimization level O")


def _has_loss_scale_line(text: str) -> bool:
    # The engine-log reader is imported here, when a file that is neither an event file nor a .wandb file
    # is looked at: a report of TensorBoard or W&B runs never loads it.
    from lossscale_callbacks.report._engine_lines import engine_lines

    return engine_lines(text.splitlines(keepends=True))


def looks_like_engine_log(path: str) -> bool:
    """Whether ``path`` is, by its first 64 KiB, another engine's log or a Trainer state (a cheap test).

    A ``.json`` file counts only when it is a Trainer state (it holds ``"log_history"``); a text file
    when it holds an engine's start-up banner or one of its loss-scale lines. A binary file (a NUL
    byte) never counts. The caller passes regular files only (opening a FIFO would block).
    """
    name = os.path.basename(path).lower()
    if name.endswith(_NOT_LOGS) or "tfevents" in name:
        return False
    try:
        with open(path, "rb") as file:
            head = file.read(_HEAD_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    text = head.decode("utf-8", errors="replace")
    if name.endswith(".json"):
        return '"log_history"' in text
    return any(banner in text for banner in _BANNERS) or _has_loss_scale_line(text)


def is_regular_file(path: str) -> bool:
    """Whether ``path`` is a regular file (a FIFO or socket named like a run file would block when opened)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_event_file_name(name: str) -> bool:
    """Whether a file name is a TensorBoard event file's (a writer's temporary and lock files are not)."""
    return "tfevents" in name and not name.endswith((".tmp", ".lock"))


def kind_of_file(path: str) -> str | None:
    """The reader of a single file, from its name: ``"wandb"``, ``"tensorboard"`` or None.

    Example:
        >>> kind_of_file("run-abc.wandb"), kind_of_file("events.out.tfevents.1.host"), kind_of_file("a.txt")
        ('wandb', 'tensorboard', None)
    """
    name = os.path.basename(path)
    if name.endswith(".wandb"):
        return WANDB
    return TENSORBOARD if is_event_file_name(name) else None


def _runs_in_folder(folder: str, files: list[str]) -> tuple[list[FoundRun], bool]:
    """The runs a folder holds directly, and whether it is a W&B run folder (not to be walked into)."""
    regular = [f for f in sorted(files) if is_regular_file(os.path.join(folder, f))]
    wandb_files = [f for f in regular if f.endswith(".wandb")]
    if wandb_files and os.path.basename(os.path.normpath(folder)).startswith(_WANDB_RUN_FOLDERS):
        return [FoundRun(folder, WANDB)], True
    found = [FoundRun(folder, TENSORBOARD)] if any(is_event_file_name(f) for f in regular) else []
    found += [FoundRun(os.path.join(folder, f), WANDB) for f in wandb_files]
    # Other engines' logs and Trainer states, recognised by their content.
    return found + [FoundRun(os.path.join(folder, f), ENGINE_LOG) for f in regular
                    if kind_of_file(f) is None and looks_like_engine_log(os.path.join(folder, f))], False


def _overlaps(path: str, trees: set[str]) -> bool:
    # The same folder, a folder inside a walked tree, or one that holds a walked tree (a link to ..).
    return any(path == tree or path.startswith(tree + os.sep) or tree.startswith(path + os.sep)
               for tree in trees)


def _walk(top: str, walked: set[str], found: list[FoundRun]) -> None:
    """Add the runs in ``top`` to ``found``; ``walked`` holds the real paths of the trees walked so far."""
    def unlisted(error: OSError) -> None:
        path = error.filename or top
        found.append(FoundRun(path, None, f"{path}: the folder cannot be listed ({error.strerror or error})"))

    for folder, dirs, files in os.walk(top, onerror=unlisted):
        dirs.sort()
        runs, is_wandb_run = _runs_in_folder(folder, files)
        found.extend(runs)
        if is_wandb_run:
            dirs[:] = []  # its files/ and logs/ are part of it
            continue
        for name in [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            dirs.remove(name)  # os.walk does not follow links: a linked folder is walked here, once
            target = os.path.realpath(os.path.join(folder, name))
            if not _overlaps(target, walked):  # else: W&B's latest-run, another name, or a loop
                walked.add(target)
                _walk(os.path.join(folder, name), walked, found)


def discover_runs(root: str) -> list[FoundRun]:
    """Every run at or below ``root``, sorted by path (``[]`` when nothing is there).

    ``root`` itself, when it is a file, gives one run; when it is a run folder, it is the first run.
    """
    if not os.path.isdir(root):
        if not os.path.lexists(root):
            return []
        sniffed = is_regular_file(root) and looks_like_engine_log(root)
        return [FoundRun(root, kind_of_file(root) or (ENGINE_LOG if sniffed else None))]
    found: list[FoundRun] = []
    _walk(root, {os.path.realpath(root)}, found)
    return sorted(found, key=lambda run: run.path.split(os.sep))


Series = dict[str, list[tuple[int, float]]]
Reader = Callable[[str], Series]

READER_GROUP = "lossscale_callbacks.readers"



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


class ReplayedRun(RunSeries):
    """A run too long to hold point by point: its series thinned for printing and drawing, and its every
    log point replayed for judging.

    The mapping holds the series as :class:`~._series_thinning.ThinnedRun` keeps them (every point of
    a run up to 32,768 log points) and the run-wide ones (``loss_scale/min_scale``,
    ``loss_scale/growth_interval``); ``replay()`` gives every log point ``(step, scale, cumulative
    skipped)`` in the order logged, each time it is called, for the report to judge them one at a
    time. The scales are not checked against policy bounds (no engine log carries a maximum scale).

    Example:
        >>> run = ReplayedRun({"loss_scale/scale": [(1, 8.0)], "loss_scale/skipped_steps": [(1, 0.0)]},
        ...                   replay=lambda: iter([(1, 8.0, 0)]))
        >>> list(run.replay())
        [(1, 8.0, 0)]
    """

    def __init__(self, series: Mapping[str, list[tuple[int, float]]],
                 replay: Callable[[], Iterable[tuple[int, float, int]]],
                 damage: Iterable[str] = (), notes: Iterable[str] = (), *,
                 engine: Mapping[str, Any] | None = None,
                 steps_known: bool = True, scale_known: bool = True, skips_known: bool = True,
                 verdicts: Iterable[Any] = (), verdicts_always: Iterable[bool] = ()) -> None:
        super().__init__(series, damage=damage, notes=notes)
        self.replay = replay
        self.engine = None if engine is None else dict(engine)
        self.steps_known = steps_known
        self.scale_known = scale_known
        self.skips_known = skips_known
        self.verdicts = list(verdicts)
        self.verdicts_always = list(verdicts_always) or [True] * len(self.verdicts)


def ended_inside_record(path: str, offset: int, records_before: int) -> str:
    """The one rule every reader applies to a file that ends inside a record (TensorBoard, W&B).

    A file cut inside a record looks like a run still being written, or a copy cut short: what came
    before is kept, and the returned note (for ``RunSeries.notes``) says where the file ends.
    A file that ends before its first record is whole (an empty one too) holds nothing to read: that
    is an error. A reader of a run of several files leaves such a file out as damage.

    Args:
        path: the file read.
        offset: the byte where the unfinished record starts.
        records_before: the whole records read before it.

    Raises:
        RunReadError: no whole record came before (nothing can be read).

    Example:
        >>> ended_inside_record("run.wandb", 4096, 12).split(" (")[0]
        'run.wandb ends inside the record at byte 4096'
    """
    if records_before == 0:
        raise RunReadError(f"{path}: not one whole record (the file is empty or ends inside its first "
                           "record): nothing can be read (a copy cut short, or a writer that has not written "
                           "one whole record yet)")
    return (f"{path} ends inside the record at byte {offset} (a run still being written, or a copy cut "
            "short): read up to there")


_LABELS = {TENSORBOARD: "TensorBoard", WANDB: "W&B"}
_ANY_READER = f"{install_hint(TENSORBOARD)} reads TensorBoard runs, {install_hint(WANDB)} W&B offline runs"


@functools.cache
def _entry_points() -> dict[str, Any]:
    # Looked up once a process: a sweep of a thousand runs would otherwise scan every installed
    # distribution a thousand times.
    return {entry.name: entry for entry in importlib_metadata.entry_points(group=READER_GROUP)}


def _install(name: str) -> str | None:
    return install_hint(name) if name in (declared_extras() or ()) else None


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


def _is_text(path: str) -> bool:
    """Whether ``path`` (a regular file) starts as text: no NUL byte in its first 64 KiB."""
    try:
        with open(path, "rb") as file:
            return b"\0" not in file.read(_HEAD_BYTES)
    except OSError:
        return False


def _guess_order(path: str) -> list[str]:
    """Every installed reader, the one the path's name suggests first (TensorBoard's when it says nothing);
    the engine-log reader for a file whose content is another engine's log, and first for any text file
    whose name is no TensorBoard's or W&B's: it says what the file holds (its lines, the formats known)."""
    regular = is_regular_file(path)
    named = kind_of_file(path)
    engine_log = regular and (looks_like_engine_log(path) or (named is None and _is_text(path)))
    names = [name for name in _entry_points() if name != ENGINE_LOG or engine_log]
    first = ENGINE_LOG if engine_log else named or TENSORBOARD
    return sorted(names, key=lambda name: name != first)


def read_series(path: str, kind: str | None = None) -> tuple[str, Series]:
    """Read the run at ``path``; return ``(reader name, series)``.

    ``kind`` names the reader (as :func:`~lossscale_callbacks.report._run_readers.discover_runs` finds
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


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "run_discovery": """
    >>> discover_runs("no/such/folder")
    []
    >>> discover_runs("exported.wandb")  # doctest: +SKIP
    [FoundRun(path='exported.wandb', kind='wandb', problem=None)]
""",
}
