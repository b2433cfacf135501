"""Weights & Biases for lossscale-callbacks: ``WandbSink``, a sink that logs to a W&B run.

Needs the ``wandb`` package (``pip install "lossscale-callbacks[wandb]"``). ``lossscale-callbacks report
/tmp/wandb`` reads an offline run back (its reader is found through the ``lossscale_callbacks.readers``
entry point).

Example:
    >>> from lossscale_callbacks.wandb import WandbSink
    >>> sink = WandbSink(project="fp16", mode="offline", dir="/tmp")    # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()   # doctest: +SKIP
"""

import importlib
from typing import Any

from lossscale_callbacks._extras import require

require("wandb", "wandb", feature="lossscale_callbacks.wandb")


__all__ = ["WandbSink"]


def __getattr__(attr: str) -> Any:
    # The sink is imported when it is asked for: `report` reads runs through this package's reader
    # without loading the writer.
    if attr == "WandbSink":
        return importlib.import_module("lossscale_callbacks.wandb._sink").WandbSink
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
