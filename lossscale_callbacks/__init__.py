"""lossscale-callbacks: one dynamic loss-scaling core for Keras and PyTorch Lightning.

The core (this package) never imports a framework. Framework callbacks live in
``lossscale_callbacks.keras``, ``lossscale_callbacks.torch`` and ``lossscale_callbacks.lightning``; sinks in
``lossscale_callbacks.tensorboard`` and ``lossscale_callbacks.wandb``; the Tensor Core checker in
``lossscale_callbacks.alignment``. Each package exports what users type; everything else is imported
from the module that defines it (``lossscale_callbacks.health.HealthMonitor``,
``lossscale_callbacks.metrics.MetricsTracker``, ``lossscale_callbacks.policy.policy_from_config``...).

Example:
    >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
    >>> policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=2000)
    >>> state = next_state(policy, initial_state(policy), finite=False)
    >>> float(state.scale), int(state.skipped_steps)
    (16384.0, 1)
"""

from lossscale_callbacks._version import __version__
from lossscale_callbacks.health import LossScaleHealthError, LossScaleHealthWarning
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.metrics import METRIC_NAMES
from lossscale_callbacks.policy import DynamicPolicy, FixedPolicy
from lossscale_callbacks.sinks import InMemorySink, Sink
from lossscale_callbacks.state import LossScaleState
from lossscale_callbacks.update import initial_state, next_state

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
    "__version__",
    "initial_state",
    "next_state",
]
