"""Reading the ledger beside a run: every rank's file merged, and the bad samples listed.

``report RUN`` looks for ``bad_steps.rank<r>.jsonl`` in the run's folder (the folder given, or the
folder of the file given). Each rank wrote its own entries; a step appended twice to a rank's file (a
run resumed into the same folder) counts once, with its last line. The merged ledger lists the bad
samples: every sample a replay blamed, with its steps and ranks, then the steps told in words.

Example:
    >>> from lossscale_callbacks.ledger._entry import Entry, MicroBatch, Replay
    >>> replay = Replay(scale=65536.0, same=False, low_scale=1.0, low=False, float32=True,
    ...                 micro_finite=(False,), rows=((0,),), producer="fc2")
    >>> entries = [Entry(34, 0, "overflow", 65536.0, (MicroBatch(0, (37, 4)),), replay=replay),
    ...            Entry(74, 1, "overflow", 65536.0, (MicroBatch(0, (37, 9)),), replay=replay)]
    >>> [(s.sample, s.steps, s.ranks) for s in bad_samples(entries)]
    [(37, (34, 74), (0, 1))]
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lossscale_callbacks.ledger._entry import Entry
from lossscale_callbacks.ledger._words import group_sentences, listing

__all__ = ["FILE_PREFIX", "BadSample", "bad_samples", "ledger_file", "ledger_files", "ledger_markdown",
           "read_ledger_file", "read_ledgers"]

FILE_PREFIX = "bad_steps"
_FILE = re.compile(rf"^{FILE_PREFIX}\.rank(\d+)\.jsonl$")


def ledger_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its ledger in ``directory``."""
    return Path(directory) / f"{FILE_PREFIX}.rank{rank}.jsonl"


def read_ledger_file(path: str | os.PathLike[str]) -> Iterator[Entry]:
    """The entries of one ledger file, in the order written; a line that is not an entry (a copy cut
    short by a crash) is passed over."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield Entry.from_json(line)
            except ValueError:
                continue


def ledger_files(path: str | os.PathLike[str]) -> list[Path]:
    """The ledger files beside a run: in ``path`` if it is a folder, else in the folder of the file."""
    folder = Path(path)
    if not folder.is_dir():
        folder = folder.parent
    try:
        names = sorted(p for p in folder.iterdir() if _FILE.match(p.name) and p.is_file())
    except OSError:
        return []
    return sorted(names, key=lambda p: int(_FILE.match(p.name).group(1)))  # type: ignore[union-attr]


def read_ledgers(path: str | os.PathLike[str]) -> list[Entry]:
    """Every rank's entries beside the run, merged: one per (rank, step), the last written; by step, rank."""
    merged: dict[tuple[int, int], Entry] = {}
    for file in ledger_files(path):
        for entry in read_ledger_file(file):
            merged[(entry.rank, entry.step)] = entry
    return sorted(merged.values(), key=lambda e: (e.step, e.rank))


@dataclasses.dataclass(frozen=True)
class BadSample:
    """A sample the replays blamed: the steps and ranks it overflowed at, and their verdicts."""

    sample: Any
    steps: tuple[int, ...]
    ranks: tuple[int, ...]
    verdicts: tuple[str, ...]
    layers: tuple[str, ...]


def bad_samples(entries: Iterable[Entry]) -> list[BadSample]:
    """The samples blamed by a replay that overflowed again on them, in the order first seen."""
    found: dict[Any, dict[str, dict[Any, None]]] = {}
    for entry in entries:
        if entry.replay is None or entry.replay.same:
            continue
        layer = entry.replay.producer or entry.producing_layer
        for sample in entry.culprits():
            key = sample if not isinstance(sample, list) else tuple(sample)
            slot = found.setdefault(key, {"steps": {}, "ranks": {}, "verdicts": {}, "layers": {}})
            slot["steps"][entry.step] = None
            slot["ranks"][entry.rank] = None
            slot["verdicts"][entry.verdict or "reproducible"] = None
            if layer:
                slot["layers"][layer] = None
    return [BadSample(sample, tuple(sorted(slot["steps"])), tuple(sorted(slot["ranks"])),
                      tuple(slot["verdicts"]), tuple(slot["layers"])) for sample, slot in found.items()]


_VERDICT_WORDS = {"float16_range": "at any scale, finite in float32", "data": "at any scale and in float32",
                  "scale": "only at the step's scale", "reproducible": "at any scale"}


def ledger_markdown(entries: list[Entry]) -> str:
    """The report's section: the bad samples, then the bad steps in words (empty without entries)."""
    if not entries:
        return ""
    ranks = sorted({e.rank for e in entries})
    lines = [f"{len(entries)} bad step(s) in the ledger" + (f" of ranks {listing(ranks)}" if len(ranks) > 1
                                                            else "") + "."]
    samples = bad_samples(entries)
    if samples:
        lines += ["", "| sample | steps | ranks | overflowed | layer |", "|---|---|---|---|---|"]
        for bad in samples:
            verdicts = "; ".join(_VERDICT_WORDS.get(v, v) for v in bad.verdicts)
            layers = ", ".join(f"`{layer}`" for layer in bad.layers) or "-"
            lines.append(f"| {bad.sample} | {listing(bad.steps)} | {listing(bad.ranks)} | {verdicts} "
                         f"| {layers} |")
    else:
        lines.append("No replay blamed a sample.")
    lines += ["", *(f"- {s}" for s in group_sentences(entries))]
    return "\n".join(lines)
