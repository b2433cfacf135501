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

from lossscale_callbacks._state import STATE_FIELDS, LossScaleState
from lossscale_callbacks._validation import INT64_MAX, check_int, check_number, host_number

TAG_PREFIX = "loss_scale/"  # every tag of this library starts with it
SCALE = "loss_scale/scale"
LOG2_SCALE = "loss_scale/log2_scale"
GROWTH_COUNTER = "loss_scale/growth_counter"
SKIPPED_STEPS = "loss_scale/skipped_steps"
SKIPPED_IN_INTERVAL = "loss_scale/skipped_in_interval"
SKIP_RATE = "loss_scale/skip_rate"
# Written only after a restart (the steps went backwards): which segment of the run a row belongs to.
SEGMENT = "loss_scale/segment"
# The optimizer steps attempted, as a value: a logger whose own step axis counts something else
# (Lightning's logging step counts batches, from 0) still carries the count the rates are based on.
STEPS = "loss_scale/steps"

METRIC_NAMES: tuple[str, ...] = (
    SCALE, LOG2_SCALE, GROWTH_COUNTER, SKIPPED_STEPS, SKIPPED_IN_INTERVAL, SKIP_RATE, STEPS,
)
# Skip truth (lossscale_callbacks.skips, the loop's _skip_truth room): the applied steps and the skipped ones
# by cause, cumulative. SKIPPED_STEPS keeps its meaning, the steps skipped for Inf/NaN gradients: an overflow
# (a run that scales, fp16) or a non-finite gradient (a run at a fixed scale of 1); a skip of the loss-spike
# rule is SKIPPED_SPIKE only, and APPLIED_NONFINITE counts non-finite steps a monitoring-only run applied.
# APPLIED_STEPS = STEPS - SKIPPED_STEPS - SKIPPED_SPIKE. Every integration writes them (a scaler without a
# step record: from the state, no spike or monitoring there).
APPLIED_STEPS = "loss_scale/applied_steps"
APPLIED_IN_INTERVAL = "loss_scale/applied_in_interval"
SKIPPED_OVERFLOW = "loss_scale/skipped_overflow"
SKIPPED_NONFINITE = "loss_scale/skipped_nonfinite"
SKIPPED_SPIKE = "loss_scale/skipped_spike"
APPLIED_NONFINITE = "loss_scale/applied_nonfinite"
SKIPPED_BY_CAUSE: dict[str, str] = {"overflow": SKIPPED_OVERFLOW, "nonfinite": SKIPPED_NONFINITE,
                                    "spike": SKIPPED_SPIKE}
OUTCOME_METRICS: tuple[str, ...] = (APPLIED_STEPS, APPLIED_IN_INTERVAL, SKIPPED_OVERFLOW, SKIPPED_NONFINITE,
                                    SKIPPED_SPIKE, APPLIED_NONFINITE)
# Written once per run (text or config), not as series: the policy's settings and bounds; and the reports.
POLICY_TAG = "loss_scale/policy"
SUMMARY_TAG = "loss_scale/summary"
RESTART_TAG = "loss_scale/restart"
ALIGNMENT_TAG = "loss_scale/alignment"
COUNT_METRICS: tuple[str, ...] = (GROWTH_COUNTER, SKIPPED_STEPS, SKIPPED_IN_INTERVAL, STEPS,
                                  *OUTCOME_METRICS)  # whole numbers
