"""Find every run at or below a path: TensorBoard run folders and W&B runs, recognised by their file names.

Discovery looks at names only and opens no file, so every run is found whether or not its reader
is installed, its files can be read, or they hold what their names promise; the report lists each
one, read or with the reason it was not. What counts as a run:

* a folder with event files (``*tfevents*``) directly in it: one TensorBoard run (its sub-folders
  are runs of their own);
* an ``offline-run-*``/``run-*`` folder with a ``.wandb`` file: one W&B run (its ``files/`` and
  ``logs/`` belong to it); any other ``.wandb`` file is a W&B run by itself;
* a folder that cannot be listed (no permission): reported, since runs may be inside;
* any other file that another engine's log or a Trainer state by its first 64 KiB (DeepSpeed, apex,
  fairseq, Megatron-LM, ``trainer_state.json``; :mod:`._engine_sniff`): the one exception to names only.

Symbolic links to folders are followed once: a link to a folder outside the tree is walked under
the link's name, a link to a folder inside it (W&B's ``latest-run``) is the same run and is not
listed twice, and link loops end. Only regular files count: a FIFO or socket named like an event
file is ignored, since opening it would block.

Example:
    >>> discover_runs("no/such/folder")
    []
    >>> discover_runs("exported.wandb")  # doctest: +SKIP
    [FoundRun(path='exported.wandb', kind='wandb', problem=None)]
"""

from __future__ import annotations

import dataclasses
import os
import stat

from lossscale_callbacks._engine_sniff import ENGINE_LOG, looks_like_engine_log

__all__ = ["ENGINE_LOG", "TENSORBOARD", "WANDB", "FoundRun", "discover_runs", "is_event_file_name",
           "is_regular_file", "kind_of_file"]

TENSORBOARD, WANDB = "tensorboard", "wandb"
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
