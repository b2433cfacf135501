"""The outcome of each optimizer step, and the record of the steps of an interval that were not ordinary.

Every optimizer step is either **applied** or **skipped**, and a step that is not an ordinary applied
one has exactly one cause:

======================  ======  ===================================================================
cause                   code    the step
======================  ======  ===================================================================
``"applied"``           0       was applied, its gradients finite (not recorded)
``"overflow"``          1       was skipped: a gradient was Inf/NaN in a run whose policy scales (fp16)
``"nonfinite"``         1       was skipped: a gradient was Inf/NaN at a fixed scale of 1 (bf16, fp32)
``"spike"``             2       was skipped by the spike rule (its gradients were finite)
``"applied_nonfinite"`` 3       was applied although a gradient was Inf/NaN (monitoring only)
======================  ======  ===================================================================

The code is what an integration writes on the device each step (:func:`step_code`, written once
against the rule's :class:`~lossscale_callbacks._ops.Ops`, branch-free); code 1 is named
``"overflow"`` or ``"nonfinite"`` by the run's policy when it is read (:func:`nonfinite_cause`).

**The scale rule sees the gradients, not the decision.** :func:`~lossscale_callbacks.next_state`
takes ``finite`` = "every gradient was finite" (:func:`rule_finite`): a spike skip had finite
gradients, so the loss scale treats it as a clean step (its growth counter counts it; it never backs
the scale off), and ``skipped_steps`` keeps its meaning, the steps skipped for Inf/NaN gradients. A
monitoring-only run (non-finite steps applied, scale fixed at 1) gives the rule ``finite=True``: that
step was not skipped. So the update rule is unchanged and bit-identical on every backend, and the
spike and monitoring modes are proven against it by the conformance tests of the integrations.

**The record.** An integration keeps, on the device, the last ``capacity`` non-ordinary steps (step
number, code, the scale the step used) in a ring written with device-side indexing every step, and
reads it once per log interval. :class:`IntervalOutcomes` is what one read says: every step of the
interval that was not an ordinary applied step, oldest first, and the exact count per cause. When an
interval has more non-ordinary steps than the ring holds, the oldest of them are not listed
(:attr:`IntervalOutcomes.missed` says how many); the counts stay exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lossscale_callbacks._ops import NUMPY_OPS, Ops
from lossscale_callbacks._state import LossScaleState

APPLIED_CODE, NONFINITE_CODE, SPIKE_CODE, APPLIED_NONFINITE_CODE = 0, 1, 2, 3
CODES = (APPLIED_CODE, NONFINITE_CODE, SPIKE_CODE, APPLIED_NONFINITE_CODE)

APPLIED, OVERFLOW, NONFINITE, SPIKE, APPLIED_NONFINITE = (
    "applied", "overflow", "nonfinite", "spike", "applied_nonfinite")
SKIP_CAUSES: tuple[str, ...] = (OVERFLOW, NONFINITE, SPIKE)
"""The causes of a skipped step."""
RECORDED_CAUSES: tuple[str, ...] = (OVERFLOW, NONFINITE, SPIKE, APPLIED_NONFINITE)
"""Every cause of a step that is not an ordinary applied one (what the record lists)."""


def nonfinite_cause(policy: Any) -> str:
    """What a skipped non-finite step is called in a run of ``policy``: ``"overflow"`` when the policy
    scales (a float16 run), ``"nonfinite"`` when it is fixed at 1 (bf16 or fp32), or ``None`` (no policy,
    a stock ``GradScaler``: it scales).

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, FixedPolicy
        >>> nonfinite_cause(DynamicPolicy()), nonfinite_cause(FixedPolicy(1.0))
        ('overflow', 'nonfinite')
    """
    if policy is None:
        return OVERFLOW
    constants = policy.constants
    return NONFINITE if constants.max_scale == constants.min_scale == 1.0 else OVERFLOW


def step_code(nonfinite: Any, spike: Any, skip_nonfinite: bool = True, ops: Ops = NUMPY_OPS) -> Any:
    """The step's outcome code (see the module's table): pure and branch-free, like the update rule.

    Args:
        nonfinite: whether a gradient of the step was Inf/NaN (a bool tensor, or 0/1).
        spike: whether the spike rule flagged the step (its gradients may be finite or not).
        skip_nonfinite: the run's setting (a host constant): skip non-finite steps (default), or
            apply them and only count them (monitoring).
        ops: the backend.

    Example:
        >>> [int(step_code(n, s)) for n, s in [(False, False), (True, False), (False, True), (True, True)]]
        [0, 1, 2, 1]
        >>> int(step_code(True, False, skip_nonfinite=False))
        3
    """
    nonfinite, spike = ops.as_bool(nonfinite), ops.as_bool(spike)
    bad = ops.count(NONFINITE_CODE if skip_nonfinite else APPLIED_NONFINITE_CODE)
    return ops.where(nonfinite, bad, ops.where(spike, ops.count(SPIKE_CODE), ops.count(APPLIED_CODE)))


def rule_finite(nonfinite: Any, skip_nonfinite: bool = True, ops: Ops = NUMPY_OPS) -> Any:
    """The ``finite`` input of :func:`~lossscale_callbacks.next_state` for a step: the gradients were
    finite, or the run applies non-finite steps (monitoring: nothing was skipped). A spike skip does not
    enter: the scale rule judges the gradients, not the decision.

    Example:
        >>> bool(rule_finite(True)), bool(rule_finite(True, skip_nonfinite=False))
        (False, True)
    """
    nonfinite = ops.as_bool(nonfinite)
    # skip_nonfinite is the run's setting, a host constant: not a branch on a tensor.
    return ops.logical_not(nonfinite) if skip_nonfinite else ops.logical_not(ops.logical_and(nonfinite,
                                                                                             ops.logical_not(nonfinite)))


def is_applied(code: Any, ops: Ops = NUMPY_OPS) -> Any:
    """Whether a step of this code was applied (codes 0 and 3).

    Example:
        >>> [bool(is_applied(c)) for c in CODES]
        [True, False, False, True]
    """
    code = ops.count(code) if isinstance(code, int) else code
    return ops.logical_not(ops.logical_and(code >= ops.count(NONFINITE_CODE), code <= ops.count(SPIKE_CODE)))


def cause_name(code: int, nonfinite: str = OVERFLOW) -> str:
    """The cause of a host code; ``nonfinite`` names code 1 (see :func:`nonfinite_cause`).

    Raises:
        ValueError: ``code`` is not one of :data:`CODES`.
    """
    if code == NONFINITE_CODE:
        return nonfinite
    names = {APPLIED_CODE: APPLIED, SPIKE_CODE: SPIKE, APPLIED_NONFINITE_CODE: APPLIED_NONFINITE}
    if code not in names:
        raise ValueError(f"code must be one of {list(CODES)}, got {code!r}")
    return names[code]


class StepOutcome(NamedTuple):
    """One optimizer step that was not an ordinary applied step.

    Attributes:
        step: the optimizer step, counted from 1 like the metrics' step axis (attempted steps,
            skipped ones included).
        cause: ``"overflow"``, ``"nonfinite"``, ``"spike"`` or ``"applied_nonfinite"``.
        scale: the loss scale the step was taken with (before the step's own update).
    """

    step: int
    cause: str
    scale: float

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped (every cause but ``"applied_nonfinite"``)."""
        return self.cause in SKIP_CAUSES


@dataclasses.dataclass(frozen=True)
class IntervalOutcomes:
    """What happened to the optimizer steps ``first_step .. last_step`` of one log interval.

    The interface a consumer of skipped steps builds on (the bad-step ledger, a dashboard): read once
    per log interval, host numbers only.

    Attributes:
        first_step: the interval's first optimizer step (the previous read's last step + 1).
        last_step: its last one (the steps attempted so far); ``last_step < first_step`` for an empty
            interval.
        outcomes: every step of the interval that was not an ordinary applied step, oldest first; at
            most the ring's capacity (see :attr:`missed`).
        counts: the interval's steps per cause, exact (also those not listed): every key of
            :data:`RECORDED_CAUSES`.
        missed: how many non-ordinary steps of the interval are not in :attr:`outcomes` because the
            interval had more of them than the ring holds (the oldest ones go first).
    """

    first_step: int
    last_step: int
    outcomes: tuple[StepOutcome, ...] = ()
    counts: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(RECORDED_CAUSES, 0))
    missed: int = 0

    def __post_init__(self) -> None:
        counts = {cause: int(self.counts.get(cause, 0)) for cause in RECORDED_CAUSES}
        unknown = set(self.counts) - set(RECORDED_CAUSES)
        if unknown:
            raise ValueError(f"counts: unknown cause(s) {sorted(unknown)}; allowed: {list(RECORDED_CAUSES)}")
        if any(v < 0 for v in counts.values()) or self.missed < 0:
            raise ValueError(f"counts and missed must be >= 0, got {counts} and {self.missed}")
        recorded = sum(counts.values())
        if recorded > max(self.steps, 0) or len(self.outcomes) + self.missed > recorded:
            raise ValueError(f"IntervalOutcomes: {len(self.outcomes)} listed and {self.missed} missed steps, "
                             f"counts {counts}, do not fit steps {self.first_step}..{self.last_step}")
        object.__setattr__(self, "counts", counts)

    @property
    def steps(self) -> int:
        """The interval's optimizer steps attempted."""
        return max(self.last_step - self.first_step + 1, 0)

    @property
    def skipped(self) -> int:
        """The interval's skipped steps, every cause."""
        return sum(self.counts[cause] for cause in SKIP_CAUSES)

    @property
    def applied(self) -> int:
        """The interval's applied steps (``applied_nonfinite`` ones included)."""
        return self.steps - self.skipped

    @property
    def skipped_steps(self) -> tuple[int, ...]:
        """The listed skipped steps' numbers."""
        return tuple(o.step for o in self.outcomes if o.skipped)

    def merged(self, later: IntervalOutcomes) -> IntervalOutcomes:
        """This interval and the ``later`` one that follows it, as one (a monitor reading twice per log).

        Raises:
            ValueError: ``later`` does not start right after this one.
        """
        if later.first_step != self.last_step + 1:
            raise ValueError(f"merged: the later interval starts at {later.first_step}, not at "
                             f"{self.last_step + 1}")
        counts = {c: self.counts[c] + later.counts[c] for c in RECORDED_CAUSES}
        return IntervalOutcomes(self.first_step, later.last_step, self.outcomes + later.outcomes, counts,
                                self.missed + later.missed)


