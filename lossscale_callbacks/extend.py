"""The extension points: what a user needs to write a sink, a health rule, a run reader or an integration.

Every other module of the library is private (a leading underscore) and may change without notice;
these names, with the package faces, are the whole promise.

* **A sink**: a class with ``write(step, metrics)``, ``write_text(tag, markdown)``, ``flush()`` and
  ``close()`` (:class:`lossscale_callbacks.Sink`), handed to ``LoggingLoop(sinks=[...])``; or, with one
  :func:`register_sink` entry, opened by name by the loop and every integration (``sinks={name: value}``).
* **A health rule**: a callable with an ``action`` (:class:`Rule`) that takes the recent
  :class:`Snapshot` s and returns a :class:`Verdict` or ``None``; the built-in rules and
  :func:`default_rules` are here to combine with it, passed as ``health=[...]`` (and :class:`NotHeld`,
  the rule that what follows the optimizer advanced only on applied steps).
* **A consumer of skipped steps** (a ledger of bad steps, a dashboard of its own): the
  :class:`IntervalOutcomes` a read carries (``LossScaler.read_outcomes()``, or the ``outcomes`` of a
  state ``ScalerReader.read`` returns): each :class:`StepOutcome` that was not an ordinary applied step.
* **A run reader**: a :data:`Reader` (a path in, :data:`Series` out, :class:`RunReadError` when the
  path is not its format) in the ``lossscale_callbacks.readers`` entry-point group.
* **An integration**: its framework's :class:`Ops` for the update rule, the :data:`Policy` it is
  given (:func:`policy_from_config` for a saved one), and :func:`require` for its outside package
  (a :class:`MissingExtraError` naming the pip extra); its monitor hands a ``LoggingLoop`` the step.
  The rest of what an integration may use from the core is the contract,
  :mod:`lossscale_callbacks.integration`.

Example:
    >>> from lossscale_callbacks import LoggingLoop
    >>> from lossscale_callbacks.extend import Snapshot, Verdict
    >>> class NeverGrows:
    ...     action = "warn"
    ...     def __call__(self, history: list[Snapshot]) -> Verdict | None:
    ...         return None
    >>> LoggingLoop(log_every=10, health=[NeverGrows()], echo=None).log_every
    10
"""

from typing import TYPE_CHECKING

from lossscale_callbacks._extras import lazy_attributes

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported on first use
    from lossscale_callbacks._extras import MissingExtraError, require
    from lossscale_callbacks._health import (
        ConsecutiveSkips,
        Rule,
        ScaleOnlyDecreases,
        SkipRate,
        StuckAtMinScale,
        Verdict,
        default_rules,
    )
    from lossscale_callbacks._metrics import Snapshot
    from lossscale_callbacks._ops import Ops
    from lossscale_callbacks._policy import Policy, policy_from_config
    from lossscale_callbacks._sinks import register_sink
    from lossscale_callbacks.loop._rank_agreement import RanksDisagree
    from lossscale_callbacks.report._run_readers import Reader, RunReadError, Series
    from lossscale_callbacks.skips._followers import NotHeld
    from lossscale_callbacks.skips._outcomes import IntervalOutcomes, StepOutcome

__all__ = [
    "ConsecutiveSkips",
    "IntervalOutcomes",
    "MissingExtraError",
    "NotHeld",
    "Ops",
    "Policy",
    "RanksDisagree",
    "Reader",
    "Rule",
    "RunReadError",
    "ScaleOnlyDecreases",
    "Series",
    "SkipRate",
    "Snapshot",
    "StepOutcome",
    "StuckAtMinScale",
    "Verdict",
    "default_rules",
    "policy_from_config",
    "register_sink",
    "require",
]

# Each name is imported from its module when first used: a sink or a reader that needs one of them loads
# only that corner of the core.
__getattr__ = lazy_attributes(__name__, {
    "ConsecutiveSkips": "lossscale_callbacks._health",
    "IntervalOutcomes": "lossscale_callbacks.skips._outcomes",
    "MissingExtraError": "lossscale_callbacks._extras",
    "NotHeld": "lossscale_callbacks.skips._followers",
    "Ops": "lossscale_callbacks._ops",
    "Policy": "lossscale_callbacks._policy",
    "RanksDisagree": "lossscale_callbacks.loop._rank_agreement",
    "Reader": "lossscale_callbacks.report._run_readers",
    "Rule": "lossscale_callbacks._health",
    "RunReadError": "lossscale_callbacks.report._run_readers",
    "ScaleOnlyDecreases": "lossscale_callbacks._health",
    "Series": "lossscale_callbacks.report._run_readers",
    "SkipRate": "lossscale_callbacks._health",
    "Snapshot": "lossscale_callbacks._metrics",
    "StepOutcome": "lossscale_callbacks.skips._outcomes",
    "StuckAtMinScale": "lossscale_callbacks._health",
    "Verdict": "lossscale_callbacks._health",
    "default_rules": "lossscale_callbacks._health",
    "policy_from_config": "lossscale_callbacks._policy",
    "register_sink": "lossscale_callbacks._sinks",
    "require": "lossscale_callbacks._extras",
})


def __dir__() -> list[str]:
    """The extension points only: the modules behind them stay out of ``dir()``."""
    return list(__all__)
