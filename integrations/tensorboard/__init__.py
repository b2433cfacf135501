"""TensorBoard for lossscale-callbacks: ``TensorBoardSink``, a sink that writes event files.

Needs only the ``tensorboard`` package (``pip install "lossscale-callbacks[tensorboard]"``); neither
TensorFlow nor torch is imported. The run reader behind the ``report`` command is
:mod:`lossscale_callbacks.tensorboard.reader`.

Example:
    >>> from lossscale_callbacks.tensorboard import TensorBoardSink
    >>> from lossscale_callbacks.tensorboard.reader import read_run
    >>> sink = TensorBoardSink("runs/fp16")                          # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()  # doctest: +SKIP
    >>> read_run("runs/fp16")["loss_scale/scale"]                     # doctest: +SKIP
    [(100, 32768.0)]
"""

from lossscale_callbacks.extras import require

# The event-file protos: TensorBoard installed without protobuf is reported here too, naming the extra.
require("tensorboard.compat.proto.event_pb2", "tensorboard", feature="lossscale_callbacks.tensorboard")

from lossscale_callbacks.tensorboard.sink import TensorBoardSink  # noqa: E402

__all__ = ["TensorBoardSink"]
