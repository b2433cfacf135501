"""Health rules: plain-words verdicts on a run's loss scale, evaluated at the log interval.

Each rule is a pure function of the history of :class:`~lossscale_callbacks.extend.Snapshot` s
(oldest first) that returns a :class:`Verdict` or ``None``. Rules never look at the device:
they see only what the integration already read at its log interval.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from lossscale_callbacks._metrics import Snapshot
from lossscale_callbacks._validation import INT64_MAX, check_choice, check_int, check_number

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
        check_int("limit", self.limit, 1, INT64_MAX)
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return f"no run of {self.limit} skipped steps in a row"

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

    def final(self, history: Sequence[Snapshot]) -> Verdict | None:
        """A finished run shorter than ``limit`` whose every step (two or more) was skipped: it applied
        no update at all, which no threshold needs to judge."""
        if not history:
            return None
        first, last = history[0], history[-1]
        steps = last.step - (first.step - first.interval_steps)
        if not 2 <= steps <= last.consecutive_skipped < self.limit:
            return None
        return Verdict(
            "every_step_skipped", self.action, last.step,
            f"Every one of the {steps} optimizer steps of this run was skipped because the gradients held "
            f"Inf or NaN (loss scale now {last.scale:g}): no update was applied. Check the learning rate, "
            f"the input data and any layer computed in float16 (softmax, normalisation, loss). {_BF16_HINT}",
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
        check_number("max_rate", self.max_rate, 0.0, 1.0, low_open=True)
        check_int("window", self.window, 1, INT64_MAX)
        check_int("warmup_steps", self.warmup_steps, 0, INT64_MAX)
        check_choice("action", self.action, ACTIONS)

    # Fewer steps after the warm-up than this, and the run's rate says too little to judge.
    min_final_steps: int = dataclasses.field(default=100, repr=False)

    # The window of the last call, carried to the next: the rules run once per snapshot, in order, so
    # the window moves by one snapshot a call. Walking it back each time cost window/interval snapshots
    # per call (a report replaying a million one-step log points walked a billion).
    _last: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)

    def _measured(self, history: Sequence[Snapshot], window: int) -> tuple[int, int]:
        """(steps, skipped) over the most recent whole intervals after the warm-up, up to ``window`` steps:
        the shortest run of the latest snapshots that reaches ``window`` steps (or all after the warm-up).
        """
        if not history:
            return 0, 0
        last = self._last
        newest = history[-1]
        if last and last[0] is history and last[1] is newest:
            return last[3], last[4]
        if last and last[0] is history and len(history) >= 2 and history[-2] is last[1]:
            _, _, kept, steps, skipped = last  # one new snapshot: slide the window
            if newest.step - newest.interval_steps < self.warmup_steps:
                kept.clear()
                steps = skipped = 0
            else:
                kept.append(newest)
                steps, skipped = steps + newest.interval_steps, skipped + newest.skipped_in_interval
                while kept and (steps - kept[0].interval_steps >= window or len(kept) > len(history)):
                    dropped = kept.popleft()
                    steps, skipped = steps - dropped.interval_steps, skipped - dropped.skipped_in_interval
        else:
            kept, steps, skipped = self._walk(history, window)
        self._last[:] = [history, newest, kept, steps, skipped]
        return steps, skipped

    def _walk(self, history: Sequence[Snapshot], window: int) -> tuple[deque[Snapshot], int, int]:
        """The window found from scratch, walking back from the newest snapshot."""
        kept: deque[Snapshot] = deque()
        steps = skipped = 0
        for snap in reversed(history):
            start = snap.step - snap.interval_steps
            if start < self.warmup_steps or steps >= window:
                break
            kept.appendleft(snap)
            steps += snap.interval_steps
            skipped += snap.skipped_in_interval
        return kept, steps, skipped

    def _verdict(self, history: Sequence[Snapshot], steps: int, skipped: int) -> Verdict | None:
        rate = skipped / steps
        if rate <= self.max_rate:
            return None
        last = history[-1]
        return Verdict(
            "skip_rate", self.action, last.step,
            f"{rate:.2%} of the last {steps} optimizer steps were skipped for Inf/NaN gradients "
            f"(tolerated: {self.max_rate:.1%}; loss scale now {last.scale:g}). A healthy dynamic scale "
            "skips about one step per growth interval. So many skips mean the gradients overflow "
            "at almost any scale, and the model trains on only part of its steps. " + _BF16_HINT,
        )

    def describe(self) -> str:
        return (f"at most {self.max_rate:.1%} of the steps after the {self.warmup_steps}-step warm-up "
                f"skipped (over any {self.window} steps)")

    def __call__(self, history: Sequence[Snapshot]) -> Verdict | None:
        if not history:
            return None
        steps, skipped = self._measured(history, self.window)
        if steps < self.window:
            return None
        return self._verdict(history, steps, skipped)

    def final(self, history: Sequence[Snapshot]) -> Verdict | None:
        """The verdict on a whole run shorter than the window: its rate after the warm-up.

        ``None`` when that rate is tolerated, or when fewer than 100 steps follow the warm-up (see
        :meth:`not_judged`).
        """
        if not history:
            return None
        steps, skipped = self._measured(history, self.window)
        if steps >= self.window or steps < self.min_final_steps:
            return None
        return self._verdict(history, steps, skipped)

    def not_judged(self, history: Sequence[Snapshot]) -> str | None:
        """Why this rule could not judge the run, in plain words; ``None`` when it could."""
        steps, skipped = self._measured(history, self.window) if history else (0, 0)
        if steps >= self.min_final_steps:
            return None
        total = history[-1].step if history else 0
        if not skipped:  # nothing skipped after the warm-up: the gap alone, in a few words
            return f"the skip rate ({steps} logged steps after the warm-up, {self.min_final_steps} needed)"
        overall = history[-1].skipped_steps / total if total else 0.0
        return (f"the skip rate could not be judged: only {steps} steps came after the "
                f"{self.warmup_steps}-step warm-up (at least {self.min_final_steps} are needed); "
                f"overall {overall:.2%} of {total} steps were skipped")


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
        check_int("limit", self.limit, 1, INT64_MAX)
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return f"never {self.limit} steps at the minimum scale"

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


@dataclasses.dataclass(frozen=True)
class ScaleOnlyDecreases:
    """Fires when the scale backed off ``min_backoffs`` times or more over a run and never grew.

    A run that starts at a high scale backs off a few times while it settles, and cannot grow
    before ``growth_interval`` clean steps have passed; so the run as a whole is judged (at its
    end, :meth:`final`) once it is ``min_steps`` long, and during training only once it is
    ``during_steps`` long without a single growth.

    Args:
        min_backoffs: backoffs (seen at log-interval resolution) without any growth that count as
            a problem.
        min_steps: length of a finished run before it is judged (the integrations use twice the
            policy's ``growth_interval``).
        during_steps: length without growth after which a running job is flagged (the
            integrations use ten growth intervals).
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    min_backoffs: int = 3
    min_steps: int = 4000
    during_steps: int = 20000
    action: str = "warn"

    def __post_init__(self) -> None:
        check_int("min_backoffs", self.min_backoffs, 1, INT64_MAX)
        check_int("min_steps", self.min_steps, 1, INT64_MAX)
        check_int("during_steps", self.during_steps, 1, INT64_MAX)
        check_choice("action", self.action, ACTIONS)

    # The last look at a history, carried forward when the history only gained its newest snapshot
    # (and, when full, lost its oldest): a scale that never grows again (held at max_scale) would
    # otherwise cost a scan of the whole history at every read, quadratic over a replayed run.
    # Not part of the rule: the verdicts are those of a full scan (tests compare them).
    _memo: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)

    def _backoffs_since_growth(self, history: Sequence[Snapshot]) -> int | None:
        """Backoffs after the history's last growth, or None when the history holds a growth."""
        memo = self._memo
        if memo and memo[0] == id(history) and len(history) >= 2:
            _, first, second, last, grew_from, backoffs = memo
            if history[-1] is last and history[0] is first:
                return None if grew_from is not None else backoffs
            if history[-2] is last and (history[0] is first or history[0] is second):
                if history[0] is not first:  # the oldest snapshot left a full history
                    if grew_from is first:
                        grew_from = None
                    elif grew_from is None and second.step > first.step and second.scale < first.scale:
                        backoffs -= 1
                newest = history[-1]
                if newest.step > last.step and newest.scale > last.scale:
                    grew_from, backoffs = last, 0
                elif newest.step > last.step and newest.scale < last.scale:
                    backoffs += 1
                memo[1:] = [history[0], history[1], newest, grew_from, backoffs]
                return None if grew_from is not None else backoffs
        grew_from, backoffs = _last_growth(history)
        memo[:] = [id(history), history[0], history[1] if len(history) > 1 else None, history[-1], grew_from,
                   backoffs]
        return None if grew_from is not None else backoffs

    def _judge(self, history: Sequence[Snapshot], min_steps: int) -> Verdict | None:
        if not history or history[-1].step < min_steps:
            return None
        backoffs = self._backoffs_since_growth(history)
        if backoffs is None or backoffs < self.min_backoffs:
            return None
        last = history[-1]
        return Verdict(
            "scale_only_decreases", self.action, last.step,
            f"In {last.step} optimizer steps the loss scale only ever went down ({backoffs} backoffs seen, "
            f"now {last.scale:g}) and never grew back: the gradients overflow again before growth_interval "
            "clean steps pass. Expect skipped steps to continue; check the learning rate and the layers "
            "computed in float16, or lower the initial scale. " + _BF16_HINT,
        )

    def describe(self) -> str:
        return "the scale grew again after backing off"

    def __call__(self, history: Sequence[Snapshot]) -> Verdict | None:
        return self._judge(history, self.during_steps)

    def final(self, history: Sequence[Snapshot]) -> Verdict | None:
        """The verdict on a finished run at least ``min_steps`` long."""
        return self._judge(history, self.min_steps)

    def not_judged(self, history: Sequence[Snapshot]) -> str | None:
        steps = history[-1].step if history else 0
        if steps >= self.min_steps:
            return None
        return (f"whether the scale recovers could not be judged before {self.min_steps} steps "
                f"(the run has {steps})")


