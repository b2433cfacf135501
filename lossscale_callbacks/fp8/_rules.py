"""The health rules of fp8 scales and their words: saturation, a zero amax or a non-finite scale, a coarse
scale after an outlier, a stale history after a checkpoint load.

Each rule looks at one :class:`~lossscale_callbacks.fp8._reads.Fp8Read` and returns a
:class:`~lossscale_callbacks._health.Verdict` per tensor it finds wrong (the verdict's ``rule`` is the
rule's name; the tensor is named in the words). :class:`Fp8Health` keeps the reads, reports each
(rule, tensor) once per stretch of reads it holds on, and says in plain words what the run's scales did.
Ranks whose scales differ are judged by the loop's rank check (``RanksDisagree``), not here. The same rules
run in the training process and in ``report`` (on reads rebuilt from the logged series).

Example:
    >>> from lossscale_callbacks.fp8._reads import Fp8Read, TensorRead
    >>> weight = TensorRead("fc", "weight", "e4m3", "dynamic", amax=0.0, scale=4.48e14)
    >>> [v.rule for v in Fp8ZeroAmax()(Fp8Read(40, (weight,)))]
    ['fp8_zero_amax']
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from lossscale_callbacks._health import ACTIONS, Verdict, split_rules
from lossscale_callbacks._validation import check_choice, check_number
from lossscale_callbacks.fp8._formats import fp8_format
from lossscale_callbacks.fp8._reads import Fp8Read, TensorRead, merged_tensors

__all__ = ["Fp8CoarseScale", "Fp8Health", "Fp8Saturation", "Fp8StaleHistory", "Fp8ZeroAmax",
           "default_fp8_rules", "split_fp8_health"]

_HISTORY_ARGS = ("`amax_history_length` of Keras' `QuantizedFloat8DTypePolicy`, `amax_history_len` of "
                 "TransformerEngine's `DelayedScaling`")


def _times(x: float) -> str:
    return f"{x:.3g}×"


def _share(x: float) -> str:
    """A share as a percentage with two significant digits (0.049%, 4.9%, 46%)."""
    return f"{100 * x:.2g}%"


@dataclasses.dataclass(frozen=True)
class Fp8Saturation:
    """Fires when a tensor's cast clipped more than ``max_share`` of the values it counted, or (steps not
    counted) when a step's amax went beyond its scale's range by ``min_overshoot`` times or more.

    Args:
        max_share: the tolerated share of saturated values, in [0, 1). The default (0.1%) lets pass the
            few values a delayed scale clips while its history fills, at the first steps.
        min_overshoot: how far beyond the range an uncounted step must go to count as saturated.
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    max_share: float = 1e-3
    min_overshoot: float = 2.0
    action: str = "warn"
    name = "fp8_saturation"

    def __post_init__(self) -> None:
        check_number("max_share", self.max_share, 0.0, 1.0, high_open=True)
        check_number("min_overshoot", self.min_overshoot, 1.0)
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return f"no fp8 cast clipped more than {_share(self.max_share)} of its values"

    def _fires(self, t: TensorRead) -> bool:
        if t.saturated_share is not None and t.saturated_share > self.max_share:
            return True
        return (t.saturated_share is None and t.saturated_steps > 0 and t.max_overshoot is not None
                and t.max_overshoot >= self.min_overshoot)

    def judge(self, read: Fp8Read) -> list[tuple[TensorRead, Verdict]]:
        """The tensors this rule finds wrong in ``read``, each with its verdict."""
        return [(t, Verdict(self.name, self.action, read.step, saturation_words(t, read.step)))
                for t in read.tensors if self._fires(t)]

    def __call__(self, read: Fp8Read) -> list[Verdict]:
        return [v for _, v in self.judge(read)]


