"""One bad step as a record: what the ledger writes as one JSON line, and reads back.

A bad step is a step the skip truth says was skipped, or whose loss was non-finite. Its record holds
where it happened (step, rank, the micro-batches under gradient accumulation with their sample
identities), what the run knew of it (the scale, the cause, the forensics' origin and producing
layers) and, when it was replayed, what the replay found (:class:`Replay`) and the verdict that
follows (:func:`verdict_of`).

Example:
    >>> entry = Entry(step=34, rank=0, cause="overflow", scale=65536.0,
    ...               micro_batches=(MicroBatch(0, samples=(5, 37, 12)),))
    >>> Entry.from_json(entry.to_json()) == entry
    True
    >>> entry.samples()
    (5, 37, 12)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SCHEMA", "VERDICTS", "Entry", "MicroBatch", "Replay", "verdict_of"]

SCHEMA = 1
# What a replay can say, in the order of the questions it answers: would it happen again (transient),
# is it the scale (scale), float16's range (float16_range) or the data (data); under torch.distributed
# a step whose overflow came back only on other ranks' samples (other_rank).
VERDICTS = ("transient", "scale", "float16_range", "data", "other_rank")


def _json_number(value: float | None) -> float | str | None:
    """JSON has no Inf/NaN: they are written as strings, as Python's ``float()`` reads them back."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _ids(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step: its place under gradient accumulation and who was in it.

    Attributes:
        index: the micro-batch within the optimizer step (0 without gradient accumulation).
        samples: the sample identities in batch order (the sampler's indices, a ``datasets`` index
            column, an id field the user named), or ``None`` where the pipeline has none.
        epoch: the epoch the batch came from, where known.
        batch: the batch index within that epoch (Lightning's ``batch_idx``, Keras' ``batch``).
    """

    index: int
    samples: tuple[Any, ...] | None = None
    epoch: int | None = None
    batch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.index, "samples": None if self.samples is None else list(self.samples),
                "epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MicroBatch:
        return cls(int(data.get("micro_batch", 0)), _ids(data.get("samples")),
                   None if data.get("epoch") is None else int(data["epoch"]),
                   None if data.get("batch") is None else int(data["batch"]))

    def where(self) -> str | None:
        """``"batch 33 of epoch 0"`` (what a pipeline without sample ids can say), or ``None``."""
        if self.batch is None:
            return None
        return f"batch {self.batch}" + ("" if self.epoch is None else f" of epoch {self.epoch}")


@dataclasses.dataclass(frozen=True)
class Replay:
    """What replaying a bad step's batch on the same weights, with the step's RNG state, found.

    Every flag is ``True`` when the replay's loss and gradients were all finite, ``False`` when not,
    ``None`` when that replay was not run (no autocast to switch off for the float32 one).

    Attributes:
        scale: the step's scale, replayed first (``same``).
        same: finite at the same scale.
        low_scale: the much lower scale replayed second (the policy's minimum).
        low: finite at ``low_scale``.
        float32: finite with autocast off (float32 compute).
        dtype: the compute dtype of the run (``"float16"``, ``"bfloat16"``).
        micro_finite: per micro-batch, finite at the same scale (which micro-batch it was).
        rows: per micro-batch, the positions in it whose activations were the first to turn non-finite
            in the low-precision forward (empty where none did or the layer mixes samples).
        producer: the first layer whose output turned non-finite from finite inputs in that forward.
        origin: the gradients' origin at the same scale: the flagged layer nearest the loss.
        other_ranks: under ``torch.distributed``, the ranks whose replay of this step reproduced it.
    """

    scale: float
    same: bool
    low_scale: float | None = None
    low: bool | None = None
    float32: bool | None = None
    dtype: str = "float16"
    micro_finite: tuple[bool, ...] = ()
    rows: tuple[tuple[int, ...], ...] = ()
    producer: str | None = None
    origin: str | None = None
    other_ranks: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"scale": _json_number(self.scale), "same_scale_finite": self.same,
                "low_scale": _json_number(self.low_scale), "low_scale_finite": self.low,
                "float32_finite": self.float32, "dtype": self.dtype,
                "micro_batches_finite": list(self.micro_finite), "rows": [list(r) for r in self.rows],
                "producing_layer": self.producer, "origin_layer": self.origin,
                "reproduced_on_ranks": list(self.other_ranks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Replay:
        return cls(scale=float(data["scale"]), same=bool(data["same_scale_finite"]),
                   low_scale=_number(data.get("low_scale")), low=data.get("low_scale_finite"),
                   float32=data.get("float32_finite"), dtype=str(data.get("dtype", "float16")),
                   micro_finite=tuple(bool(v) for v in data.get("micro_batches_finite", ())),
                   rows=tuple(tuple(int(i) for i in r) for r in data.get("rows", ())),
                   producer=data.get("producing_layer"), origin=data.get("origin_layer"),
                   other_ranks=tuple(int(r) for r in data.get("reproduced_on_ranks", ())))


def verdict_of(replay: Replay | None) -> str | None:
    """The replay's answer, one of :data:`VERDICTS` (``None`` without a replay).

    Example:
        >>> verdict_of(Replay(scale=65536.0, same=False, low_scale=1.0, low=False, float32=True))
        'float16_range'
        >>> verdict_of(Replay(scale=65536.0, same=True))
        'transient'
    """
    if replay is None:
        return None
    if replay.same:
        return "other_rank" if replay.other_ranks else "transient"
    if replay.low:
        return "scale"
    if replay.float32 is None:
        return None  # reproducible at any scale, and nothing tells float16's range from the data
    return "float16_range" if replay.float32 else "data"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One bad step: one line of the ledger.

    Attributes:
        step: the optimizer step (attempted steps, skipped ones included, counted from 1: the
            dashboards' step axis).
        rank: the global rank that wrote it.
        cause: the skip truth's cause (``"overflow"``, ``"nonfinite"``, ``"spike"``...; a
            non-finite loss on an applied step is ``"nonfinite_loss"``).
        applied: whether the update was applied anyway (a non-finite loss in a run that does not skip).
        scale: the loss scale of the step (``None`` where the run had none).
        micro_batches: the step's micro-batches with their sample identities.
        origin_layer: the gradients' origin (the flagged layer nearest the loss), where known.
        producing_layer: the first layer whose activations turned non-finite, where known.
        replay: what the replay found, or ``None``.
        replay_note: why there was no replay (``"off"``, ``"budget"``, ``"unsupported: ..."``).
    """

    step: int
    rank: int
    cause: str
    scale: float | None = None
    micro_batches: tuple[MicroBatch, ...] = ()
    applied: bool = False
    origin_layer: str | None = None
    producing_layer: str | None = None
    replay: Replay | None = None
    replay_note: str | None = None

    @property
    def verdict(self) -> str | None:
        """The replay's verdict (:func:`verdict_of`)."""
        return verdict_of(self.replay)

    def samples(self) -> tuple[Any, ...]:
        """Every sample identity of the step, micro-batch by micro-batch (empty where none is known)."""
        return tuple(s for mb in self.micro_batches for s in (mb.samples or ()))

    def culprits(self) -> tuple[Any, ...]:
        """The samples the replay blames: the rows whose activations turned non-finite first, in the
        micro-batches that reproduced; all of those micro-batches' samples where no row stood out;
        every sample of the step without a replay that reproduced it on this rank."""
        replay = self.replay
        if replay is None or replay.same:
            return self.samples() if replay is None else ()
        out: list[Any] = []
        for position, micro in enumerate(self.micro_batches):
            finite = replay.micro_finite[position] if position < len(replay.micro_finite) else False
            if finite or micro.samples is None:
                continue
            rows = replay.rows[position] if position < len(replay.rows) else ()
            picked = [micro.samples[i] for i in rows if i < len(micro.samples)]
            out.extend(picked or micro.samples)
        return tuple(out)

    def to_json(self) -> str:
        """The entry as one JSON line (no newline); Inf/NaN scales as strings."""
        data = {"schema": SCHEMA, "step": self.step, "rank": self.rank, "cause": self.cause,
                "applied": self.applied, "scale": _json_number(self.scale),
                "micro_batches": [mb.to_dict() for mb in self.micro_batches],
                "origin_layer": self.origin_layer, "producing_layer": self.producing_layer,
                "replay": None if self.replay is None else self.replay.to_dict(),
                "replay_note": self.replay_note, "verdict": self.verdict,
                "culprits": list(self.culprits())}
        return json.dumps(data, separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, line: str | Mapping[str, Any]) -> Entry:
        """An entry from :meth:`to_json`'s line (or its parsed mapping).

        Raises:
            ValueError: not an entry (a missing or malformed field, named).
        """
        data = json.loads(line) if isinstance(line, str) else line
        if not isinstance(data, Mapping):
            raise ValueError(f"a ledger line must be a JSON object, got {type(data).__name__}")
        try:
            micro = data.get("micro_batches") or ()
            if not isinstance(micro, Sequence):
                raise ValueError("micro_batches must be a list")
            replay = data.get("replay")
            return cls(step=int(data["step"]), rank=int(data.get("rank", 0)), cause=str(data["cause"]),
                       scale=_number(data.get("scale")),
                       micro_batches=tuple(MicroBatch.from_dict(m) for m in micro),
                       applied=bool(data.get("applied", False)),
                       origin_layer=data.get("origin_layer"), producing_layer=data.get("producing_layer"),
                       replay=None if replay is None else Replay.from_dict(replay),
                       replay_note=data.get("replay_note"))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a ledger entry: {error}") from error
