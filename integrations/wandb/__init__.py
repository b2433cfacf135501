"""Weights & Biases for lossscale-callbacks: a sink that logs to a W&B run, and a reader for offline runs.

Needs the ``wandb`` package (``pip install lossscale-callbacks[wandb]``).

Example:
    >>> from lossscale_callbacks.wandb import WandbSink, read_run
    >>> sink = WandbSink(project="fp16", mode="offline", dir="/tmp")    # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()   # doctest: +SKIP
    >>> read_run("/tmp/wandb")["loss_scale/scale"]                      # doctest: +SKIP
    [(100, 32768.0)]
"""

from lossscale_callbacks.wandb.reader import (
    RunInfo,
    RunReadError,
    read_run,
    read_run_info,
    read_tables,
    wait_until_finished,
)
from lossscale_callbacks.wandb.sink import (
    FINAL_SCALE,
    OVERALL_SKIP_RATE,
    STEP_METRIC,
    TOTAL_SKIPPED_STEPS,
    WandbOfflineWarning,
    WandbSink,
)

__all__ = [
    "FINAL_SCALE",
    "OVERALL_SKIP_RATE",
    "STEP_METRIC",
    "TOTAL_SKIPPED_STEPS",
    "RunInfo",
    "RunReadError",
    "WandbOfflineWarning",
    "WandbSink",
    "read_run",
    "read_run_info",
    "read_tables",
    "wait_until_finished",
]
