"""The skip list: the samples to leave out when a run resumes, and a sampler that leaves them out.

Which samples: those of bad steps whose replay overflowed again at any scale, on this rank's samples
(float16's range or the data: ``float16_range``, ``data``, or reproducible at any scale where no float32
replay ran), narrowed to the rows whose activations turned non-finite first where the replay found
them. A step that replayed finite (transient), or finite at a lower scale (the scale was too high, which
dynamic loss scaling corrects) says nothing against its samples. ``include="all"`` adds every sample of
the bad steps that were not replayed.

Two files, written together by :func:`write_skip_list`:

* ``skip_samples.json``: ``{"samples": [...], "batches": [...], "steps": [...]}``, what
  :func:`skip_samples` reads;
* ``skip_batches.json``: Lightning's ``SpikeDetection`` format, a JSON list of batch indices within
  their epoch (``batch_idx``), for code written against it.

Example:
    >>> class Sampler:  # any iterable of indices with a length: a torch Sampler is one
    ...     def __iter__(self):
    ...         return iter([5, 37, 2, 301, 8])
    ...     def __len__(self):
    ...         return 5
    >>> kept = skip_samples(Sampler(), [37, 301])
    >>> list(kept), len(kept)
    ([5, 2, 8], 5)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lossscale_callbacks.ledger._entry import Entry

__all__ = ["SKIP_BATCHES", "SKIP_SAMPLES", "read_skip_samples", "skip_list", "skip_samples",
           "write_skip_list"]

SKIP_SAMPLES = "skip_samples.json"
SKIP_BATCHES = "skip_batches.json"
_INCLUDE = ("reproduced", "all")


def _blamed(entry: Entry, include: str) -> bool:
    replay = entry.replay
    if replay is None:
        return include == "all"
    return not replay.same and not replay.low


def skip_list(entries: Iterable[Entry], include: str = "reproduced") -> dict[str, list[Any]]:
    """The samples, batch indices and steps to skip, from ledger entries (every rank's, merged).

    Args:
        entries: ledger entries.
        include: ``"reproduced"`` (the samples of steps that overflowed again at any scale) or
            ``"all"`` (also every sample of steps not replayed).

    Raises:
        ValueError: ``include`` is not one of those.
    """
    if include not in _INCLUDE:
        raise ValueError(f"include must be one of {list(_INCLUDE)}, got {include!r}")
    samples: dict[Any, None] = {}
    batches: set[int] = set()
    steps: set[int] = set()
    for entry in entries:
        if not _blamed(entry, include):
            continue
        steps.add(entry.step)
        for sample in entry.culprits():
            samples[sample] = None
        replay = entry.replay
        for position, micro in enumerate(entry.micro_batches):
            reproduced = replay is None or (position >= len(replay.micro_finite)
                                            or not replay.micro_finite[position])
            if reproduced and micro.batch is not None:
                batches.add(micro.batch)
    return {"samples": sorted(samples, key=_order), "batches": sorted(batches), "steps": sorted(steps)}


def _order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def write_skip_list(entries: Iterable[Entry], directory: str | os.PathLike[str],
                    include: str = "reproduced") -> tuple[Path, Path]:
    """Write ``skip_samples.json`` and Lightning's ``skip_batches.json`` into ``directory``.

    Returns:
        The two paths (samples, batches).
    """
    listed = skip_list(entries, include)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    samples_path, batches_path = folder / SKIP_SAMPLES, folder / SKIP_BATCHES
    samples_path.write_text(json.dumps(listed, indent=2) + "\n", encoding="utf-8")
    # Lightning's SpikeDetection writes json.dump(list_of_batch_indices, f, indent=4).
    batches_path.write_text(json.dumps(listed["batches"], indent=4), encoding="utf-8")
    return samples_path, batches_path


def read_skip_samples(source: Any) -> set[Any]:
    """The samples to skip from ``source``: a ``skip_samples.json`` (or its folder), a run folder with
    ledger files (read and judged as :func:`skip_list` does), or the identities themselves.

    Raises:
        ValueError: a path that holds none of these, or a file that is not a skip list.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir() and (path / SKIP_SAMPLES).is_file():
            path = path / SKIP_SAMPLES
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                raise ValueError(f"skip list {str(path)!r} could not be read: {error}") from error
            samples = data.get("samples") if isinstance(data, dict) else None
            if not isinstance(samples, list):
                raise ValueError(f"skip list {str(path)!r} has no 'samples' list: write it with "
                                 "`lossscale-callbacks report RUN --skip-list DIR` or write_skip_list")
            return set(samples)
        from lossscale_callbacks.ledger._read import read_ledgers

        entries = read_ledgers(path) if path.is_dir() else []
        if not entries:
            raise ValueError(f"{str(path)!r} holds no skip list ({SKIP_SAMPLES}) and no ledger of bad steps")
        return set(skip_list(entries)["samples"])
    if isinstance(source, Iterable):
        return set(source)
    raise ValueError(f"skip must be a path or an iterable of sample identities, got {source!r}")


class _SkipSampler:
    """A sampler without the skipped samples; everything else is the wrapped sampler's."""

    def __init__(self, sampler: Any, skip: set[Any]) -> None:
        self.sampler = sampler
        self.skip = frozenset(skip)

    def __iter__(self) -> Iterator[Any]:
        skip = self.skip
        for index in self.sampler:
            if index not in skip:
                yield index

    def __len__(self) -> int:
        """The wrapped sampler's length less the skipped samples it holds, where that is known without
        drawing an order (a sampler over its whole data source once each: ``SequentialSampler``,
        ``RandomSampler`` without replacement); else the wrapped sampler's length (an upper bound)."""
        total = len(self.sampler)
        source = getattr(self.sampler, "data_source", None)
        if source is None or getattr(self.sampler, "replacement", False):
            return total
        try:
            size = len(source)
        except TypeError:
            return total
        if total != size:
            return total
        return total - sum(1 for s in self.skip if isinstance(s, int) and 0 <= s < size)

    def __getattr__(self, name: str) -> Any:  # set_epoch, generator, num_samples... are the sampler's
        if name in ("sampler", "skip"):
            raise AttributeError(name)
        return getattr(self.sampler, name)


def skip_samples(sampler: Any, skip: Any) -> Any:
    """``sampler`` without the samples of a skip list: resume a run without its bad samples.

    Wraps any sampler (an iterable of indices with a length: ``RandomSampler``, ``DistributedSampler``,
    ...); what it yields is the sampler's order with the skipped indices left out. ``set_epoch`` and
    every other attribute are the wrapped sampler's. Pass it as ``DataLoader(..., sampler=...)``.

    Args:
        sampler: the sampler to wrap.
        skip: a ``skip_samples.json`` written by ``lossscale-callbacks report RUN --skip-list DIR`` (or
            its folder), a run folder holding ledger files (judged as the report judges them), or the
            sample identities themselves (the sampler's indices).

    Returns:
        A sampler yielding ``sampler``'s indices except the skipped ones.

    Raises:
        ValueError: ``skip`` is not one of those, or ``sampler`` is not iterable.

    Example:
        >>> list(skip_samples(range(6), {1, 4}))
        [0, 2, 3, 5]
    """
    if not isinstance(sampler, Iterable):
        raise ValueError(f"sampler must be an iterable of indices (a torch Sampler), got {sampler!r}")
    return _SkipSampler(sampler, read_skip_samples(skip))
