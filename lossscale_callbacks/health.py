"""Health rules: plain-words verdicts on a run's loss scale, evaluated at the log interval.

Each rule is a pure function of the history of :class:`~lossscale_callbacks.metrics.Snapshot` s
(oldest first) that returns a :class:`Verdict` or ``None``. Rules never look at the device:
they see only what the integration already read at its log interval.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Protocol

from lossscale_callbacks.metrics import Snapshot

Action = Literal["warn", "raise", "stop"]
ACTIONS: tuple[str, ...] = ("warn", "raise", "stop")

_BF16_HINT = (
    "If fp16 keeps collapsing like this, bf16 (same exponent range as float32, no loss scaling "
    "needed) is the usual cure."
)


class LossScaleHealthError(RuntimeError):
    """Raised by a health rule whose action is ``"raise"``."""


class LossScaleHealthWarning(UserWarning):
    """Emitted by a health rule whose action is ``"warn"`` (or ``"stop"``)."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a rule found: which rule, what to do, at which step, and why in plain words."""

    rule: str
    action: str
    step: int
    message: str


class Rule(Protocol):
    action: str

    def __call__(self, history: Sequence[Snapshot]) -> Verdict | None: ...


def _check_action(action: str) -> None:
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {list(ACTIONS)}, got {action!r}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ConsecutiveSkips:
    """Fires when at least ``limit`` steps in a row were skipped.

    Args:
        limit: skipped steps in a row that count as a problem. The default (50) is well above
            the 10 to 20 steps a run with a high initial scale skips while the scale settles.
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    limit: int = 50
    action: str = "warn"

    def __post_init__(self) -> None:
        _check_positive_int("limit", self.limit)
        _check_action(self.action)

    def __call__(self, history: Sequence[Snapshot]) -> Verdict | None:
        if not history or history[-1].consecutive_skipped < self.limit:
            return None
        last = history[-1]
        return Verdict(
            "consecutive_skips", self.action, last.step,
            f"The last {last.consecutive_skipped} optimizer steps were all skipped because the gradients "
            f"held Inf or NaN (loss scale now {last.scale:g}). A few skipped steps at the start are "
            "expected while the scale settles; this many in a row means the model produces Inf/NaN "
            "whatever the scale: check the learning rate, the input data and any layer computed in "
            f"float16 (softmax, normalisation, loss). {_BF16_HINT}",
        )


@dataclasses.dataclass(frozen=True)
class SkipRate:
    """Fires when more than ``max_rate`` of the last ``window`` steps were skipped.

    Args:
        max_rate: the tolerated fraction of skipped steps, in (0, 1]. A healthy dynamic scale
            skips about one step per ``growth_interval`` (0.05% with the default 2000).
        window: how many recent steps the rate is measured over (at log-interval resolution).
        warmup_steps: steps at the start that are not judged, since the first skips while the
            scale settles from a high initial value are expected.
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    max_rate: float = 0.05
    window: int = 1000
    warmup_steps: int = 100
    action: str = "warn"

    def __post_init__(self) -> None:
        if isinstance(self.max_rate, bool) or not isinstance(self.max_rate, (int, float)) \
                or not 0.0 < self.max_rate <= 1.0:
            raise ValueError(f"max_rate must be a number in (0, 1], got {self.max_rate!r}")
        _check_positive_int("window", self.window)
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        _check_action(self.action)

    def __call__(self, history: Sequence[Snapshot]) -> Verdict | None:
        if not history:
            return None
        last = history[-1]
        steps = skipped = 0
        for snap in reversed(history):
            start = snap.step - snap.interval_steps
            if start < self.warmup_steps or steps >= self.window:
                break
            steps += snap.interval_steps
            skipped += snap.skipped_in_interval
        if steps < self.window:
            return None
        rate = skipped / steps
        if rate <= self.max_rate:
            return None
        return Verdict(
            "skip_rate", self.action, last.step,
            f"{rate:.1%} of the last {steps} optimizer steps were skipped for Inf/NaN gradients "
            f"(tolerated: {self.max_rate:.1%}; loss scale now {last.scale:g}). A healthy dynamic scale "
            "skips about one step per growth interval. So many skips mean the gradients overflow "
            "at almost any scale, and the model trains on only part of its steps. " + _BF16_HINT,
        )


