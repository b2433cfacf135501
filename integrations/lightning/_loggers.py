"""Lightning loggers as core sinks, so the logging loop writes to all of them like to any sink.

* ``TensorBoardLogger``: metrics through ``log_metrics`` (float32 ``simple_value``, which
  TensorBoard's default loader reads), reports with ``add_text``, and the "Loss scale" Custom
  Scalars section once (``add_custom_scalars``), from the same chart list as
  :class:`~lossscale_callbacks.tensorboard.TensorBoardSink`.
* ``WandbLogger``: a :class:`~lossscale_callbacks.wandb.WandbSink` on the logger's run, so a
  Lightning run gets what a ``WandbSink`` run gets: the ``loss_scale/step`` axis, the run
  summary, reports as ``wandb.Table``, the policy in the run config and health alerts.
* Any other logger (``CSVLogger``, MLflow, ...): ``log_metrics``, with the trainer's ``epoch``
  as Lightning adds it to its own rows (a ``CSVLogger`` row of ours had an empty ``epoch``); no
  text channel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lossscale_callbacks import Sink
from lossscale_callbacks.integration import DASHBOARD_CHARTS, DASHBOARD_SECTION


def _is(obj: Any, class_name: str) -> bool:
    return any(k.__name__ == class_name for k in type(obj).__mro__)


class LoggerSink:
    """Writes metrics with ``logger.log_metrics`` and text where the logger has a text channel."""

    def __init__(self, logger: Any, epoch: Callable[[], int] | None = None) -> None:
        self.logger = logger
        self.step = 0
        self._layout_written = False
        self._epoch = epoch

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.step = int(step)
        if not self._layout_written:
            self._layout_written = True
            self._write_layout()
        row = dict(metrics)
        if self._epoch is not None:
            row.setdefault("epoch", self._epoch())
        self.logger.log_metrics(row, step=int(step))

    def _write_layout(self) -> None:
        experiment = getattr(self.logger, "experiment", None)
        tensorboard = _is(self.logger, "TensorBoardLogger")
        if tensorboard and callable(getattr(experiment, "add_custom_scalars", None)):
            experiment.add_custom_scalars({DASHBOARD_SECTION: {
                title: ["Multiline", [f"^{tag}$"]] for title, tag in DASHBOARD_CHARTS}})

    def write_text(self, tag: str, markdown: str) -> None:
        # TensorBoardLogger and any logger whose experiment is a SummaryWriter-like object.
        experiment = getattr(self.logger, "experiment", None)
        if callable(getattr(experiment, "add_text", None)):
            experiment.add_text(tag, markdown, global_step=self.step)

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        # SummaryWriter.add_histogram_raw (torch's and tensorboardX's); other loggers have no histograms.
        experiment = getattr(self.logger, "experiment", None)
        add = getattr(experiment, "add_histogram_raw", None)
        if not callable(add) or not any(counts):
            return
        nonzero = [i for i, c in enumerate(counts) if c]
        lo, hi = nonzero[0], nonzero[-1] + 1
        values = [(edges[i] + edges[i + 1]) / 2 for i in range(lo, hi)]
        total = sum(counts[lo:hi])
        pairs = list(zip(values, counts[lo:hi], strict=True))
        add(tag, min=edges[lo], max=edges[hi], num=total, sum=sum(v * c for v, c in pairs),
            sum_squares=sum(v * v * c for v, c in pairs), bucket_limits=list(edges[lo + 1:hi + 1]),
            bucket_counts=list(counts[lo:hi]), global_step=int(step))

    def flush(self) -> None:
        self.logger.save()

    def close(self) -> None:
        """Lightning finalizes its loggers itself."""


def logger_sink(logger: Any, epoch: Callable[[], int] | None = None) -> Sink:
    """The sink for one Lightning logger (see the module docstring); ``epoch`` gives the trainer's
    current epoch, written into the rows of loggers other than TensorBoard's and W&B's."""
    if _is(logger, "WandbLogger"):
        from lossscale_callbacks.wandb import WandbSink

        return WandbSink(run=logger.experiment)
    tabular = not _is(logger, "TensorBoardLogger")  # TensorBoard draws epoch from Lightning's own rows
    return LoggerSink(logger, epoch if tabular else None)