def saturation_words(t: TensorRead, step: int) -> str:
    fmt = fp8_format(t.format)
    at = t.first_saturated_step if t.first_saturated_step is not None else step
    when = (f"at step {at}" if t.saturated_steps <= 1
            else f"in {t.saturated_steps} steps of the interval, first at step {at}")
    if t.saturated is not None and t.saturated_share is not None and t.saturated:
        values = "1 value" if t.saturated == 1 else f"{t.saturated} values"
        what = (f"{values} ({_share(t.saturated_share)} of those counted) were clipped to "
                f"±{fmt.max:g} ({fmt.name})")
    else:
        what = (f"its values went up to {_times(t.max_overshoot or 1.0)} beyond what the scale could hold "
                f"and were clipped to ±{fmt.max:g} ({fmt.name}); those steps were not counted, so how many "
                "is unknown")
    why = ("Delayed scaling makes a step's scale from the amaxes of earlier steps, so a sudden jump clips "
           "until the scale catches up; if it recurs, find what made the jump or keep this layer out of fp8."
           if t.scaling == "delayed" else
           "Dynamic scaling takes the scale from the tensor itself, so nothing should clip: the scale in use "
           "is not the tensor's own (an amax reduced over the wrong ranks, or a scale rounded or set from "
           "outside).")
    return f"{t.name} saturated {when}: {what}. {why}"


