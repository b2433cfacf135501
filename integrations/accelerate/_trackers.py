"""The trackers of an ``Accelerator`` as one sink: everything goes through ``accelerator.log``.

``accelerator.log(values, step=...)`` hands the values to every tracker the program started with
``Accelerator(log_with=...)`` and ``init_trackers`` (TensorBoard, W&B, MLflow, Comet, Aim,
ClearML, DVCLive, ...), on the main process only. Its documented value types are numbers and
strings, so the metrics go as numbers and the reports (the policy, the overflow forensics, the
end-of-run summary) as markdown strings, which the TensorBoard tracker writes to its Text tab and
the others log as text or skip with their own warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TrackerSink"]


class TrackerSink:
    """Writes metrics and reports with ``accelerator.log`` (all its trackers, main process only).

    The step given to ``accelerator.log`` is the step the logging loop writes at: the optimizer
    steps attempted, or the ``log_step`` handed to the monitor (use the step your own
    ``accelerator.log`` calls use: W&B drops rows whose step goes backwards). Reports go at the
    step of the last metrics. The trackers are Accelerate's to close
    (``accelerator.end_training()``).

    Args:
        accelerator: the ``accelerate.Accelerator`` whose trackers receive the values.

    Example:
        >>> class Recording:  # stands in for an Accelerator
        ...     def log(self, values, step=None):
        ...         print(step, values)
        >>> sink = TrackerSink(Recording())
        >>> sink.write(10, {"loss_scale/scale": 1024.0})
        10 {'loss_scale/scale': 1024.0}
        >>> sink.write_text("loss_scale/summary", "all fine")
        10 {'loss_scale/summary': 'all fine'}
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._step = 0

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._step = int(step)
        self.accelerator.log(dict(metrics), step=self._step)

    def write_text(self, tag: str, markdown: str) -> None:
        self.accelerator.log({tag: markdown}, step=self._step)

    def flush(self) -> None:
        """Accelerate's trackers write (or hand off) each ``log`` call themselves."""

    def close(self) -> None:
        """Accelerate closes its trackers in ``accelerator.end_training()``."""
