"""Whether the ranks of a distributed run hold the same loss-scale state: the data, the words, the rule.

Framework-free. An integration gathers every rank's state at the log interval (torch: one
``all_gather`` of four float64 numbers per rank, see ``lossscale_callbacks.torch``) and hands it to
the :class:`~lossscale_callbacks.loop._logging_loop.LoggingLoop` as a :class:`RankedState`; the loop
writes ``loss_scale/ranks_disagree``, applies :class:`RanksDisagree` and says it in the summary.
Ranks that disagree are the silent failure of sharded fp16 training: an overflow flag not
reduced across the shards, a rank resumed from another checkpoint, a rank that skipped
``update()``; each rank then trains at its own scale and skips its own steps.

Example:
    >>> ranks = RankStates.from_rows([[1024.0, 3, 1, 50], [1024.0, 3, 1, 50], [512.0, 0, 2, 50]])
    >>> ranks.differing()
    [2]
    >>> for group in ranks.describe().split("; "):
    ...     print(group)
    ranks 0, 1: scale 1024, growth counter 3, 1 of 50 steps skipped
    rank 2: scale 512, growth counter 0, 2 of 50 steps skipped
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from lossscale_callbacks._health import ACTIONS, Verdict, split_rules
from lossscale_callbacks._metrics import RANKS_DISAGREE, RANKS_TAG
from lossscale_callbacks._sinks import SinkGroup
from lossscale_callbacks._state import LossScaleState
from lossscale_callbacks._validation import check_choice

__all__ = ["RankAgreement", "RankStates", "RankedState", "RanksDisagree", "split_health"]

# What each rank contributes to the gather, in this order.
RANK_FIELDS = ("scale", "growth_counter", "skipped_steps", "steps")


def _key(row: tuple[float, int, int, int]) -> tuple[Any, ...]:
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row)


@dataclasses.dataclass(frozen=True)
class RankStates:
    """Every rank's (scale, growth counter, skipped steps, steps), rank 0 first, read at one interval."""

    rows: tuple[tuple[float, int, int, int], ...]

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[float]]) -> RankStates:
        """From one row of four numbers per rank (a gathered float64 tensor's ``tolist()``).

        Raises:
            ValueError: a row does not hold four numbers, or a count is not a whole number >= 0.
        """
        checked = []
        for rank, row in enumerate(rows):
            row = list(row)
            if len(row) != len(RANK_FIELDS):
                raise ValueError(f"rows: rank {rank} holds {len(row)} numbers, expected {list(RANK_FIELDS)}")
            counts = row[1:]
            if not all(math.isfinite(c) and c >= 0 and float(c).is_integer() for c in counts):
                raise ValueError(f"rows: rank {rank}'s counts must be whole numbers >= 0, got {counts}")
            checked.append((float(row[0]), *(int(c) for c in counts)))
        if not checked:
            raise ValueError("rows must hold at least one rank")
        return cls(tuple(checked))  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        return len(self.rows)

    def differing(self) -> list[int]:
        """The ranks whose state differs from rank 0's."""
        first = _key(self.rows[0])
        return [rank for rank, row in enumerate(self.rows) if _key(row) != first]

    def describe(self) -> str:
        """The ranks grouped by the state they hold, in plain words."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for rank, row in enumerate(self.rows):
            groups.setdefault(_key(row), []).append(rank)
        parts = []
        for ranks in groups.values():
            scale, growth, skipped, steps = self.rows[ranks[0]]
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            parts.append(f"{who}: scale {scale:g}, growth counter {growth}, "
                         f"{skipped} of {steps} steps skipped")
        return "; ".join(parts)


class RankedState(LossScaleState):
    """A :class:`~lossscale_callbacks._state.LossScaleState` read on one rank, carrying every rank's
    (:attr:`ranks`), gathered at the same read."""

    ranks: RankStates

    def __new__(cls, state: Sequence[Any], ranks: RankStates) -> RankedState:
        self = super().__new__(cls, *state)
        self.ranks = ranks
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankedState, (tuple(self), self.ranks))


@dataclasses.dataclass(frozen=True)
class RanksDisagree:
    """Fires when a rank's loss-scale state differs from rank 0's at a log-interval read.

    Judged by the logging loop on the states gathered from every rank (never from the history of
    one rank's snapshots), once per stretch of disagreement.

    Args:
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    action: str = "warn"

    def __post_init__(self) -> None:
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return "every rank held the same loss-scale state at each read"

    def judge(self, ranks: RankStates, step: int) -> Verdict | None:
        """The verdict on one gathered read, or ``None`` when every rank agrees with rank 0."""
        differing = ranks.differing()
        if not differing:
            return None
        own_words = getattr(ranks, "disagreement_words", None)  # another family's ranks (fp8 scales)
        if own_words is not None:
            return Verdict("ranks_disagree", self.action, step, own_words(step))
        names = ", ".join(map(str, differing))
        return Verdict(
            "ranks_disagree", self.action, step,
            f"The ranks hold different loss-scale states at step {step} (rank(s) {names} differ from "
            f"rank 0): {ranks.describe()}. Each rank now scales and skips on its own, so the replicas "
            "drift apart. Usual causes: the overflow flag is not reduced across the shards "
            "(LossScaler(sync_found_inf=True)), a rank resumed from another checkpoint, or a rank "
            "that skipped scaler.update().")


def split_health(spec: Any) -> tuple[Any, RanksDisagree | None]:
    """``health=`` as the per-rank rules see it, and the rank-agreement rule it asks for.

    ``True``/``"warn"``/``"raise"``/``"stop"`` bring :class:`RanksDisagree` with that action; a list
    of rules brings the :class:`RanksDisagree` in it (taken out of the list); ``None``/``False``
    none.
    """
    spec, rules = split_rules(spec, RanksDisagree, lambda action: (RanksDisagree(action),))
    return spec, (rules[-1] if rules else None)


class RankAgreement:
    """The logging loop's rank agreement over one run: each gathered read compared, a disagreement said
    once per stretch of reads that disagree (a verdict when the :class:`RanksDisagree` rule is on, a
    text to the sinks either way), the count for the metrics and a sentence for the summary.

    Example:
        >>> agreement = RankAgreement(RanksDisagree())
        >>> agreement.metrics(RankStates.from_rows([[8.0, 0, 0, 10], [8.0, 0, 0, 10]]))
        {'loss_scale/ranks_disagree': 0}
        >>> ranks = RankStates.from_rows([[8.0, 0, 0, 20], [4.0, 0, 1, 20]])
        >>> from lossscale_callbacks._health import HealthMonitor
        >>> health = HealthMonitor.from_spec("warn")
        >>> [v.rule for v in agreement.judge(ranks, 20, SinkGroup(), health)]
        ['ranks_disagree']
        >>> agreement.judge(ranks, 30, SinkGroup(), health)  # the same stretch: said once
        []
    """

    def __init__(self, rule: RanksDisagree | None, metric: str = RANKS_DISAGREE, tag: str = RANKS_TAG,
                 what: str = "loss-scale states") -> None:
        self.rule = rule
        self.metric, self.tag, self.what = metric, tag, what  # another family's (fp8: its scales)
        self.reads = 0  # reads that gathered every rank's state (none with one process)
        self.disagreements: list[tuple[int, str]] = []  # (step, the ranks' states in words)
        self.differing: int | None = None  # ranks that differ from rank 0 at the last gathered read
        self._in_stretch = False  # inside a stretch of reads where the ranks disagree

    def metrics(self, ranks: RankStates | None) -> dict[str, int]:
        """The read's ``loss_scale/ranks_disagree`` (none for a read of one process)."""
        return {} if ranks is None else {self.metric: len(ranks.differing())}

    def judge(self, ranks: RankStates | None, step: int, out: SinkGroup, health: Any = None) -> list[Verdict]:
        """The verdict of one gathered read when a stretch of disagreement begins (the words go to ``out``
        either way), joined to ``health``'s verdicts; ``[]`` for an agreeing read, a read of one process,
        or with the rule or the health rules off."""
        if ranks is None:
            return []
        self.reads += 1
        self.differing = len(ranks.differing())
        differ = bool(self.differing)
        began, self._in_stretch = differ and not self._in_stretch, differ
        if not began:
            return []
        self.disagreements.append((step, ranks.describe()))
        verdict = self.rule.judge(ranks, step) if self.rule is not None else None
        out.write_text(self.tag, verdict.message if verdict else f"Step {step}: {ranks.describe()}")
        if verdict is None or health is None:
            return []
        health.verdicts.append(verdict)
        return [verdict]

    def last_metrics(self) -> dict[str, int]:
        """``loss_scale/ranks_disagree`` of the last gathered read, ``{}`` with one process."""
        return {} if self.differing is None else {self.metric: self.differing}

    def sentence(self) -> str:
        """The ranks in the run's summary ("" when no read gathered them)."""
        if not self.reads:
            return ""
        if not self.disagreements:
            return (f" The ranks' {self.what} were compared at {self.reads} read(s) and "
                    "always agreed.")
        step, words = self.disagreements[0]
        return (f" The ranks' {self.what} disagreed {len(self.disagreements)} time(s) in "
                f"{self.reads} compared read(s), first at step {step} ({words}).")