def _last_growth(history: Sequence[Snapshot]) -> tuple[Snapshot | None, int]:
    """The snapshot the history's last growth started from (None if it never grew), and the backoffs
    after that growth. Newest first: a healthy run's last growth is found within a few snapshots."""
    backoffs = 0
    later = None
    for snap in reversed(history):
        if later is not None and later.step > snap.step:
            if later.scale > snap.scale:
                return snap, backoffs
            backoffs += later.scale < snap.scale
        later = snap
    return None, backoffs


def default_rules(action: str = "warn", growth_interval: int | None = None,
                  dynamic: bool = True) -> tuple[Rule, ...]:
    """The default rules with their default thresholds, all with ``action``.

    ``growth_interval`` (the policy's) lets :class:`ScaleOnlyDecreases` judge after two growth
    intervals; without it, after its default 4000 steps. ``dynamic=False`` (a fixed scale, which
    never grows nor shrinks) leaves that rule out.
    """
    check_choice("action", action, ACTIONS)
    if not dynamic:
        return (ConsecutiveSkips(action=action), SkipRate(action=action), StuckAtMinScale(action=action))
    decreasing = (ScaleOnlyDecreases(action=action) if growth_interval is None
                  else ScaleOnlyDecreases(min_steps=2 * int(growth_interval),
                                          during_steps=10 * int(growth_interval), action=action))
    return (ConsecutiveSkips(action=action), SkipRate(action=action), StuckAtMinScale(action=action),
            decreasing)


