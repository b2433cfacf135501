"""The fp8 scales of a run in the logging loop: each read's metrics, its rebuilt steps, its findings.

An fp8 monitor (``lossscale_callbacks.keras.Fp8ScaleCallback``, ``lossscale_callbacks.torch.Fp8ScaleMonitor``)
hands the loop an :class:`~lossscale_callbacks.fp8._reads.Fp8Read` at each interval (``observe(state,
fp8=read)``; ``state`` is ``None`` in a run without loss scaling). :class:`Fp8Scales` turns it into the
``fp8/<layer>/<role>/...`` metrics of the read's step (joined to the loss scale's, when there is one), the
per-step amax and scale of delayed scaling at their own steps, the fp8 rules' verdicts (joined to the run's
health verdicts, warned, raised or stopped on like them, the findings as ``fp8/findings`` text) and the
ranks' agreement on the scales that must agree (``fp8/ranks_disagree``); and says the run's scales in the
summary: a sentence after the loss scale's, or the whole summary of a run that only casts to fp8.

Example:
    >>> from lossscale_callbacks._sinks import SinkGroup
    >>> from lossscale_callbacks.fp8._reads import Fp8Read, TensorRead
    >>> from lossscale_callbacks.fp8._rules import default_fp8_rules
    >>> scales = Fp8Scales(default_fp8_rules(), None)
    >>> zero = TensorRead("fc", "weight", "e4m3", "dynamic", amax=0.0, scale=4.48e14)
    >>> [v.rule for v in scales.judge(Fp8Read(10, (zero,)), SinkGroup(), None)]
    ['fp8_zero_amax']
"""

from __future__ import annotations

from typing import Any

from lossscale_callbacks._health import Verdict
from lossscale_callbacks._sinks import SinkGroup
from lossscale_callbacks.fp8._reads import FINDINGS_TAG, RANKS_DISAGREE, RANKS_TAG, Fp8Read
from lossscale_callbacks.fp8._rules import Fp8Health, fp8_findings_markdown
from lossscale_callbacks.loop._rank_agreement import RankAgreement, RanksDisagree

__all__ = ["Fp8Scales"]


class Fp8Scales:
    """One run's fp8 reads (see the module).

    Args:
        rules: the fp8 rules (``None``: health off, nothing judged).
        ranks_rule: the loop's rank-agreement rule (``None``: the ranks' scales are compared, not judged).
    """

    def __init__(self, rules: Any, ranks_rule: RanksDisagree | None) -> None:
        self.health = Fp8Health(rules if rules is not None else ())
        self.judging = rules is not None
        self.ranks = RankAgreement(ranks_rule, metric=RANKS_DISAGREE, tag=RANKS_TAG, what="fp8 scales")
        self.reads = 0

    def write(self, read: Fp8Read, at: int, out: SinkGroup) -> dict[str, float | int]:
        """The rebuilt steps of delayed scaling written to ``out`` at their steps (those before ``at``,
        the read's sink step); returns the read's own metrics, for the write at ``at``."""
        offset = at - read.step
        for step, row in sorted(read.step_metrics().items()):
            out.write(step + offset, row)
        return read.metrics()

    def judge(self, read: Fp8Read, out: SinkGroup, health: Any) -> list[Verdict]:
        """The read's new findings (each (rule, tensor) once per stretch), the findings' text to ``out``,
        the ranks compared; the verdicts join ``health``'s (the run's monitor) to be acted on."""
        self.reads += 1
        verdicts = self.health.observe(read) if self.judging else []
        if verdicts:
            out.write_text(FINDINGS_TAG, fp8_findings_markdown(verdicts))
            if health is not None:
                health.verdicts.extend(verdicts)
        return [*verdicts, *self.ranks.judge(read.ranks, read.step, out, health)]

    def sentence(self) -> str:
        """The run's fp8 scales after the loss scale's summary ("" when none was read)."""
        return " " + self.health.summary() + self.ranks.sentence() if self.reads else ""

    def summary(self, note: str = "") -> str:
        """The whole summary of a run without loss scaling."""
        text = self.health.summary() + self.ranks.sentence()
        if self.judging:
            text += "\n" + self.health.assessment()
        return text + ("\n" + note if note else "")
