"""Whether the ranks of a distributed run cast with the same fp8 scales: the data and the words.

The scales that must agree are those every rank computes from the same values: a replicated weight's
(dynamic scaling: the weight is the same on every data-parallel rank) and every delayed scale whose amax
is reduced across the ranks (TransformerEngine's ``reduce_amax``, Megatron's amax reduction group). An
integration gathers them at the log interval (torch: one ``all_gather`` of one float64 per tensor and
rank) into :class:`Fp8Ranks`; the loop compares them with its rank agreement, writes
``fp8/ranks_disagree`` and says which tensors differ. A rank whose scales differ casts the same weight
into other bits: its replica drifts from the others, as the 40B run of Megatron-LM PR #442 did.

Example:
    >>> ranks = Fp8Ranks(("d1/weight", "d2/weight"), ((0.5, 2.0), (0.5, 2.0), (0.5, 1.0)))
    >>> ranks.differing()
    [2]
    >>> ranks.describe()
    'rank 2 differs from rank 0 in 1 of 2 scales: d2/weight 1 (rank 0: 2)'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Fp8Ranks"]

# Scales within this relative distance are the same (an amax reduced in another order rounds differently).
_CLOSE = 1e-6


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=_CLOSE, abs_tol=0.0)


@dataclasses.dataclass(frozen=True)
class Fp8Ranks:
    """Every rank's compared fp8 scales at one read: ``names`` (``layer/role``) and one row per rank,
    rank 0 first."""

    names: tuple[str, ...]
    rows: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.rows or any(len(row) != len(self.names) for row in self.rows):
            raise ValueError(f"rows must hold one value per name ({len(self.names)}) for each rank")

    @classmethod
    def from_rows(cls, names: Sequence[str], rows: Sequence[Sequence[float]]) -> Fp8Ranks:
        return cls(tuple(names), tuple(tuple(float(v) for v in row) for row in rows))

    @property
    def world_size(self) -> int:
        return len(self.rows)

    def _differs(self, rank: int) -> list[int]:
        first = self.rows[0]
        return [i for i, (a, b) in enumerate(zip(first, self.rows[rank], strict=True)) if not _same(a, b)]

    def differing(self) -> list[int]:
        """The ranks whose scales differ from rank 0's."""
        return [rank for rank in range(1, len(self.rows)) if self._differs(rank)]

    def describe(self) -> str:
        """Which ranks differ in which scales, in plain words (the first three of each)."""
        parts = []
        for rank in self.differing():
            which = self._differs(rank)
            shown = ", ".join(f"{self.names[i]} {self.rows[rank][i]:g} (rank 0: {self.rows[0][i]:g})"
                              for i in which[:3])
            more = f" and {len(which) - 3} more" if len(which) > 3 else ""
            parts.append(f"rank {rank} differs from rank 0 in {len(which)} of {len(self.names)} scales: "
                         f"{shown}{more}")
        return "; ".join(parts) or f"all {len(self.rows)} ranks hold the same {len(self.names)} scales"

    def disagreement_words(self, step: int) -> str:
        """The finding when the ranks differ (the loop's ``ranks_disagree`` rule says it)."""
        return (f"The ranks cast with different fp8 scales at step {step}: {self.describe()}. Scales that "
                "every rank computes from the same values (a replicated weight, an amax reduced across the "
                "ranks) must agree; where they do not, each rank rounds the same tensor into other bits and "
                "the replicas drift apart (a 40B Megatron-LM run diverged so after about 1,000 iterations, "
                "PR #442). Usual causes: the amax reduced over the wrong process group, a rank resumed from "
                "another checkpoint, an amax taken from a rank's local shard of a sharded tensor.")