def assess(rules: Iterable[Rule], history: Sequence[Snapshot], verdicts: Sequence[Verdict]) -> str:
    """One honest paragraph on a run's health from its rules, snapshots and verdicts.

    Example:
        >>> from lossscale_callbacks._metrics import MetricsTracker
        >>> snap = MetricsTracker(1.0).observe({"steps": 300, "skipped_steps": 15, "scale": 1024.0,
        ...                                      "growth_counter": 0, "hysteresis_left": 1})
        >>> print(assess(default_rules(), [snap], []))  # doctest: +NORMALIZE_WHITESPACE
        Health: no problem found, but not everything could be judged: the skip rate (0 logged steps
        after the warm-up, 100 needed); whether the scale recovers could not be judged before 4000
        steps (the run has 300).
    """
    rules = list(rules)
    if verdicts:
        lines = [f"Health: {len(verdicts)} problem(s) found."]
        lines += [f"  - [{v.rule} at step {v.step}] {v.message}" for v in verdicts]
        return "\n".join(lines)
    gaps = [gap for gap in (getattr(r, "not_judged", lambda h: None)(history) for r in rules) if gap]
    if gaps:
        return "Health: no problem found, but not everything could be judged: " + "; ".join(gaps) + "."
    if not history:
        return "Health: nothing was logged, so nothing could be judged."
    checked = [r.describe() if callable(getattr(r, "describe", None)) else type(r).__name__ for r in rules]
    return f"Health: OK ({'; '.join(checked)})." if checked else "Health: no rule was applied."


