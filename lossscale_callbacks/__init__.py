"""lossscale-callbacks: one dynamic loss-scaling core for Keras and PyTorch Lightning.

The core (this package) never imports a framework. Framework callbacks live in
``lossscale_callbacks.keras``, ``lossscale_callbacks.torch`` and ``lossscale_callbacks.lightning``; sinks in
``lossscale_callbacks.tensorboard`` and ``lossscale_callbacks.wandb``.

Example:
    >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
    >>> policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=2000)
    >>> state = next_state(policy, initial_state(policy), finite=False)
    >>> float(state.scale), int(state.skipped_steps)
    (16384.0, 1)
"""

from lossscale_callbacks._version import __version__
from lossscale_callbacks.health import (
    ConsecutiveSkips,
    HealthMonitor,
    LossScaleHealthError,
    LossScaleHealthWarning,
    ScaleOnlyDecreases,
    SkipRate,
    StuckAtMinScale,
    Verdict,
    default_rules,
)
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.metrics import METRIC_NAMES, MetricsTracker, Snapshot
from lossscale_callbacks.ops import NUMPY_OPS, NumpyOps, Ops
from lossscale_callbacks.policy import DynamicPolicy, FixedPolicy, Policy, policy_from_config
from lossscale_callbacks.sinks import GuardedSink, InMemorySink, Sink, SinkGroup
from lossscale_callbacks.state import LossScaleState
from lossscale_callbacks.summary import summarize
from lossscale_callbacks.update import initial_state, next_state

__all__ = [
    "METRIC_NAMES",
    "NUMPY_OPS",
    "ConsecutiveSkips",
    "DynamicPolicy",
    "FixedPolicy",
    "GuardedSink",
    "HealthMonitor",
    "InMemorySink",
    "LoggingLoop",
    "LossScaleHealthError",
    "LossScaleHealthWarning",
    "LossScaleState",
    "MetricsTracker",
    "NumpyOps",
    "Ops",
    "Policy",
    "ScaleOnlyDecreases",
    "Sink",
    "SinkGroup",
    "SkipRate",
    "Snapshot",
    "StuckAtMinScale",
    "Verdict",
    "__version__",
    "default_rules",
    "initial_state",
    "next_state",
    "policy_from_config",
    "summarize",
]
