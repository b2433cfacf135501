"""Find the runs at or below a folder: TensorBoard run folders and W&B offline runs.

Example:
    >>> discover_runs("no/such/folder")
    []
"""

from __future__ import annotations

import os
import stat

__all__ = ["discover_runs"]


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def discover_runs(root: str) -> list[str]:
    """The runs at or below ``root``: TensorBoard run folders and W&B offline runs, sorted.

    A folder that holds event files (``*tfevents*``) directly is one TensorBoard run; an
    ``offline-run-*``/``run-*`` folder or a ``.wandb`` file is one W&B run. Only regular files
    count: a FIFO or socket named like an event file is ignored (opening it would block).
    ``root`` itself, when it is a run or a file, gives ``[root]``.
    """
    if not os.path.isdir(root):
        return [root] if os.path.exists(root) else []
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        base = os.path.basename(os.path.normpath(folder))
        wandb_files = [f for f in files if f.endswith(".wandb") and _is_regular_file(os.path.join(folder, f))]
        if base.startswith(("offline-run-", "run-")) and wandb_files:
            found.append(folder)
            dirs[:] = []  # its files/ and logs/ are part of it
            continue
        if any("tfevents" in f and _is_regular_file(os.path.join(folder, f)) for f in files):
            found.append(folder)
    return found
