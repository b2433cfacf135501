"""The opt-in loss-spike rule: skip an update whose loss (or gradient norm) is far above its window.

As OLMo-core's ``SkipStepOptimizer`` (6σ over 128 steps): a step is skipped when its loss is more than
``sigma`` standard deviations above the mean of the last ``window`` **applied** steps' losses, judged once
``warmup`` applied steps are in the window. With ``grad_norm=True`` the gradient norm is judged the same
way, in a window of its own, and either spike skips the step. Differences from OLMo-core: only a value
*above* the window is a spike (a sudden drop in the loss is not a reason to skip), the warm-up is its
own setting (OLMo-core judges from ``max(20, window // 2)`` values), and a skipped step's values stay
out of the windows (each step's values enter only when it was applied), so one spike cannot widen the
window that judges the next.

The decision is made on the device, each step, with no host read (see
:mod:`lossscale_callbacks.torch._spike`); a spike skip is its own cause (``"spike"``) in the step
outcomes, and is not an overflow: the loss scale treats the step as a clean one, ``skipped_steps`` and
the health rules' skip rate count only non-finite steps (see :mod:`lossscale_callbacks.skips._outcomes`).

:func:`spike_decisions` is the rule on the host, in NumPy: the reference the device implementation is
tested against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lossscale_callbacks._validation import check_bool, check_int, check_number


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    """Skip a step whose loss is more than ``sigma`` standard deviations above its running window.

    Args:
        sigma: how many standard deviations above the window's mean count as a spike (> 0; OLMo-core's 6).
        window: how many recent applied steps the mean and deviation are taken over (>= 2).
        warmup: applied steps in the window before the rule judges at all (2 <= warmup <= window).
        grad_norm: also judge the gradient norm (computed from the step's gradients: a few more ops).

    Raises:
        ValueError: an argument out of range, naming it.

    Example:
        >>> SpikeRule()
        SpikeRule(sigma=6.0, window=128, warmup=20, grad_norm=False)
        >>> spike_decisions([1.0, 1.1, 0.9, 1.0, 1.05, 10.0, 1.0], SpikeRule(window=8, warmup=4))
        [False, False, False, False, False, True, False]
    """

    sigma: float = 6.0
    window: int = 128
    warmup: int = 20
    grad_norm: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", float(check_number("sigma", self.sigma, 0.0, math.inf,
                                                             low_open=True, high_open=True)))
        check_int("window", self.window, 2)
        check_int("warmup", self.warmup, 2, self.window)
        check_bool("grad_norm", self.grad_norm)

    def to_config(self) -> dict[str, Any]:
        """The rule as a plain dict (a pickle, a checkpoint, the dashboards' config)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Any) -> SpikeRule:
        """The rule from :meth:`to_config`.

        Raises:
            ValueError: not a dict of the rule's fields, naming the problem.
        """
        if not isinstance(config, dict) or set(config) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("a spike rule's config is a dict of sigma, window, warmup, grad_norm; got "
                             f"{config!r}")
        return cls(**config)


def check_spike(name: str, value: Any) -> SpikeRule | None:
    """``value`` as a rule: ``None``/``False`` (off), ``True`` (the defaults) or a :class:`SpikeRule`.

    Raises:
        ValueError: anything else, naming ``name``.
    """
    if value is None or value is False:
        return None
    if value is True:
        return SpikeRule()
    if isinstance(value, SpikeRule):
        return value
    raise ValueError(f"{name} must be None, True or a SpikeRule, got {value!r}")


def spike_decisions(values: Sequence[float] | Sequence[Sequence[float]], rule: SpikeRule,
                    skipped: Sequence[bool] | None = None) -> list[bool]:
    """The rule over a run, on the host: for each step, whether the rule skips it.

    Args:
        values: each step's loss, or each step's ``(loss, grad_norm)`` with ``rule.grad_norm``.
        rule: the rule.
        skipped: steps skipped for another reason (a non-finite gradient): they are judged, but their
            values stay out of the windows like a spike's.

    Returns:
        One bool per step.
    """
    rows = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    window: list[np.ndarray] = []
    out = []
    for i, x in enumerate(rows):
        spike = False
        if len(window) >= rule.warmup:
            past = np.stack(window)
            mean, std = past.mean(axis=0), past.std(axis=0, ddof=1)
            spike = bool(np.any(x - mean > rule.sigma * std))
        out.append(spike)
        if not spike and not (skipped is not None and skipped[i]):
            window = [*window, x][-rule.window:]
    return out


__all__ = ["SpikeRule", "check_spike", "spike_decisions"]
