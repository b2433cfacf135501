"""lossscale-callbacks: one dynamic loss-scaling core for Keras and PyTorch Lightning.

The core (this package) never imports a framework. Framework callbacks live in
``lossscale_callbacks.keras``, ``lossscale_callbacks.torch`` and ``lossscale_callbacks.lightning``; sinks in
``lossscale_callbacks.tensorboard`` and ``lossscale_callbacks.wandb``; the Tensor Core checker in
``lossscale_callbacks.alignment``. Each package exports what users type; what a user needs to write a
sink, a health rule, a run reader or an integration is in :mod:`lossscale_callbacks.extend`, the test
oracles a backend proves itself with in :mod:`lossscale_callbacks.testing`. Every other module is private,
the families of them in rooms that export nothing (``report``, ``forensics``, ``loop``, ``ledger``).

Example:
    >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
    >>> policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=2000)
    >>> state = next_state(policy, initial_state(policy), finite=False)
    >>> float(state.scale), int(state.skipped_steps)
    (16384.0, 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lossscale_callbacks._extras import lazy_attributes

if TYPE_CHECKING:  # what the names below are, for type checkers and editors; at run time they load lazily
    from lossscale_callbacks._health import LossScaleHealthError, LossScaleHealthWarning
    from lossscale_callbacks._metrics import METRIC_NAMES
    from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy
    from lossscale_callbacks._sinks import InMemorySink, Sink
    from lossscale_callbacks._state import LossScaleState
    from lossscale_callbacks._update import initial_state, next_state
    from lossscale_callbacks._version import __version__
    from lossscale_callbacks.ledger._skip import skip_samples
    from lossscale_callbacks.loop._logging_loop import LoggingLoop
    from lossscale_callbacks.skips._spike import SpikeRule

__all__ = [
    "METRIC_NAMES",
    "DynamicPolicy",
    "FixedPolicy",
    "InMemorySink",
    "LoggingLoop",
    "LossScaleHealthError",
    "LossScaleHealthWarning",
    "LossScaleState",
    "Sink",
    "SpikeRule",
    "__version__",
    "initial_state",
    "next_state",
    "skip_samples",
]


# The face's names are imported from their modules the first time one is used (PEP 562), so ``import
# lossscale_callbacks`` alone loads nothing behind the face, and a tool that needs one corner of the
# library (``lossscale-callbacks report``) loads only that corner.
__getattr__ = lazy_attributes(__name__, {
    "METRIC_NAMES": "lossscale_callbacks._metrics",
    "DynamicPolicy": "lossscale_callbacks._policy",
    "FixedPolicy": "lossscale_callbacks._policy",
    "InMemorySink": "lossscale_callbacks._sinks",
    "LoggingLoop": "lossscale_callbacks.loop._logging_loop",
    "LossScaleHealthError": "lossscale_callbacks._health",
    "LossScaleHealthWarning": "lossscale_callbacks._health",
    "LossScaleState": "lossscale_callbacks._state",
    "Sink": "lossscale_callbacks._sinks",
    "SpikeRule": "lossscale_callbacks.skips._spike",
    "__version__": "lossscale_callbacks._version",
    "initial_state": "lossscale_callbacks._update",
    "next_state": "lossscale_callbacks._update",
    "skip_samples": "lossscale_callbacks.ledger._skip",
})


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