def evaluate(rules: Iterable[Rule], history: Sequence[Snapshot]) -> list[Verdict]:
    """Every verdict the rules give on ``history`` (oldest snapshot first)."""
    found = []  # a plain loop: a report replays a million snapshots through here
    for rule in rules:
        verdict = rule(history)
        if verdict is not None:
            found.append(verdict)
    return found


HealthSpec = None | bool | str | Rule | Iterable[Rule]


def split_rules(spec: Any, kinds: type | tuple[type, ...],
                defaults: Callable[[str], tuple[Any, ...]]) -> tuple[Any, tuple[Any, ...] | None]:
    """``health=`` split in two: what is left for the loss-scale rules, and the rules of ``kinds`` that a
    room of the logging loop judges by itself (the ranks' agreement, the followers, the fp8 scales).

    ``True`` or an action brings ``defaults(action)``; a rule of ``kinds`` brings itself (leaving no
    loss-scale rule); a list brings the rules of ``kinds`` in it (taken out of the list); another single
    rule brings none (``()``); ``None``/``False``, and anything that is not a list, ``None``.

    Example:
        >>> rates = lambda action: (SkipRate(action=action),)
        >>> rest, mine = split_rules([ConsecutiveSkips(), SkipRate()], SkipRate, rates)
        >>> [type(r).__name__ for r in rest], [type(r).__name__ for r in mine]
        (['ConsecutiveSkips'], ['SkipRate'])
        >>> split_rules("raise", SkipRate, rates)[1][0].action
        'raise'
    """
    if spec is None or spec is False:
        return spec, None
    if spec is True or isinstance(spec, str):
        action = "warn" if spec is True else spec
        return spec, defaults(action) if action in ACTIONS else None
    if isinstance(spec, kinds):
        return [], (spec,)
    if callable(spec):
        return spec, ()
    try:
        rules = list(spec)
    except TypeError:
        return spec, None
    return [r for r in rules if not isinstance(r, kinds)], tuple(r for r in rules if isinstance(r, kinds))