@dataclasses.dataclass(frozen=True)
class Fp8ZeroAmax:
    """Fires when a tensor's amax is zero (every value zero: its scale means nothing) or its amax or scale
    is not finite.

    Args:
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    action: str = "warn"
    name = "fp8_zero_amax"

    def __post_init__(self) -> None:
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return "every fp8 tensor had a non-zero amax and a finite scale"

    def __call__(self, read: Fp8Read) -> list[Verdict]:
        return [v for _, v in self.judge(read)]

    def judge(self, read: Fp8Read) -> list[tuple[TensorRead, Verdict]]:
        """The tensors this rule finds wrong in ``read``, each with its verdict."""
        found = []
        for t in read.tensors:
            amax, scale = t.amax, t.scale
            if amax is not None and amax == 0:
                words = (f"{t.name} had an amax of 0 at step {read.step}: every value "
                         "is zero, so its scale means nothing (torchao divides by 1e-12, a scale of "
                         f"{(scale or 0):.3g}; delayed scaling keeps the previous one) and the layer "
                         "passes nothing on through it. A zeroed or pruned weight, a weight that was never "
                         "loaded, or an input cut off upstream.")
            elif not all(v is None or math.isfinite(v) for v in (amax, scale)):
                words = (f"{t.name} has a non-finite amax or scale at step {read.step} "
                         f"(amax {amax}, scale {scale}): its casts now give NaN or zero. An Inf or NaN "
                         "reached the amax (look at the layer feeding it), or a zero amax reached a scale "
                         "computation without a floor.")
            else:
                continue
            found.append((t, Verdict(self.name, self.action, read.step, words)))
        return found


@dataclasses.dataclass(frozen=True)
class Fp8CoarseScale:
    """Fires when a delayed scale is ``min_ratio`` times coarser than the values it casts because one
    outlier dominates the amax history; says how long it lasts.

    Args:
        min_ratio: how many times coarser (the amax the scale was made from over the step's own).
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    min_ratio: float = 8.0
    action: str = "warn"
    name = "fp8_coarse_scale"

    def __post_init__(self) -> None:
        check_number("min_ratio", self.min_ratio, 1.0, low_open=True)
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return f"no delayed scale stayed {_times(self.min_ratio)} too coarse after an outlier"

    def __call__(self, read: Fp8Read) -> list[Verdict]:
        return [v for _, v in self.judge(read)]

    def judge(self, read: Fp8Read) -> list[tuple[TensorRead, Verdict]]:
        """The tensors this rule finds wrong in ``read``, each with its verdict."""
        found = []
        for t in read.tensors:
            if (t.scaling != "delayed" or t.history_ratio is None or t.history_ratio < self.min_ratio
                    or t.outlier_step is None):
                continue
            found.append((t, Verdict(self.name, self.action, read.step, coarse_words(t, read.step))))
        return found


def coarse_words(t: TensorRead, step: int) -> str:
    length = f"{t.history_length}-step" if t.history_length else "amax"
    until = t.coarse_until
    left = f", {until - step} more steps" if until is not None and until > step else ""
    lost = math.log2(t.history_ratio) if t.history_ratio else 0.0
    underflow = (f"; {_share(t.underflow_share)} of the counted values became subnormal or zero"
                 if t.underflow_share else "")
    return (f"{t.name} casts with a scale {_times(t.history_ratio or 1.0)} coarser than "
            f"its values need: one amax at step {t.outlier_step} dominates its {length} history, so the "
            f"ordinary values lose about {lost:.1f} binades of range at the bottom{underflow}. It lasts "
            f"until step {until}{left}. A shorter history adapts within its length ({_HISTORY_ARGS}: "
            f"16 to 128), or look at what fed `{t.layer}`'s {t.role.replace('_', ' ')} at step "
            f"{t.outlier_step}.")


@dataclasses.dataclass(frozen=True)
class Fp8StaleHistory:
    """Fires at the first read after an amax history was replaced (a checkpoint load) when the loaded
    history's largest amax is ``min_ratio`` times off the tensor's latest amax.

    Args:
        min_ratio: how far off (either way) counts as stale.
        action: ``"warn"``, ``"raise"`` or ``"stop"``.
    """

    min_ratio: float = 4.0
    action: str = "warn"
    name = "fp8_stale_history"

    def __post_init__(self) -> None:
        check_number("min_ratio", self.min_ratio, 1.0, low_open=True)
        check_choice("action", self.action, ACTIONS)

    def describe(self) -> str:
        return "no amax history loaded from a checkpoint was stale"

    def __call__(self, read: Fp8Read) -> list[Verdict]:
        return [v for _, v in self.judge(read)]

    def judge(self, read: Fp8Read) -> list[tuple[TensorRead, Verdict]]:
        """The tensors this rule finds wrong in ``read``, each with its verdict."""
        found = []
        for t in read.tensors:
            if t.stale_ratio is None or t.stale_ratio < self.min_ratio:
                continue
            after = f" after step {t.replaced_after}" if t.replaced_after is not None else ""
            if t.replaced_after is not None and read.step < t.replaced_after:
                after += f" (the step count went back to {read.step})"
            turn = f"up to {t.history_length} steps, " if t.history_length else ""
            found.append((t, Verdict(self.name, self.action, read.step, (
                f"{t.name} got an amax history{after} that is stale: a checkpoint was loaded, and its "
                f"largest amax is {_times(t.stale_ratio)} off the tensor's latest. The next scales are made "
                f"from it until it turns over ({turn}while that amax stays in it), so they clip or underflow "
                "the values: TransformerEngine PR #567 is this bug. Load the histories saved with the same "
                "weights, or reset them after loading into a run whose values moved."))))
        return found


def default_fp8_rules(action: str = "warn") -> tuple[object, ...]:
    """The fp8 rules with their default thresholds, all with ``action``."""
    check_choice("action", action, ACTIONS)
    return (Fp8Saturation(action=action), Fp8ZeroAmax(action=action), Fp8CoarseScale(action=action),
            Fp8StaleHistory(action=action))


FP8_RULE_TYPES = (Fp8Saturation, Fp8ZeroAmax, Fp8CoarseScale, Fp8StaleHistory)


def split_fp8_health(spec: Any) -> tuple[Any, tuple[object, ...] | None]:
    """``health=`` as the loss-scale rules see it, and the fp8 rules it asks for.

    ``True``/``"warn"``/``"raise"``/``"stop"`` bring the default fp8 rules with that action; a list of
    rules brings the fp8 rules in it (taken out of the list); ``None``/``False`` none.

    Example:
        >>> split_fp8_health("raise")[1][0].action
        'raise'
        >>> rest, fp8 = split_fp8_health([Fp8ZeroAmax()])
        >>> rest, [type(r).__name__ for r in fp8]
        ([], ['Fp8ZeroAmax'])
    """
    return split_rules(spec, FP8_RULE_TYPES, default_fp8_rules)


class Fp8Health:
    """The fp8 reads of a run, judged: each (rule, tensor) reported once per stretch of reads it fires in.

    Args:
        rules: the fp8 rules.
        max_reads: reads kept (the summary's numbers are the run's whole, kept as totals).
    """

    def __init__(self, rules: Iterable[object], max_reads: int = 1000) -> None:
        self.rules = tuple(rules)
        self.reads: deque[Fp8Read] = deque(maxlen=max_reads)
        self.verdicts: list[Verdict] = []
        self._active: set[tuple[str, str]] = set()  # (rule, layer/role) firing at the last read
        self.saturated: dict[str, int] = {}  # per tensor name, values clipped over the run
        self.saturated_steps: dict[str, int] = {}
        self.worst_underflow: tuple[str, float] | None = None
        self.reads_seen = 0

    def observe(self, read: Fp8Read) -> list[Verdict]:
        """Add a read; return the verdicts new in it."""
        self.reads.append(read)
        self.reads_seen += 1
        for t in read.tensors:
            if t.saturated:
                self.saturated[t.name] = self.saturated.get(t.name, 0) + int(t.saturated)
            if t.saturated_steps:
                self.saturated_steps[t.name] = self.saturated_steps.get(t.name, 0) + int(t.saturated_steps)
            worst = self.worst_underflow
            if t.underflow_share and (worst is None or t.underflow_share > worst[1]):
                self.worst_underflow = (t.name, float(t.underflow_share))
        firing: set[tuple[str, str]] = set()
        new = []
        for rule in self.rules:
            for tensor, verdict in rule.judge(read):  # type: ignore[attr-defined]
                key = (verdict.rule, f"{tensor.layer}/{tensor.role}")
                firing.add(key)
                if key not in self._active:
                    new.append(verdict)
        self._active = firing
        self.verdicts.extend(new)
        return new

    def assessment(self) -> str:
        """The fp8 rules' verdict on the run in plain words (the health section of an fp8-only run)."""
        if self.verdicts:
            lines = [f"Health: {len(self.verdicts)} problem(s) found."]
            lines += [f"  - [{v.rule} at step {v.step}] {v.message}" for v in self.verdicts]
            return "\n".join(lines)
        if not self.reads_seen:
            return "Health: nothing was read, so nothing could be judged."
        checked = "; ".join(rule.describe() for rule in self.rules)  # type: ignore[attr-defined]
        return f"Health: OK ({checked})." if checked else "Health: no rule was applied."

    def summary(self) -> str:
        """The run's fp8 scales in a few sentences."""
        tensors = merged_tensors(list(self.reads))
        if not tensors:
            return "FP8: no fp8 layer was read."
        layers = sorted({t.layer for t in tensors})
        kinds = sorted({t.scaling for t in tensors})
        text = (f"FP8: {len(tensors)} tensors of {len(layers)} layers watched ({' and '.join(kinds)} "
                f"scaling), read {self.reads_seen} time(s).")
        if self.saturated or self.saturated_steps:
            names = set(self.saturated) | set(self.saturated_steps)
            worst = max(names, key=lambda n: (self.saturated.get(n, 0), self.saturated_steps.get(n, 0)))
            total = sum(self.saturated.values())
            counted = f"{total} values clipped in the counted steps; " if total else ""
            text += (f" Saturation: {counted}{sum(self.saturated_steps.values())} step(s) went beyond a "
                     f"scale's range, most in {worst}.")
        else:
            text += " No cast saturated."
        if self.worst_underflow is not None:
            name, share = self.worst_underflow
            text += f" The largest underflow share was {_share(share)} ({name})."
        if self.verdicts:
            text += f" {len(self.verdicts)} fp8 finding(s), in the health section."
        return text


def fp8_findings_markdown(verdicts: Sequence[Verdict]) -> str:
    """The fp8 findings as a markdown list (the sinks' ``fp8/findings`` text)."""
    return "\n".join(f"- [{v.rule} at step {v.step}] {v.message}" for v in verdicts)