# The forward trace and the precision advice (lossscale_callbacks.forensics._activations, ._advice): per layer
# the log2 margin of its largest |output| below the compute dtype's max, the smallest of them, per layer the
# traced steps in which it produced the first non-finite value; the trace's table and the advice as text.
ACTIVATION_HEADROOM_PREFIX = "loss_scale/activation_headroom/"
MIN_ACTIVATION_HEADROOM = "loss_scale/min_activation_headroom"
ACTIVATION_PRODUCER_PREFIX = "loss_scale/activation_producer/"
ACTIVATIONS_TAG = "loss_scale/activations"
ADVICE_TAG = "loss_scale/advice"
INTERVAL_METRICS: tuple[str, ...] = (SKIPPED_IN_INTERVAL, SKIP_RATE, APPLIED_IN_INTERVAL)
# Bounds written next to the scale by the sinks when the policy is known (not part of the
# five-metric schema, which every framework fills; these come from the policy, not the state).
MIN_SCALE = "loss_scale/min_scale"
MAX_SCALE = "loss_scale/max_scale"
# The policy's growth interval, read back from the policy a run wrote (a one-point series).
GROWTH_INTERVAL = "loss_scale/growth_interval"
# Rank agreement (lossscale_callbacks.loop._rank_agreement): the number of ranks whose state differs from
# rank 0's (the rank that writes), 0 when they agree, written only by a run with more than one process;
# and the text naming them.
RANKS_DISAGREE = "loss_scale/ranks_disagree"
RANKS_TAG = "loss_scale/ranks"
# The overflow forensics (diagnose=True): skips per cause and per layer, headroom, histogram, text.
CAUSE_METRIC_PREFIX = "loss_scale/skips/"
# Why a step was skipped, one series per cause (what each means: lossscale_callbacks.forensics._gradients).
CAUSES = ("loss_nonfinite", "grad_inf", "grad_nan", "grad_nonfinite")
CAUSE_METRICS = {cause: f"{CAUSE_METRIC_PREFIX}{cause}" for cause in CAUSES}
LAYER_METRIC_PREFIX = "loss_scale/layer_skips/"
ORIGIN_METRIC_PREFIX = "loss_scale/layer_origins/"
HEADROOM_METRIC = "loss_scale/min_log2_headroom"
FORENSICS_TAG = "loss_scale/forensics"
HISTOGRAM_TAG = "loss_scale/log2_abs_scaled_grad"
# The W&B run's step axis and its end-of-run summary values.
STEP_METRIC = "loss_scale/step"
FINAL_SCALE = "loss_scale/final_scale"
TOTAL_SKIPPED_STEPS = "loss_scale/total_skipped_steps"
TOTAL_APPLIED_STEPS = "loss_scale/total_applied_steps"
OVERALL_SKIP_RATE = "loss_scale/overall_skip_rate"

# The "Loss scale" dashboard section: (chart title, tag), in order. The TensorBoard sink and the
# Lightning monitor both build their Custom Scalars layout from this one list.
DASHBOARD_SECTION = "Loss scale"
DASHBOARD_CHARTS: tuple[tuple[str, str], ...] = (
    ("loss scale, log2 (15 = 32768)", LOG2_SCALE),
    ("skipped steps per log interval", SKIPPED_IN_INTERVAL),
    ("skip rate per log interval", SKIP_RATE),
    ("growth counter (clean steps since the scale last changed)", GROWTH_COUNTER),
    ("skipped steps (cumulative)", SKIPPED_STEPS),
    ("applied steps (cumulative)", APPLIED_STEPS),
    ("loss scale", SCALE),
)
STEP_AXIS = "optimizer steps attempted (skipped steps included)"
_SNAPSHOT_COUNTS = ("step", "growth_counter", "hysteresis_left", "skipped_steps", "interval_steps",
                    "skipped_in_interval", "consecutive_skipped", "steps_at_min_scale",
                    "total_steps_at_min_scale")


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

    def __post_init__(self) -> None:
        try:  # the invariants first, cheaply: the report rebuilds a million snapshots
            consistent = (0 <= self.skipped_steps <= self.step and 0 <= self.skipped_in_interval
                          <= self.interval_steps and 0.0 <= self.skip_rate <= 1.0
                          and self.growth_counter >= 0 and self.hysteresis_left >= 0
                          and self.consecutive_skipped >= 0 and self.steps_at_min_scale >= 0
                          and self.total_steps_at_min_scale >= 0)
        except TypeError:
            consistent = False
        integral = (type(self.step) is type(self.skipped_steps) is type(self.interval_steps)
                    is type(self.skipped_in_interval) is type(self.growth_counter)
                    is type(self.hysteresis_left) is type(self.consecutive_skipped)
                    is type(self.steps_at_min_scale) is type(self.total_steps_at_min_scale) is int)
        if not (consistent and integral) or type(self.scale) is not float:
            self._explain()

    def _explain(self) -> None:
        """Raise the ``ValueError`` that names what is wrong with this snapshot."""
        for name in _SNAPSHOT_COUNTS:
            check_int(f"Snapshot.{name}", getattr(self, name), 0, INT64_MAX)
        check_number("Snapshot.skip_rate", self.skip_rate, 0.0, 1.0)
        if type(self.scale) is not float:
            raise ValueError(f"Snapshot.scale must be a float, got {self.scale!r}")
        raise ValueError(f"Snapshot: more skipped steps than steps (skipped_steps={self.skipped_steps}, "
                         f"step={self.step}, skipped_in_interval={self.skipped_in_interval}, "
                         f"interval_steps={self.interval_steps})")

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


