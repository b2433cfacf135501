"""``RayTrainReporter``: the loss scale of a Ray Train worker, by ``ray.train.report``'s contract.

Ray Train keeps the metrics of the rank 0 worker and makes ``ray.train.report`` a barrier: every
worker must call it the same number of times, or the run hangs. The intervals here end at the same
calls on every worker (the step monitor's count, re-based on rank 0's at each read), so each worker
reports at the same steps even when one of them skipped a step the others took.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray.train
import torch

from lossscale_callbacks.integration import LoggingArgs, Snapshot, check_bool, logging_args
from lossscale_callbacks.torch.integration import ScalerStepMonitor

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["RayTrainReporter"]


class RayTrainReporter(ScalerStepMonitor):
    """Reads the worker's loss scaler at the log interval and reports it through ``ray.train.report``.

    Make one in the training function of every worker (after ``ray.train.torch.prepare_model``).
    Only the rank 0 worker writes ``tensorboard=``/``wandb=``/``sinks=`` and prints; the health
    rules run on every worker. Under Ray's process group every read also compares the workers'
    states (``loss_scale/ranks_disagree``). :attr:`metrics` holds the latest metrics.

    Args:
        scaler: the worker's ``LossScaler`` (or a ``GradScaler``/``ShardedGradScaler``).
        log_every: the interval of :class:`~lossscale_callbacks.LoggingLoop`, in optimizer steps (>= 1).
        report: ``True``: each read ends with ``ray.train.report(metrics)`` on every worker; ``False``:
            the metrics go out with your own :meth:`report` calls only.
        **logging: the shared logging arguments (``tensorboard=``, ``wandb=``, ``sinks=``,
            ``health=``, ``echo=``), handed to :class:`~lossscale_callbacks.LoggingLoop` as given (see
            its Args); the sinks are written and the summary printed on rank 0.

    Raises:
        ValueError: ``report`` is not a bool, or what the step monitor refuses.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**16))
        ...     reporter = RayTrainReporter(scaler, log_every=50, tensorboard=config["tb"])
        ...     reporter.restore()  # the scaler and its counts from ray.train.get_checkpoint()
        ...     for batch in batches:
        ...         ...  # forward in fp16 autocast, scaler.scale(loss).backward(), step, update
        ...         reporter.step()  # every 50 steps: ray.train.report(...) on every worker
        ...     reporter.finish()
    """

    CHECKPOINT_FILE = "lossscale_scaler.pt"
    _FIRST_STEP_NEEDS = "once the loss was scaled and backpropagated in this worker"

    def __init__(self, scaler: Any, *, log_every: int = 100, report: bool = True,
                 **logging: Unpack[LoggingArgs]) -> None:
        self._report = check_bool("report", report)
        rank = ray.train.get_context().get_world_rank()
        super().__init__(scaler, log_every=log_every, writer=rank == 0,
                         **logging_args(type(self).__name__, logging))
        self.metrics: dict[str, float | int] = {}

    def step(self) -> Snapshot | None:
        """Count one optimizer step; at the end of an interval read the scaler and (``report=True``)
        call ``ray.train.report`` with the metrics, on every worker alike.

        Raises:
            RuntimeError: the scaler has not scaled a loss yet.
        """
        snapshot = self._count_step()
        if snapshot is not None and self._report:
            ray.train.report(dict(self.metrics))
        return snapshot

    def _count_step(self, log_step: int | None = None) -> Snapshot | None:
        snapshot = super()._count_step(log_step)
        if snapshot is not None:
            self._keep(snapshot)
        return snapshot

    def _keep(self, snapshot: Snapshot) -> None:
        self.metrics = {**snapshot.metrics(), **self.loop.outcome_metrics(), **self.loop.rank_metrics()}

    def report(self, metrics: Mapping[str, Any] | None = None, checkpoint_dir: str | None = None) -> None:
        """``ray.train.report`` with your metrics and the loss scale's, and the scaler in the checkpoint.

        Call it on every worker alike (Ray's contract). A worker that passes ``checkpoint_dir`` (rank
        0, usually, with your model's files in it) adds :attr:`CHECKPOINT_FILE` there and reports
        the folder as the checkpoint; the others pass ``None``.

        Args:
            metrics: your metrics (yours win over ours on a shared name).
            checkpoint_dir: a folder holding this worker's checkpoint files, or ``None``.
        """
        merged = {**self.metrics, **dict(metrics or {})}
        checkpoint = None
        if checkpoint_dir is not None:
            torch.save(self.state_dict(), os.path.join(checkpoint_dir, self.CHECKPOINT_FILE))
            checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
        ray.train.report(merged, checkpoint=checkpoint)

    def restore(self, checkpoint: Any = None) -> Any:
        """Continue from ``checkpoint`` (default: ``ray.train.get_checkpoint()``, the run's latest).

        Every worker calls it: the scaler, its steps and skips come back (checked whole, see
        :meth:`load_state_dict`) and the workers' states are compared once. Returns the checkpoint
        (load your model from it) or ``None`` when there is none.

        Raises:
            ValueError: the checkpoint holds no :attr:`CHECKPOINT_FILE`, or a state the gate refuses.
        """
        checkpoint = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            path = os.path.join(folder, self.CHECKPOINT_FILE)
            if not os.path.exists(path):
                raise ValueError(f"checkpoint: {checkpoint} holds no {self.CHECKPOINT_FILE}; it was not "
                                 "reported with RayTrainReporter.report(checkpoint_dir=...)")
            state = torch.load(path, weights_only=True)
        self.load_state_dict(state)
        if self.loop.last is not None:
            self._keep(self.loop.last)  # the restored values, until the next read
        return checkpoint
