"""One metric schema for every framework and sink, and the host-side tracker that fills it.

Step axis: every metric is logged against the number of optimizer steps *attempted*,
skipped ones included (``LossScaleState.steps``). Keras 3's own optimizer does not count
skipped steps in ``iterations``; this axis does, so the dashboards of a Keras run and a
Lightning run line up.

The tracker runs only when the integration reads the device state, at the log interval:
one host read per interval, never one per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SCALE = "loss_scale/scale"
LOG2_SCALE = "loss_scale/log2_scale"
GROWTH_COUNTER = "loss_scale/growth_counter"
SKIPPED_STEPS = "loss_scale/skipped_steps"
SKIPPED_IN_INTERVAL = "loss_scale/skipped_in_interval"
SKIP_RATE = "loss_scale/skip_rate"
# The optimizer steps attempted, as a value: a logger whose own step axis counts something else
# (Lightning's logging step counts batches, from 0) still carries the count the rates are based on.
STEPS = "loss_scale/steps"

METRIC_NAMES: tuple[str, ...] = (
    SCALE, LOG2_SCALE, GROWTH_COUNTER, SKIPPED_STEPS, SKIPPED_IN_INTERVAL, SKIP_RATE, STEPS,
)
# Written once per run (text or config), not as series: the policy's settings and bounds
# (lossscale_callbacks.sinks.POLICY_TAG); and the reports.
SUMMARY_TAG = "loss_scale/summary"
ALIGNMENT_TAG = "loss_scale/alignment"
COUNT_METRICS: tuple[str, ...] = (GROWTH_COUNTER, SKIPPED_STEPS, SKIPPED_IN_INTERVAL, STEPS)

# The "Loss scale" dashboard section: (chart title, tag), in order. The TensorBoard sink and the
# Lightning monitor both build their Custom Scalars layout from this one list.
DASHBOARD_SECTION = "Loss scale"
DASHBOARD_CHARTS: tuple[tuple[str, str], ...] = (
    ("loss scale, log2 (15 = 32768)", LOG2_SCALE),
    ("skipped steps per log interval", SKIPPED_IN_INTERVAL),
    ("skip rate per log interval", SKIP_RATE),
    ("growth counter (clean steps since the scale last changed)", GROWTH_COUNTER),
    ("skipped steps (cumulative)", SKIPPED_STEPS),
    ("loss scale", SCALE),
)
STEP_AXIS = "optimizer steps attempted (skipped steps included)"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one read of the device state tells, plus what the tracker derived from the last reads.

    ``consecutive_skipped`` and ``steps_at_min_scale`` are measured at log-interval
    resolution: an interval counts as all-skipped when every step in it was skipped, and as
    spent at ``min_scale`` when the scale was at its minimum at both of its ends.
    """

    step: int
    scale: float
    growth_counter: int
    hysteresis_left: int
    skipped_steps: int
    interval_steps: int
    skipped_in_interval: int
    skip_rate: float
    at_min_scale: bool
    consecutive_skipped: int
    steps_at_min_scale: int
    total_steps_at_min_scale: int

    def metrics(self) -> dict[str, float | int]:
        """The metric schema as plain numbers, ready for any logger: counts are ``int``, the rest ``float``.

        ``loss_scale/log2_scale`` is the scale's exponent (loss scales are powers of two, so the
        charts read 15, 14, 15... instead of hugging zero on a linear axis up to 2**24); NaN for a
        scale that is not a positive finite number (a broken stock scaler).
        """
        return {
            SCALE: self.scale,
            LOG2_SCALE: log2_scale(self.scale),
            GROWTH_COUNTER: int(self.growth_counter),
            SKIPPED_STEPS: int(self.skipped_steps),
            SKIPPED_IN_INTERVAL: int(self.skipped_in_interval),
            SKIP_RATE: self.skip_rate,
            STEPS: int(self.step),
        }


def log2_scale(scale: float) -> float:
    """``log2(scale)``, or NaN when ``scale`` is not a positive finite number."""
    return math.log2(scale) if math.isfinite(scale) and scale > 0 else math.nan


def _host_value(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state[name]
    return getattr(state, name)


class MetricsTracker:
    """Turns successive host reads of the state into :class:`Snapshot` s.

    Args:
        min_scale: the policy's ``min_scale``; a scale at or below it counts as "at the minimum".
            ``None`` means the scale has no minimum to get stuck at (a fixed scale); use
            :meth:`for_policy` to get this right for any policy.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
        >>> policy = DynamicPolicy(initial_scale=4.0, min_scale=1.0)
        >>> tracker = MetricsTracker(min_scale=policy.min_scale)
        >>> state = initial_state(policy)
        >>> for finite in [False, True, False, True]:
        ...     state = next_state(policy, state, finite)
        >>> snap = tracker.observe(state)  # the one host read of this interval
        >>> snap.metrics()["loss_scale/skip_rate"], snap.scale
        (0.5, 1.0)
    """

    def __init__(self, min_scale: float | None) -> None:
        self.min_scale = None if min_scale is None else float(min_scale)
        self.reset()

    @classmethod
    def for_policy(cls, policy: Any) -> MetricsTracker:
        """A tracker for ``policy``: a fixed scale is never "stuck at the minimum"."""
        return cls(policy.min_scale if policy.dynamic else None)

    def reset(self) -> None:
        self._last: Snapshot | None = None

    @property
    def last(self) -> Snapshot | None:
        return self._last

    def observe(self, state: Any) -> Snapshot:
        """Record one host read. ``state`` is a :class:`LossScaleState` or a mapping of host numbers."""
        step = int(_host_value(state, "steps"))
        skipped = int(_host_value(state, "skipped_steps"))
        scale = float(_host_value(state, "scale"))
        prev = self._last
        prev_step = prev.step if prev is not None else 0
        prev_skipped = prev.skipped_steps if prev is not None else 0
        # A restored checkpoint or a new run can move the counters backwards; start afresh.
        if step < prev_step or skipped < prev_skipped:
            prev, prev_step, prev_skipped = None, 0, 0
        interval = step - prev_step
        skipped_now = skipped - prev_skipped
        at_min = self.min_scale is not None and scale <= self.min_scale
        stayed_at_min = at_min and (prev.at_min_scale if prev else False)
        if interval == 0 and prev is not None:
            # A second read at the same step (e.g. at train end) adds nothing to the runs.
            consecutive, at_min_run = prev.consecutive_skipped, prev.steps_at_min_scale
        else:
            all_skipped = interval > 0 and skipped_now == interval
            consecutive = (prev.consecutive_skipped if prev else 0) + interval if all_skipped else 0
            at_min_run = (prev.steps_at_min_scale if prev else 0) + interval if stayed_at_min else 0
        snapshot = Snapshot(
            step=step,
            scale=scale,
            growth_counter=int(_host_value(state, "growth_counter")),
            hysteresis_left=int(_host_value(state, "hysteresis_left")),
            skipped_steps=skipped,
            interval_steps=interval,
            skipped_in_interval=skipped_now,
            skip_rate=skipped_now / interval if interval > 0 else 0.0,
            at_min_scale=at_min,
            consecutive_skipped=consecutive,
            steps_at_min_scale=at_min_run,
            total_steps_at_min_scale=(prev.total_steps_at_min_scale if prev else 0)
            + (interval if stayed_at_min else 0),
        )
        self._last = snapshot
        return snapshot
