"""One read of fp8 training's scales at the log interval, and its metric names: the schema of ``fp8/``.

Every watched tensor is a layer's ``input``, ``weight`` or ``grad_output`` (:data:`ROLES`), read as a
:class:`TensorRead`; one read of all of them at a log interval is an :class:`Fp8Read`. Its metrics are
``fp8/<layer>/<role>/<field>`` with the fields of :data:`FIELDS` (the table on the documentation's page
"FP8: reading the scales"); the TensorBoard and W&B sinks write them like any other metric, and
:func:`reads_from_series` rebuilds the reads from the logged series, so ``report`` judges a run with the
same rules as the run itself.

Example:
    >>> t = TensorRead("d2", "input", "e4m3", "delayed", amax=120.0, scale=0.75, saturated=936,
    ...                saturated_share=0.457, underflow_share=0.0, saturated_steps=1, history_length=1024)
    >>> read = Fp8Read(30, (t,))
    >>> sorted(read.metrics())[:3]
    ['fp8/d2/input/amax', 'fp8/d2/input/history_length', 'fp8/d2/input/saturated']
    >>> series = {tag: [(30, value)] for tag, value in read.metrics().items()}
    >>> reads_from_series(series)[0].tensors[0].saturated
    936
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lossscale_callbacks._metrics import FP8_TAG_PREFIX
from lossscale_callbacks.fp8._delayed import StepRows
from lossscale_callbacks.fp8._formats import ROLES

__all__ = ["FIELDS", "FINDINGS_TAG", "FP8_TAG_PREFIX", "PREFIX", "RANKS_DISAGREE", "RANKS_TAG", "Fp8Read",
           "TensorRead", "reads_from_series", "tag"]

PREFIX = FP8_TAG_PREFIX
# Written only by a run with more than one process: the ranks whose fp8 scales differ from rank 0's.
RANKS_DISAGREE = "fp8/ranks_disagree"
RANKS_TAG = "fp8/ranks"
FINDINGS_TAG = "fp8/findings"
# field -> what it is (the documentation's table is made from this): written per layer and role.
FIELDS: dict[str, str] = {
    "amax": "the largest |value| of the tensor at the step (delayed scaling: every step, rebuilt from the "
            "history; dynamic scaling: the last counted step)",
    "scale": "the scale the step cast with (values are multiplied by it; Keras keeps its reciprocal)",
    "saturated": "values clipped to the format's largest value in the interval's counted steps",
    "saturated_share": "saturated values over the values counted",
    "underflow_share": "share of the counted values that became subnormal or zero",
    "saturated_steps": "steps of the interval whose amax went beyond what the scale could hold",
    "first_saturated_step": "the first of them",
    "max_overshoot": "how many times beyond what its scale could hold the largest of them went",
    "history_ratio": "delayed scaling: the amax the step's scale was made from over the step's own amax",
    "outlier_step": "delayed scaling: the step of the one amax that set the scale (when one dominates)",
    "coarse_until": "delayed scaling: the last step whose scale still holds that amax",
    "history_length": "delayed scaling: the amax history's length",
    "stale_ratio": "after a checkpoint load: the loaded history's largest amax against the tensor's latest",
    "replaced_after": "after a checkpoint load: the step after which the loaded history took over",
}
_COUNTS = ("saturated", "saturated_steps", "first_saturated_step", "outlier_step", "coarse_until",
           "history_length", "replaced_after")


def tag(layer: str, role: str, field: str) -> str:
    """The metric name of one field of one tensor."""
    return f"{PREFIX}{layer}/{role}/{field}"


def _split(name: str) -> tuple[str, str, str] | None:
    """``(layer, role, field)`` of a metric name of this schema, else ``None``."""
    if not name.startswith(PREFIX):
        return None
    head, _, field = name.rpartition("/")
    layer, _, role = head[len(PREFIX):].rpartition("/")
    if field not in FIELDS or role not in ROLES or not layer:
        return None
    return layer, role, field


@dataclasses.dataclass(frozen=True)
class TensorRead:
    """One tensor of one layer at one read (host numbers; ``None``: not known at this read).

    Attributes:
        layer: the layer's name. role: ``"input"``, ``"weight"`` or ``"grad_output"``.
        format: ``"e4m3"`` or ``"e5m2"``. scaling: ``"dynamic"`` or ``"delayed"``.
        amax, scale: at the interval's last known step (see :data:`FIELDS`).
        rows: delayed scaling, ``(step, amax, scale)`` for every rebuilt step of the interval.
        others: as in :data:`FIELDS`; ``max_overshoot`` is how far the largest saturated amax went
            beyond the scale's range (x times), ``replaced_after`` the step after which a loaded
            history replaced the one the run had.
    """

    layer: str
    role: str
    format: str
    scaling: str
    amax: float | None = None
    scale: float | None = None
    saturated: int | None = None
    saturated_share: float | None = None
    underflow_share: float | None = None
    saturated_steps: int = 0
    max_overshoot: float | None = None
    first_saturated_step: int | None = None
    history_length: int | None = None
    history_ratio: float | None = None
    outlier_step: int | None = None
    coarse_until: int | None = None
    stale_ratio: float | None = None
    replaced_after: int | None = None
    rows: Sequence[tuple[int, float, float]] = ()

    @property
    def name(self) -> str:
        """``layer``'s ``role`` in words (``"d2's input"``)."""
        return f"`{self.layer}`'s {self.role.replace('_', ' ')}"

    def metrics(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for field in FIELDS:
            value = getattr(self, field, None)
            if value is None:
                continue
            out[tag(self.layer, self.role, field)] = int(value) if field in _COUNTS else float(value)
        return out


@dataclasses.dataclass(frozen=True)
class Fp8Read:
    """Every watched tensor at one read: the optimizer steps at the read, and the tensors.

    Attributes:
        step: the optimizer steps attempted when read.
        tensors: one :class:`TensorRead` per layer and role.
        ranks: every rank's compared scales, when the ranks were gathered
            (:class:`~lossscale_callbacks.fp8._ranks.Fp8Ranks`).
        ranks_differing: how many ranks differed from rank 0, for a read rebuilt from the series.
    """

    step: int
    tensors: tuple[TensorRead, ...]
    ranks: Any = None
    ranks_differing: int | None = None

    def metrics(self) -> dict[str, float | int]:
        """The read's metrics at its step (the per-step amax and scale of delayed scaling are in
        :meth:`step_metrics`)."""
        out: dict[str, float | int] = {}
        for tensor in self.tensors:
            out.update(tensor.metrics())
        if self.ranks is not None:
            out[RANKS_DISAGREE] = len(self.ranks.differing())
        elif self.ranks_differing is not None:
            out[RANKS_DISAGREE] = int(self.ranks_differing)
        return out

    def step_metrics(self) -> dict[int, dict[str, float]]:
        """Delayed scaling: ``{step: {amax and scale tags: value}}``, the rebuilt steps before the read's."""
        out: dict[int, dict[str, float]] = {}
        # The tensors whose rows span the same steps (every tensor of one read, as a rule) are joined as
        # columns and turned into rows at once: a read holds hundreds of steps of dozens of tensors.
        spans: dict[tuple[int, int], tuple[list[str], list[np.ndarray]]] = {}
        for tensor in self.tensors:
            rows = tensor.rows
            amax_tag = tag(tensor.layer, tensor.role, "amax")
            scale_tag = tag(tensor.layer, tensor.role, "scale")
            if isinstance(rows, StepRows):
                tags, columns = spans.setdefault((rows.first, len(rows)), ([], []))
                tags += (amax_tag, scale_tag)
                columns += (rows.amaxes, rows.scales)
                continue
            for step, amax, scale in rows:
                if step < self.step:
                    row = out.setdefault(step, {})
                    row[amax_tag], row[scale_tag] = float(amax), float(scale)
        for (first, count), (tags, columns) in spans.items():
            count = max(0, min(count, self.step - first))  # the steps before the read's
            table = np.column_stack(columns)[:count].tolist()
            if not out:  # the first span (as a rule the only one): a dict a step, made at once
                out = {step: dict(zip(tags, values, strict=True))
                       for step, values in zip(range(first, first + count), table, strict=True)}
                continue
            for step, values in zip(range(first, first + count), table, strict=True):
                out.setdefault(step, {}).update(zip(tags, values, strict=True))
        return out


def reads_from_series(series: Mapping[str, Iterable[tuple[int, float]]],
                      formats: Mapping[str, str] | None = None) -> list[Fp8Read]:
    """The reads a run logged, rebuilt from its series (``report``): one per step that holds a read's
    fields beyond amax and scale. ``formats`` maps a role to its format when known (default: e4m3 for
    input and weight, e5m2 for grad_output).

    Example:
        >>> read = reads_from_series({"fp8/d/weight/amax": [(10, 0.0)],
        ...                           "fp8/d/weight/saturated_steps": [(10, 0)]})[0]
        >>> read.step, read.tensors[0].amax, read.tensors[0].scaling
        (10, 0.0, 'dynamic')
    """
    formats = dict(formats or {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"})
    by_step: dict[int, dict[tuple[str, str], dict[str, float]]] = {}
    ranks: dict[int, float] = {}
    for name, points in series.items():
        if name == RANKS_DISAGREE:
            ranks.update((int(s), float(v)) for s, v in points)
            continue
        parts = _split(name)
        if parts is None:
            continue
        layer, role, field = parts
        for step, value in points:
            by_step.setdefault(int(step), {}).setdefault((layer, role), {})[field] = float(value)
    reads = []
    for step in sorted(by_step):
        tensors = []
        for (layer, role), fields in by_step[step].items():
            if set(fields) <= {"amax", "scale"}:
                continue  # a rebuilt step of delayed scaling, not a read
            kwargs: dict[str, object] = {}
            for field, value in fields.items():
                kwargs[field] = int(value) if field in _COUNTS and math.isfinite(value) else value
            scaling = "delayed" if "history_length" in fields else "dynamic"
            tensors.append(TensorRead(layer, role, formats.get(role, "e4m3"), scaling, **kwargs))  # type: ignore[arg-type]
        if tensors:
            differing = ranks.get(step)
            reads.append(Fp8Read(step, tuple(tensors),
                                 ranks_differing=None if differing is None else int(differing)))
    return reads


def merged_tensors(reads: Sequence[Fp8Read]) -> list[TensorRead]:
    """The newest read of every tensor among ``reads``."""
    newest: dict[tuple[str, str], TensorRead] = {}
    for read in reads:
        for tensor in read.tensors:
            newest[tensor.layer, tensor.role] = tensor
    return list(newest.values())
