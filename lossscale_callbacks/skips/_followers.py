"""Flagged where not held: did an LR scheduler, an EMA or a trainer's step counter advance on skipped steps?

What follows the optimizer should advance only on applied steps. Where the integration holds it (see
``lossscale_callbacks.torch``'s ``hold``), it does; where it does not (a scheduler the user steps by
hand in a loop of their own, an EMA nobody told us about, a trainer's step counter, which counts attempted
steps by design), this check says so, once per follower, with the count and the fix.

It runs at the log interval only, on host numbers the integration read there: each follower's own step
count (:class:`FollowerCount`) and the applied steps so far. A follower's count and the applied steps
are compared from the first read that saw it: when the follower advanced more than the optimizer applied
updates since then, and steps were skipped since then, it advanced on (that many of) the skipped steps.
A follower that steps less often (an epoch scheduler) is never flagged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

from lossscale_callbacks._health import ACTIONS, split_rules
from lossscale_callbacks._validation import check_choice

SCHEDULER, EMA, TRAINER_STEP = "scheduler", "ema", "trainer_step"
KINDS = (SCHEDULER, EMA, TRAINER_STEP)
RULE = "not_held"  # the verdicts' rule name

FIXES = {
    SCHEDULER: "hold it with scaler.hold(scheduler) (LossScaler's; LossScalePlugin, "
               "LossScaleTrainerCallback and install_loss_scaler hold the schedulers they see by default)",
    EMA: "hold it with scaler.hold(ema, optimizer=optimizer)",
    TRAINER_STEP: "it counts attempted optimizer steps, skipped ones included, by design: the applied "
                  "updates are loss_scale/applied_steps; to train a number of updates, raise max_steps "
                  "by the skipped count",
}
_WHAT = {SCHEDULER: "the learning-rate scheduler", EMA: "the EMA", TRAINER_STEP: "the trainer's step counter"}
_MAX_STEPS_NAMED = 5


@dataclasses.dataclass(frozen=True)
class NotHeld:
    """The rule that an LR scheduler, an EMA or a trainer's step counter advanced only on applied steps.

    The logging loop judges it at each read from the counts the integration carries with the state (see
    :class:`FollowerCheck`), not from the snapshots (calling it on them finds nothing). ``health=True``
    or an action (``"warn"``, ``"raise"``, ``"stop"``) brings it with ``action="warn"`` whatever the
    action: a schedule that ran ahead of the updates is worth a word, not a stopped run; put it in a list
    of rules to choose its action, leave it out of one to turn it off.

    Args:
        action: ``"warn"``, ``"raise"`` or ``"stop"``.

    Example:
        >>> split_not_held("raise")  # the default rules raise; this one warns
        ('raise', NotHeld(action='warn'))
    """

    action: str = "warn"

    def __post_init__(self) -> None:
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return ("what follows the optimizer (LR schedulers, EMAs, a trainer's step counter) advanced only on "
                "applied steps")

    def __call__(self, history: Sequence[Any]) -> None:
        return None  # judged on the followers' counts by the loop, not on the snapshots


def split_not_held(spec: Any) -> tuple[Any, NotHeld | None]:
    """``health=`` without the :class:`NotHeld` rule, and the rule it asks for: ``True`` or an action brings
    ``NotHeld()``; a list brings the one in it (taken out); ``None``/``False``/a single rule none."""
    spec, rules = split_rules(spec, NotHeld, lambda action: (NotHeld(),))  # named, never raised on
    return spec, (rules[-1] if rules else None)


class FollowerCount(NamedTuple):
    """One follower's own step count at a read.

    Attributes:
        name: what the words call it (``"LambdaLR"``, ``"AveragedModel"``, ``"Trainer.global_step"``).
        kind: ``"scheduler"``, ``"ema"`` or ``"trainer_step"``.
        count: its count of steps, from any origin (only differences are compared).
        held: whether the integration holds it (a held one that advanced anyway is flagged too).
        key: what identifies it across reads (default: ``name``).
        base: ``(count, applied, skipped)`` (its count, the applied and the skipped steps) when the
            integration first saw it (before the first read, usually at the start of training), if it
            knows; else the first read is its starting point.
    """

    name: str
    kind: str
    count: int
    held: bool = False
    key: Hashable = None
    base: tuple[int, int, int] | None = None

    @property
    def ident(self) -> Hashable:
        return self.name if self.key is None else self.key


class FollowerCheck:
    """Compares each follower's count with the applied steps, read after read; one finding per follower.

    Example:
        >>> check = FollowerCheck()
        >>> check.observe(0, 0, [], [FollowerCount("LambdaLR", "scheduler", 0)]) is None
        True
        >>> words = check.observe(100, 97, [3, 17, 42], [FollowerCount("LambdaLR", "scheduler", 100)])
        >>> print(words)  # doctest: +ELLIPSIS
        The learning-rate scheduler LambdaLR advanced on 3 skipped optimizer steps (steps 3, 17, 42): ...
        >>> check.observe(200, 197, [], [FollowerCount("LambdaLR", "scheduler", 200)]) is None  # named once
        True
    """

    def __init__(self) -> None:
        self._base: dict[Hashable, tuple[int, int, int]] = {}  # key -> (count, applied, skipped steps seen)
        self._named: set[Hashable] = set()
        self._skipped: list[int] = []  # listed skipped steps, oldest first (the first few are named)
        self._skips = 0  # skipped steps seen so far (also those not listed)

    def observe(self, steps: int, applied: int, skipped_steps: Sequence[int],
                followers: Iterable[FollowerCount]) -> str | None:
        """One read: ``steps`` attempted and ``applied`` so far, the skipped steps listed since the last
        read, and each follower's count. Returns the words naming the followers that advanced on skipped
        steps for the first time (``None``: none)."""
        self._skipped.extend(s for s in skipped_steps if len(self._skipped) < 64)
        self._skips = steps - applied
        found = []
        for follower in followers:
            key = follower.ident
            if key not in self._base:
                if follower.base is None:
                    self._base[key] = (follower.count, applied, self._skips)
                    continue
                self._base[key] = follower.base
            if key in self._named:
                continue
            count0, applied0, skips0 = self._base[key]
            excess = (follower.count - count0) - (applied - applied0)
            skips = self._skips - skips0
            if excess > 0 and skips > 0:
                self._named.add(key)
                found.append(self._sentence(follower, min(excess, skips), skips0))
        return " ".join(found) if found else None

    def _sentence(self, follower: FollowerCount, count: int, skips_before: int) -> str:
        listed = self._skipped[skips_before:skips_before + _MAX_STEPS_NAMED] if skips_before < len(
            self._skipped) else []
        where = ""
        if listed:
            more = ", ..." if count > len(listed) else ""
            # The first step listed is where it went wrong: "(step 3)", "(steps 3, 17, ...)".
            label = "step" if len(listed) == 1 and not more else "steps"
            where = f" ({label} {', '.join(map(str, listed))}{more})"
        held = " although it is held" if follower.held else ""
        what = _WHAT.get(follower.kind, "a follower")
        noun = "step" if count == 1 else "steps"
        return (f"{what[0].upper()}{what[1:]} {follower.name} advanced on {count} skipped optimizer {noun}"
                f"{where}{held}: it is {count} {noun} ahead of the updates applied. Fix: "
                f"{FIXES.get(follower.kind, 'hold it')}.")

    def restart(self) -> None:
        """A new segment (the counts went back): every follower is compared afresh from the next read."""
        self._base.clear()
        self._skipped.clear()


__all__ = ["EMA", "FIXES", "KINDS", "RULE", "SCHEDULER", "TRAINER_STEP", "FollowerCheck", "FollowerCount",
           "NotHeld", "split_not_held"]
