"""The extension points: what a user needs to write a sink, a health rule, a run reader or an integration.

Every other module of the library is private (a leading underscore) and may change without notice;
these names, with the package faces, are the whole promise.

* **A sink**: a class with ``write(step, metrics)``, ``write_text(tag, markdown)``, ``flush()`` and
  ``close()`` (:class:`lossscale_callbacks.Sink`), handed to ``LoggingLoop(sinks=[...])``; or, with one
  :func:`register_sink` entry, opened by name by the loop and every integration (``sinks={name: value}``).
* **A health rule**: a callable with an ``action`` (:class:`Rule`) that takes the recent
  :class:`Snapshot` s and returns a :class:`Verdict` or ``None``; the built-in rules and
  :func:`default_rules` are here to combine with it, passed as ``health=[...]``.
* **A run reader**: a :data:`Reader` (a path in, :data:`Series` out, :class:`RunReadError` when the
  path is not its format) in the ``lossscale_callbacks.readers`` entry-point group.
* **An integration**: its framework's :class:`Ops` for the update rule, the :data:`Policy` it is
  given (:func:`policy_from_config` for a saved one), and :func:`require` for its outside package
  (a :class:`MissingExtraError` naming the pip extra); its monitor hands a ``LoggingLoop`` the step.

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

__all__ = [
    "ConsecutiveSkips",
    "MissingExtraError",
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
    "StuckAtMinScale",
    "Verdict",
    "default_rules",
    "policy_from_config",
    "register_sink",
    "require",
]