@dataclasses.dataclass(frozen=True)
class StuckAtMinScale:
    """Fires when the scale has stayed at the policy's ``min_scale`` for ``limit`` steps or more.

    Args:
        limit: steps at the minimum that count as a problem.
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    limit: int = 1000
    action: str = "warn"

    def __post_init__(self) -> None:
        _check_positive_int("limit", self.limit)
        _check_action(self.action)

    def __call__(self, history: Sequence[Snapshot]) -> Verdict | None:
        if not history or history[-1].steps_at_min_scale < self.limit:
            return None
        last = history[-1]
        return Verdict(
            "stuck_at_min_scale", self.action, last.step,
            f"The loss scale has been at its minimum ({last.scale:g}) for {last.steps_at_min_scale} "
            "steps: the gradients overflow float16 even with almost no scaling, and small gradients "
            "are underflowing to zero meanwhile. Look for a layer whose activations exceed 65504 in "
            "float16, or lower min_scale only if you know the gradients are tiny. " + _BF16_HINT,
        )


def default_rules(action: str = "warn") -> tuple[Rule, ...]:
    """The three rules with their default thresholds, all with ``action``."""
    _check_action(action)
    return (ConsecutiveSkips(action=action), SkipRate(action=action), StuckAtMinScale(action=action))


def evaluate(rules: Iterable[Rule], history: Sequence[Snapshot]) -> list[Verdict]:
    """Every verdict the rules give on ``history`` (oldest snapshot first)."""
    return [v for v in (rule(history) for rule in rules) if v is not None]


HealthSpec = None | bool | str | Rule | Iterable[Rule]


class HealthMonitor:
    """Keeps the recent snapshots, runs the rules, and reports each problem once.

    A rule that keeps firing on consecutive reads is reported once; it is reported again
    only after it has cleared. ``"raise"`` raises at once; ``"stop"`` is returned to the
    integration (which stops its trainer) and also warned.

    Args:
        rules: the rules to apply.
        max_history: snapshots kept (the skip-rate window is measured inside them).

    Example:
        >>> monitor = HealthMonitor.from_spec("warn")
        >>> [type(r).__name__ for r in monitor.rules]
        ['ConsecutiveSkips', 'SkipRate', 'StuckAtMinScale']
    """

    def __init__(self, rules: Iterable[Rule], max_history: int = 10_000) -> None:
        self.rules = tuple(rules)
        for rule in self.rules:
            if not callable(rule) or getattr(rule, "action", None) not in ACTIONS:
                raise ValueError(
                    f"health rules must be callables with an action in {list(ACTIONS)}, got {rule!r}"
                )
        self.history: deque[Snapshot] = deque(maxlen=max_history)
        self._active: set[str] = set()
        self.verdicts: list[Verdict] = []

    @classmethod
    def from_spec(cls, spec: HealthSpec) -> HealthMonitor | None:
        """Build a monitor from what a user passes as ``health=``.

        ``None``/``False``: no monitoring. ``True``/``"warn"``/``"raise"``/``"stop"``: the
        default rules with that action. A rule or an iterable of rules: those rules.
        """
        if spec is None or spec is False:
            return None
        if spec is True:
            return cls(default_rules("warn"))
        if isinstance(spec, str):
            if spec not in ACTIONS:
                raise ValueError(
                    f"health must be None, a bool, one of {list(ACTIONS)}, or health rules; got {spec!r}"
                )
            return cls(default_rules(spec))
        if callable(spec):
            return cls([spec])
        try:
            return cls(list(spec))
        except TypeError:
            raise ValueError(
                f"health must be None, a bool, one of {list(ACTIONS)}, or health rules; got {spec!r}"
            ) from None

    def observe(self, snapshot: Snapshot) -> list[Verdict]:
        """Add a snapshot, return the new verdicts (each firing rule once)."""
        if self.history and snapshot.step < self.history[-1].step:
            self.history.clear()
            self._active.clear()
        self.history.append(snapshot)
        found = evaluate(self.rules, self.history)
        firing = {v.rule for v in found}
        new = [v for v in found if v.rule not in self._active]
        self._active = firing
        self.verdicts.extend(new)
        return new

    def apply(self, verdicts: Iterable[Verdict], stop: Callable[[], None] | None = None) -> bool:
        """Act on verdicts: warn, raise :class:`LossScaleHealthError`, or call ``stop``.

        Returns True when a verdict asked to stop training.
        """
        stopped = False
        verdicts = list(verdicts)
        raising = [v for v in verdicts if v.action == "raise"]
        for verdict in verdicts:
            if verdict.action == "raise":
                continue
            prefix = "stopping training: " if verdict.action == "stop" else ""
            warnings.warn(f"[lossscale-callbacks] {prefix}{verdict.message}", LossScaleHealthWarning,
                          stacklevel=3)
            if verdict.action == "stop":
                stopped = True
                if stop is not None:
                    stop()
        if raising:
            # the other verdicts of this read were warned above, so none is lost
            raise LossScaleHealthError("\n\n".join(v.message for v in raising))
        return stopped
