"""Ray Train: our loss scaler inside ``TorchTrainer`` workers, its metrics through ``ray.train.report``.

``RayTrainReporter(scaler, log_every=...)`` in the training function of every worker; ``restore()``
before training (the scaler and its counts from ``ray.train.get_checkpoint()``), ``step()`` after
each optimizer step, ``report(metrics, checkpoint_dir=...)`` where you checkpoint, ``finish()`` at
the end. Ray's own ``RayTrainReportCallback`` for Lightning and for the Transformers Trainer carry
the metrics of :class:`~lossscale_callbacks.lightning.LossScaleMonitor` and
:class:`~lossscale_callbacks.transformers.LossScaleTrainerCallback` as they are. Needs
``pip install "lossscale-callbacks[ray]"``.

Example:
    >>> from lossscale_callbacks.ray import RayTrainReporter
    >>> RayTrainReporter.CHECKPOINT_FILE
    'lossscale_scaler.pt'
"""

from __future__ import annotations

from lossscale_callbacks.integration import require

require("ray.train", "ray", feature="lossscale_callbacks.ray")
require("torch", "ray", feature="lossscale_callbacks.ray")

from lossscale_callbacks.ray._reporter import RayTrainReporter  # noqa: E402

__all__ = ["RayTrainReporter"]


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