_new_snapshot = object.__new__  # a frozen dataclass refuses __setattr__; its __dict__ does not


def log2_scale(scale: float) -> float:
    """``log2(scale)``, or NaN when ``scale`` is not a positive finite number."""
    return math.log2(scale) if math.isfinite(scale) and scale > 0 else math.nan


def _count(owner: str, name: str, value: Any) -> int:
    return check_int(f"{owner}{name}", value, 0, INT64_MAX, allow_integral_float=True)


def _raw_fields(state: Any) -> tuple[Any, ...]:
    """The five fields of ``state`` in :data:`STATE_FIELDS` order; a ``ValueError`` names a missing one."""
    if type(state) is LossScaleState:
        return tuple(state)
    if isinstance(state, Mapping):
        missing = [name for name in STATE_FIELDS if name not in state]
        if missing:
            raise ValueError(f"state: the field {missing[0]!r} is missing; a loss-scale state has "
                             f"{list(STATE_FIELDS)}")
        return tuple(state[name] for name in STATE_FIELDS)
    if not all(hasattr(state, name) for name in STATE_FIELDS):
        raise ValueError(f"state must be a LossScaleState or a mapping with {list(STATE_FIELDS)}, "
                         f"got {type(state).__name__}")
    return tuple(getattr(state, name) for name in STATE_FIELDS)


def observed_state(state: Any) -> LossScaleState:
    """A state read from a scaler, checked and as Python numbers: the input of every observation.

    The counters must be integers >= 0 (an integral float such as ``3.0``, as a float64 read
    gives them, is accepted) with ``skipped_steps <= steps``; the scale must be a real number. A
    scale that is NaN, Inf, zero or negative is kept: it is what a broken stock scaler holds, and
    the dashboards must show it.

    Raises:
        ValueError: naming the field that is missing or wrong.

    Example:
        >>> observed_state({"steps": 10.0, "skipped_steps": 2, "scale": 8, "growth_counter": 0,
        ...                 "hysteresis_left": 1})
        LossScaleState(scale=8.0, growth_counter=0, hysteresis_left=1, skipped_steps=2, steps=10)
        >>> observed_state({"steps": 3, "skipped_steps": 5, "scale": 8.0, "growth_counter": 0,
        ...                 "hysteresis_left": 1})
        Traceback (most recent call last):
        ...
        ValueError: state: skipped_steps (5) cannot exceed steps (3)
    """
    if type(state) is LossScaleState:  # a report's replay: already Python numbers, checked cheaply
        scale, growth, hysteresis, skipped, steps = state
        if (type(scale) is float and type(growth) is int and type(hysteresis) is int and type(skipped) is int
                and type(steps) is int and 0 <= growth <= INT64_MAX and 0 <= hysteresis <= INT64_MAX
                and 0 <= skipped <= steps <= INT64_MAX):
            return state
    elif type(state) is dict:  # the common case, without the checks' cost (a million reads in a report)
        try:
            scale, growth, hysteresis, skipped, steps = (state["scale"], state["growth_counter"],
                                                         state["hysteresis_left"], state["skipped_steps"],
                                                         state["steps"])
        except KeyError:
            scale, growth, hysteresis, skipped, steps = _raw_fields(state)  # names the missing field
    else:
        scale, growth, hysteresis, skipped, steps = _raw_fields(state)
    if not (type(growth) is int and type(hysteresis) is int and type(skipped) is int and type(steps) is int
            and 0 <= growth <= INT64_MAX and 0 <= hysteresis <= INT64_MAX and 0 <= steps <= INT64_MAX):
        growth, hysteresis, skipped, steps = (
            _count("state: ", name, host_number(value))
            for name, value in zip(STATE_FIELDS[1:], (growth, hysteresis, skipped, steps), strict=True))
    if type(scale) is not float:
        scale = host_number(scale)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"state: scale must be a real number, got {scale!r} ({type(scale).__name__})")
    if not 0 <= skipped <= steps:
        raise ValueError(f"state: skipped_steps ({skipped}) cannot exceed steps ({steps})")
    return LossScaleState(float(scale), growth, hysteresis, skipped, steps)