class HealthMonitor:
    """Keeps the recent snapshots, runs the rules, and reports each problem once.

    A rule that keeps firing on consecutive reads is reported once; it is reported again
    only after it has cleared. ``"raise"`` raises at once; ``"stop"`` is returned to the
    integration (which stops its trainer) and also warned.

    Args:
        rules: the rules to apply.
        max_history: snapshots kept (the skip-rate window is measured inside them), an integer >= 1.

    Example:
        >>> monitor = HealthMonitor.from_spec("warn")
        >>> [type(r).__name__ for r in monitor.rules]
        ['ConsecutiveSkips', 'SkipRate', 'StuckAtMinScale', 'ScaleOnlyDecreases']
    """

    def __init__(self, rules: Iterable[Rule], max_history: int = 10_000) -> None:
        self.rules = self._checked(rules)
        check_int("max_history", max_history, 1, 2**31 - 1)
        self.history: deque[Snapshot] = deque(maxlen=max_history)
        self._active: set[str] = set()
        self.verdicts: list[Verdict] = []
        self._since = 0  # the verdicts of the current segment start here (see restart)

    @staticmethod
    def _checked(rules: Iterable[Rule]) -> tuple[Rule, ...]:
        rules = tuple(rules)
        for rule in rules:
            if not callable(rule) or getattr(rule, "action", None) not in ACTIONS:
                raise ValueError(
                    f"health rules must be callables with an action in {list(ACTIONS)}, got {rule!r}"
                )
        return rules

    def replace_rules(self, rules: Iterable[Rule]) -> None:
        """Judge with ``rules`` from now on (the policy changed); the snapshots and verdicts so far stay."""
        self.rules = self._checked(rules)

    @classmethod
    def from_spec(cls, spec: HealthSpec, growth_interval: int | None = None,
                  dynamic: bool = True) -> HealthMonitor | None:
        """Build a monitor from what a user passes as ``health=``.

        ``None``/``False``: no monitoring. ``True``/``"warn"``/``"raise"``/``"stop"``: the
        default rules with that action (``growth_interval`` and ``dynamic``: the policy's, see
        :func:`default_rules`). A rule or an iterable of rules: those rules.
        """
        if spec is None or spec is False:
            return None
        if spec is True:
            return cls(default_rules("warn", growth_interval, dynamic))
        if isinstance(spec, str):
            if spec not in ACTIONS:
                raise ValueError(
                    f"health must be None, a bool, one of {list(ACTIONS)}, or health rules; got {spec!r}"
                )
            return cls(default_rules(spec, growth_interval, dynamic))
        if callable(spec):
            return cls([spec])
        try:
            return cls(list(spec))
        except TypeError:
            raise ValueError(
                f"health must be None, a bool, one of {list(ACTIONS)}, or health rules; got {spec!r}"
            ) from None

    def restart(self) -> None:
        """Judge from scratch from the next snapshot on (a new segment of the run: its steps went back).

        The problems found so far stay in :attr:`verdicts`; a rule that fires again in the new
        segment is reported again.
        """
        self.history.clear()
        self._active.clear()
        self._since = len(self.verdicts)

    def observe(self, snapshot: Snapshot) -> list[Verdict]:
        """Add a snapshot, return the new verdicts (each firing rule once).

        Raises:
            ValueError: ``snapshot`` is not a :class:`~lossscale_callbacks.extend.Snapshot`.
        """
        if not isinstance(snapshot, Snapshot):
            raise ValueError(f"snapshot must be a lossscale_callbacks._metrics.Snapshot, got "
                             f"{type(snapshot).__name__}")
        history = self.history
        if history and snapshot.step < history[-1].step:
            self.restart()
        history.append(snapshot)
        found = evaluate(self.rules, history)
        if not found:
            if self._active:
                self._active = set()
            return found
        firing = {v.rule for v in found}
        new = [v for v in found if v.rule not in self._active]
        self._active = firing
        self.verdicts.extend(new)
        return new

    def final(self) -> list[Verdict]:
        """Verdicts that only a finished run allows (a short run's overall skip rate), each rule once
        per segment."""
        found = []
        for rule in self.rules:
            judge = getattr(rule, "final", None)
            if judge is None or not self.history:
                continue
            verdict = judge(self.history)
            if verdict is not None and verdict.rule not in {v.rule for v in self.verdicts[self._since:]}:
                found.append(verdict)
        self.verdicts.extend(found)
        return found

    def assessment(self) -> str:
        """The health verdict in plain words: the problems found, and what could not be judged.

        Never claims a property that no rule could check: on a run too short for a rule, it says
        so (with the overall numbers) instead of calling the run healthy on that count.
        """
        return assess(self.rules, list(self.history), self.verdicts)

    def apply(self, verdicts: Iterable[Verdict], stop: Callable[[], None] | None = None,
              warn: bool = True) -> bool:
        """Act on verdicts: warn, raise :class:`LossScaleHealthError`, or call ``stop``.

        ``warn=False`` (on ranks other than 0) acts without printing the warnings. Returns True
        when a verdict asked to stop training.
        """
        stopped = False
        verdicts = list(verdicts)
        raising = [v for v in verdicts if v.action == "raise"]
        for verdict in verdicts:
            if verdict.action == "raise":
                continue
            prefix = "stopping training: " if verdict.action == "stop" else ""
            if warn:
                # Imported here: only a run that warns needs it (``report`` judges and never warns).
                from lossscale_callbacks._stacklevel import user_stacklevel

                warnings.warn(f"[lossscale-callbacks] {prefix}{verdict.message}", LossScaleHealthWarning,
                              stacklevel=user_stacklevel())
            if verdict.action == "stop":
                stopped = True
                if stop is not None:
                    stop()
        if raising:
            # the other verdicts of this read were warned above, so none is lost
            raise LossScaleHealthError("\n\n".join(v.message for v in raising))
        return stopped