def decode_records(rows: Sequence[Sequence[float]], written: int, previous: int, capacity: int,
                   nonfinite: str = OVERFLOW) -> tuple[tuple[StepOutcome, ...], int]:
    """The records a ring wrote since ``previous`` (oldest first) and how many of them were overwritten.

    The ring has ``capacity + 1`` rows ``[step, code, scale]``: record ``k`` (counted from 0 over the
    run) sits in row ``k % (capacity + 1)``, and the row after the newest record is the one the next step
    writes (each step writes it; only a non-ordinary step moves on), so the ``capacity`` newest records
    are intact.

    Args:
        rows: the ring's rows, as host numbers.
        written: records written so far (the device count, read with the rows).
        previous: records written at the previous read.
        capacity: the records the ring keeps.
        nonfinite: the name of code 1 (see :func:`nonfinite_cause`).

    Returns:
        ``(outcomes, missed)``.

    Example:
        >>> rows = [[3, 1, 1024.0], [17, 1, 512.0], [0, 0, 0.0]]
        >>> outcomes, missed = decode_records(rows, written=2, previous=0, capacity=2)
        >>> [(o.step, o.cause, o.scale) for o in outcomes], missed
        ([(3, 'overflow', 1024.0), (17, 'overflow', 512.0)], 0)
    """
    if len(rows) != capacity + 1:
        raise ValueError(f"rows: a ring of capacity {capacity} has {capacity + 1} rows, got {len(rows)}")
    if not 0 <= previous <= written:
        raise ValueError(f"written ({written}) must be >= previous ({previous}) >= 0")
    new = written - previous
    kept = min(new, capacity)
    outcomes = []
    for k in range(written - kept, written):
        step, code, scale = rows[k % (capacity + 1)]
        outcomes.append(StepOutcome(int(step), cause_name(int(code), nonfinite), float(scale)))
    return tuple(outcomes), new - kept


