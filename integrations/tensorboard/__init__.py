"""TensorBoard for lossscale-callbacks: a sink that writes event files, and a reader for the report command.

Needs only the ``tensorboard`` package (``pip install lossscale-callbacks[tensorboard]``);
neither TensorFlow nor torch is imported.

Example:
    >>> from lossscale_callbacks.tensorboard import TensorBoardSink, read_run
    >>> sink = TensorBoardSink("runs/fp16")                          # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()  # doctest: +SKIP
    >>> read_run("runs/fp16")["loss_scale/scale"]                     # doctest: +SKIP
    [(100, 32768.0)]
"""

from lossscale_callbacks.tensorboard.reader import RunReadError, read_run, read_texts
from lossscale_callbacks.tensorboard.sink import LAYOUT_CATEGORY, TensorBoardSink, loss_scale_layout

__all__ = [
    "LAYOUT_CATEGORY",
    "RunReadError",
    "TensorBoardSink",
    "loss_scale_layout",
    "read_run",
    "read_texts",
]
