"""The ledger in plain words: one sentence per bad step, and the run's bad steps grouped into a few.

The same words go into each entry, the end-of-run summary and ``report``. Steps with the same verdict
on the same samples and layer are told together ("steps 34 and 74 overflowed on sample 37 at any scale;
finite in float32: layer `fc2` exceeds float16 on this sample").

Example:
    >>> from lossscale_callbacks.ledger._entry import Entry, MicroBatch, Replay
    >>> replay = Replay(scale=65536.0, same=False, low_scale=1.0, low=False, float32=True,
    ...                 micro_finite=(False,), rows=((1,),), producer="fc2", origin="fc2")
    >>> entries = [Entry(step, 0, "overflow", 65536.0, (MicroBatch(0, (4, 37, 9)),), replay=replay)
    ...            for step in (34, 74)]
    >>> print(group_sentences(entries)[0])  # doctest: +NORMALIZE_WHITESPACE
    Steps 34 and 74 overflowed on sample 37 at any scale; finite in float32: layer `fc2` exceeds float16
    on this sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lossscale_callbacks.ledger._entry import Entry

__all__ = ["entry_sentence", "group_sentences", "listing", "samples_phrase", "steps_phrase"]

MAX_LISTED = 8  # items a sentence names before "and N more"


def listing(items: Sequence[Any], limit: int = MAX_LISTED) -> str:
    """``"1"``, ``"1 and 2"``, ``"1, 2 and 3"``, ``"1, 2, ... and 5 more"``."""
    words = [str(i) for i in items]
    if len(words) > limit:
        return ", ".join(words[:limit]) + f" and {len(words) - limit} more"
    if len(words) <= 2:
        return " and ".join(words)
    return ", ".join(words[:-1]) + f" and {words[-1]}"


def steps_phrase(steps: Sequence[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {listing(sorted(steps))}"


def samples_phrase(samples: Sequence[Any]) -> str:
    return f"sample {samples[0]}" if len(samples) == 1 else f"samples {listing(samples)}"


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _where(entry: Entry) -> str:
    """On which samples, or which batch where the pipeline has no identities."""
    culprits = entry.culprits()
    if culprits:
        return " on " + samples_phrase(list(dict.fromkeys(culprits)))
    places = [mb.where() for mb in entry.micro_batches if mb.where()]
    return " on " + listing(places) if places else ""


def _finding(entry: Entry, where: str, plural: bool = False) -> str:
    """What the replay says, after the steps and the samples (no leading capital, no full stop)."""
    replay = entry.replay
    verdict = entry.verdict
    if replay is None:
        note = entry.replay_note or "off"
        made = f", first non-finite in layer `{entry.producing_layer}`" if entry.producing_layer else ""
        return f"{'were' if plural else 'was'} bad ({entry.cause}){where}{made}; not replayed ({note})"
    dtype = replay.dtype
    layer = replay.producer or entry.producing_layer
    if verdict == "transient":
        return (f"replayed finite at the same scale ({_number(replay.scale)}) on the same batch and weights: "
                "transient (not the data, not the scale: a fault of that moment, such as the machine)")
    if verdict == "other_rank":
        ranks = listing(replay.other_ranks)
        return f"came from another rank: this rank's samples replayed finite, rank {ranks}'s reproduced it"
    if verdict == "scale":
        return (f"overflowed{where} at scale {_number(replay.scale)} and replayed finite at scale "
                f"{_number(replay.low_scale)}: the scale was too high (dynamic loss scaling backs off by "
                "itself)")
    if verdict == "float16_range":
        blame = (f"layer `{layer}` exceeds {dtype} on this sample" if layer
                 else f"the values exceed {dtype}'s range on this sample")
        return f"overflowed{where} at any scale; finite in float32: {blame}"
    if verdict == "data":
        blame = f" (first in layer `{layer}`)" if layer else ""
        return (f"overflowed{where} at any scale and in float32 too{blame}: the data, not {dtype} or the "
                "scale")
    return f"overflowed{where} at any scale (no float32 replay: autocast was not on)"


def entry_sentence(entry: Entry) -> str:
    """One bad step in words (what the entry's line and the report say)."""
    where = _where(entry)
    return f"Step {entry.step} {_finding(entry, where)}."


def _key(entry: Entry) -> tuple[Any, ...]:
    replay = entry.replay
    layer = (replay.producer if replay is not None else None) or entry.producing_layer
    culprits = tuple(dict.fromkeys(entry.culprits())) if entry.verdict not in (None, "transient") else ()
    return (entry.verdict, entry.replay_note if replay is None else None, culprits, layer,
            replay.other_ranks if replay is not None else ())


def group_sentences(entries: Iterable[Entry], limit: int = 10) -> list[str]:
    """The bad steps grouped by verdict, samples and layer: one sentence per group, at most ``limit``
    (then one that counts the rest)."""
    groups: dict[tuple[Any, ...], list[Entry]] = {}
    for entry in entries:
        groups.setdefault(_key(entry), []).append(entry)
    sentences = []
    for members in groups.values():
        first = members[0]
        steps = sorted({e.step for e in members})
        where = _where(first) if first.verdict not in (None, "transient") else ""
        text = _finding(first, where, plural=len(steps) > 1)
        phrase = steps_phrase(steps)
        sentences.append(f"{phrase[0].upper()}{phrase[1:]} {text}.")
    if len(sentences) > limit:
        rest = len(sentences) - limit
        sentences = [*sentences[:limit], f"... and {rest} more group(s) of bad steps (see the ledger)."]
    return sentences
