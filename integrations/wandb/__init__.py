"""Weights & Biases for lossscale-callbacks: ``WandbSink``, a sink that logs to a W&B run.

Needs the ``wandb`` package (``pip install "lossscale-callbacks[wandb]"``). The offline-run reader
behind the ``report`` command is :mod:`lossscale_callbacks.wandb.reader`.

Example:
    >>> from lossscale_callbacks.wandb import WandbSink
    >>> from lossscale_callbacks.wandb.reader import read_run
    >>> sink = WandbSink(project="fp16", mode="offline", dir="/tmp")    # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()   # doctest: +SKIP
    >>> read_run("/tmp/wandb")["loss_scale/scale"]                      # doctest: +SKIP
    [(100, 32768.0)]
"""

from lossscale_callbacks.extras import require

require("wandb", "wandb", feature="lossscale_callbacks.wandb")

from lossscale_callbacks.wandb.sink import WandbSink  # noqa: E402

__all__ = ["WandbSink"]