def counts_restarted(prev_steps: int, prev_skipped: int, steps: int, skipped: int) -> bool:
    """Whether two reads of the counters cannot come from one continuous run (a restart between them).

    Example:
        >>> counts_restarted(500, 3, 300, 1), counts_restarted(290, 0, 300, 21)
        (True, True)
        >>> counts_restarted(10, 1, 20, 4)
        False
    """
    return steps < prev_steps or skipped < prev_skipped or skipped - prev_skipped > steps - prev_steps


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
        self.min_scale = (None if min_scale is None
                          else check_number("min_scale", min_scale, 0.0, low_open=True))
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
        """Record one host read. ``state`` is a :class:`LossScaleState` or a mapping of host numbers.

        Raises:
            ValueError: a field is missing or wrong (see :func:`observed_state`).
        """
        state = observed_state(state)
        step, skipped, scale = state.steps, state.skipped_steps, state.scale
        prev = self._last
        prev_step = prev.step if prev is not None else 0
        prev_skipped = prev.skipped_steps if prev is not None else 0
        # A restored checkpoint or a new scaler can move the counters backwards, or add more skips than
        # steps: no continuous run does either, so the counts start afresh.
        if counts_restarted(prev_step, prev_skipped, step, skipped):
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
        # Made without Snapshot's checks: these values hold its invariants by construction (the state was
        # checked above, a restart resets the counts), and a report replays a million of them.
        # tests/test_core_metrics_health.py checks the snapshots the tracker makes against them.
        snapshot = _new_snapshot(Snapshot)
        snapshot.__dict__.update(
            step=step,
            scale=scale,
            growth_counter=state.growth_counter,
            hysteresis_left=state.hysteresis_left,
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


# ---------------------------------------- the policy table
# Written once per run under POLICY_TAG by the sinks without a config channel, read back by the run readers:
# the format lives here once, with the other names of what is written.


def config_markdown(config: Mapping[str, object]) -> str:
    """A policy config as a two-column markdown table (how sinks without a config channel show it).

    Example:
        >>> print(config_markdown({"type": "fixed", "scale": 128.0}))
        | setting | value |
        |---|---|
        | type | fixed |
        | scale | 128.0 |
    """
    # repr keeps every digit of a float (2**24 is 16777216.0, not :g's 1.67772e+07).
    rows = [f"| {key} | {value!r} |" if isinstance(value, float) else f"| {key} | {value} |"
            for key, value in config.items()]
    return "\n".join(["| setting | value |", "|---|---|", *rows])


def policy_values_from_markdown(markdown: str) -> dict[str, str]:
    """The ``setting -> value`` rows of the policy table, as the text written.

    Example:
        >>> policy_values_from_markdown("| setting | value |\\n|---|---|\\n| type | fixed |")
        {'type': 'fixed'}
    """
    values: dict[str, str] = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("setting", "---"):
            values[cells[0]] = cells[1]
    return values


def policy_bounds_from_markdown(markdown: str) -> tuple[float, float] | None:
    """``(min_scale, max_scale)`` from the policy table, or None when the table does not say.

    A fixed policy's bounds are its one scale.

    Example:
        >>> policy_bounds_from_markdown(config_markdown({"type": "fixed", "scale": 8.0}))
        (8.0, 8.0)
    """
    values = policy_values_from_markdown(markdown)
    try:
        if "min_scale" in values and "max_scale" in values:
            return float(values["min_scale"]), float(values["max_scale"])
        if values.get("type") == "fixed" and "scale" in values:
            return float(values["scale"]), float(values["scale"])
    except ValueError:
        return None
    return None


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "policy_text": """
    >>> text = config_markdown({"type": "dynamic", "min_scale": 1.0, "max_scale": 16777216.0,
    ...                         "growth_interval": 2000})
    >>> policy_bounds_from_markdown(text), policy_values_from_markdown(text)["growth_interval"]
    ((1.0, 16777216.0), '2000')
""",
}