__all__ = [
    "APPLIED",
    "APPLIED_CODE",
    "APPLIED_NONFINITE",
    "APPLIED_NONFINITE_CODE",
    "CODES",
    "NONFINITE",
    "NONFINITE_CODE",
    "OVERFLOW",
    "RECORDED_CAUSES",
    "SKIP_CAUSES",
    "SPIKE",
    "SPIKE_CODE",
    "CarryingState",
    "IntervalOutcomes",
    "StepOutcome",
    "carry",
    "cause_name",
    "decode_records",
    "is_applied",
    "nonfinite_cause",
    "rule_finite",
    "step_code",
]


class CarryingState(LossScaleState):
    """A :class:`~lossscale_callbacks.LossScaleState` that takes attributes (see :func:`carry`)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (CarryingState, tuple(self))


def carry(state: Any, **extras: Any) -> Any:
    """``state`` (a :class:`~lossscale_callbacks.LossScaleState` read at the interval) carrying ``extras``
    as attributes: ``outcomes`` (the interval's :class:`IntervalOutcomes`) and ``followers`` (each
    follower's count), which the logging loop reads with ``getattr``. A state that takes attributes (a
    ``RankedState``) gets them set; a plain one is wrapped in a subclass that does.

    Example:
        >>> state = carry(LossScaleState(8.0, 0, 0, 1, 10), outcomes=IntervalOutcomes(1, 10))
        >>> state.outcomes.steps, state.steps, type(state).__name__
        (10, 10, 'CarryingState')
    """
    if not hasattr(state, "__dict__"):
        state = CarryingState(*state)
    for name, value in extras.items():
        setattr(state, name, value)
    return state
