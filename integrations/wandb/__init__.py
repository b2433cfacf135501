"""Weights & Biases for lossscale-callbacks: ``WandbSink``, a sink that logs to a W&B run.

Needs the ``wandb`` package (``pip install "lossscale-callbacks[wandb]"``). ``lossscale-callbacks report
/tmp/wandb`` reads an offline run back (its reader is found through the ``lossscale_callbacks.readers``
entry point).

Example:
    >>> from lossscale_callbacks.wandb import WandbSink
    >>> sink = WandbSink(project="fp16", mode="offline", dir="/tmp")    # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()   # doctest: +SKIP
"""

from lossscale_callbacks.integration import lazy_attributes, require

require("wandb", "wandb", feature="lossscale_callbacks.wandb")


__all__ = ["WandbSink"]


# The sink is imported when it is asked for: `report` reads runs through this package's reader
# without loading the writer.
__getattr__ = lazy_attributes(__name__, {"WandbSink": "lossscale_callbacks.wandb._sink"})


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
