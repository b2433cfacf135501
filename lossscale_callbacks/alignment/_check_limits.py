"""What ``lossscale-callbacks check`` accepts before it loads a model: archive size, batch, nesting depth.

A model file comes from anywhere, so the check bounds what it costs before TensorFlow sees it:

* a ``.keras`` file is a zip archive (config, metadata, weights). :func:`check_archive` reads its
  table of contents and refuses an archive whose members would inflate to more than a limit
  (256 MiB by default; Keras' own guard starts at 4 GiB per member), then inflates each member in
  1 MiB pieces to check that none inflates to more than it declares. A zip bomb is refused before
  anything is loaded, and memory stays at one piece whatever the archive holds;
* the batch size is a dimension of the traced graph, and TensorFlow computes some shapes (the
  multiples of a ``Tile``) in 32-bit integers: a batch above :data:`MAX_BATCH_SIZE` wraps around
  into a shape error about other numbers, so it is refused by name (:func:`check_batch_size`);
* Keras loads and traces a model by recursion, a few Python frames per layer of a chain: a
  1000-layer chain needs more than Python's default limit of 1000 frames. :func:`run_deep` runs
  the check with a higher limit on a thread with a large stack, and :class:`ModelTooDeepError` says
  when even that is not enough.

Nothing here imports a framework.

Example:
    >>> check_batch_size(64)
    >>> check_batch_size(10**14)
    Traceback (most recent call last):
    ...
    ValueError: batch_size must be an integer from 1 to 2147483647, got 100000000000000: TensorFlow computes \
some shapes of the traced step in 32-bit integers, so a larger batch wraps around
"""

from __future__ import annotations

import sys
import threading
import zipfile
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "DEFAULT_MAX_UNZIPPED_MIB",
    "DEFAULT_RECURSION_LIMIT",
    "MAX_BATCH_SIZE",
    "ArchiveTooLargeError",
    "ModelTooDeepError",
    "check_archive",
    "check_batch_size",
    "run_deep",
]

MAX_BATCH_SIZE = 2**31 - 1
DEFAULT_MAX_UNZIPPED_MIB = 256
DEFAULT_RECURSION_LIMIT = 10_000
_PIECE = 2**20
_STACK = 512 * 2**20  # address space for the check's thread; only the pages it touches are used

T = TypeVar("T")


class ArchiveTooLargeError(ValueError):
    """A model archive would inflate to more than the limit, or to more than it declares."""


class ModelTooDeepError(RecursionError):
    """Loading or tracing a model needs more Python frames than the recursion limit allows.

    Attributes:
        limit: the recursion limit that was not enough.
    """

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


def check_batch_size(batch_size: object) -> None:
    """Raise ``ValueError`` naming ``batch_size`` unless it is an int from 1 to :data:`MAX_BATCH_SIZE`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be an integer from 1 to {MAX_BATCH_SIZE}, got {batch_size!r}: "
                         "TensorFlow computes some shapes of the traced step in 32-bit integers, so a larger "
                         "batch wraps around")


def check_archive(path: str, max_unzipped_mib: float = DEFAULT_MAX_UNZIPPED_MIB) -> None:
    """Refuse a zip archive that would inflate to more than ``max_unzipped_mib`` MiB, or to more than it says.

    A file that is not a zip archive (a legacy ``.h5`` model) is left to the framework's loader.

    Raises:
        ArchiveTooLargeError: the members declare more than the limit, or one inflates to more
            than it declares (a damaged archive, or a bomb that lies about its size).
        ValueError: ``max_unzipped_mib`` is not a number > 0.
    """
    if isinstance(max_unzipped_mib, bool) or not isinstance(max_unzipped_mib, (int, float)) \
            or not max_unzipped_mib > 0:
        raise ValueError(f"max_unzipped_mib must be a number > 0, got {max_unzipped_mib!r}")
    if not zipfile.is_zipfile(path):
        return
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        total = sum(member.file_size for member in members)
        if total > max_unzipped_mib * 2**20:
            biggest = max(members, key=lambda member: member.file_size)
            raise ArchiveTooLargeError(
                f"{path} would inflate to {total / 2**20:,.0f} MiB ({biggest.filename}: "
                f"{biggest.file_size / 2**20:,.0f} MiB from {biggest.compress_size / 2**20:,.1f} MiB), "
                f"more than the {max_unzipped_mib:g} MiB the check inflates from a model file: a zip bomb, "
                f"or a model that big (then raise the limit to {total / 2**20 + 1:.0f} MiB)")
        for member in members:
            try:
                with archive.open(member) as stream:
                    while stream.read(_PIECE):  # zipfile stops at the declared size and checks the CRC
                        pass
            except zipfile.BadZipFile as exc:
                raise ArchiveTooLargeError(f"{path}: {member.filename} does not inflate to the "
                                           f"{member.file_size:,} bytes it declares ({exc})") from None


def run_deep(call: Callable[[], T], recursion_limit: int = DEFAULT_RECURSION_LIMIT) -> T:
    """``call()`` on a thread with a large stack and Python's recursion limit at ``recursion_limit``.

    The process's recursion limit and default thread stack size are put back afterwards. The thread
    is a daemon, so an interrupted check does not keep the process alive.

    Raises:
        ModelTooDeepError: ``call`` ran out of frames (a ``RecursionError``).
        ValueError: ``recursion_limit`` is not an int >= 100.
        BaseException: whatever ``call`` raised.
    """
    if isinstance(recursion_limit, bool) or not isinstance(recursion_limit, int) or recursion_limit < 100:
        raise ValueError(f"recursion_limit must be an integer >= 100, got {recursion_limit!r}")
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the calling thread
            outcome["error"] = exc

    limit, stack = sys.getrecursionlimit(), threading.stack_size()
    try:
        sys.setrecursionlimit(recursion_limit)
        threading.stack_size(_STACK)
        worker = threading.Thread(target=work, name="lossscale-check", daemon=True)
        worker.start()
    finally:
        threading.stack_size(stack)
    try:
        worker.join()
    finally:
        sys.setrecursionlimit(limit)
    error = outcome.get("error")
    if isinstance(error, RecursionError) and not isinstance(error, ModelTooDeepError):
        raise ModelTooDeepError(f"the model needs more than {recursion_limit} Python frames to load and "
                                "trace", recursion_limit) from error
    if error is not None:
        raise error  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
