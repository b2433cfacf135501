"""Lightning loggers as core sinks, so one guarded ``SinkGroup`` writes to all of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _is(obj: Any, class_name: str) -> bool:
    return any(k.__name__ == class_name for k in type(obj).__mro__)


class LoggerSink:
    """Writes metrics with ``logger.log_metrics`` and text where the logger has a text channel.

    Text goes to TensorBoard with ``SummaryWriter.add_text`` (shown under the Text tab) and to W&B
    into the run summary (shown on the run's overview page); other loggers have no text channel
    and skip it.
    """

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.step = 0

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.step = int(step)
        self.logger.log_metrics(dict(metrics), step=int(step))

    def write_text(self, tag: str, markdown: str) -> None:
        if _is(self.logger, "WandbLogger"):
            self.logger.experiment.summary[tag] = markdown
            return
        # TensorBoardLogger and any logger whose experiment is a SummaryWriter-like object.
        experiment = getattr(self.logger, "experiment", None)
        if callable(getattr(experiment, "add_text", None)):
            experiment.add_text(tag, markdown, global_step=self.step)

    def flush(self) -> None:
        self.logger.save()

    def close(self) -> None:
        """Lightning finalizes its loggers itself."""
