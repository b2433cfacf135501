"""TensorBoard for lossscale-callbacks: ``TensorBoardSink``, a sink that writes event files.

Needs only the ``tensorboard`` package (``pip install "lossscale-callbacks[tensorboard]"``); neither
TensorFlow nor torch is imported. ``lossscale-callbacks report runs/fp16`` reads the run back (its reader
is found through the ``lossscale_callbacks.readers`` entry point).

Example:
    >>> from lossscale_callbacks.tensorboard import TensorBoardSink
    >>> sink = TensorBoardSink("runs/fp16")                          # doctest: +SKIP
    >>> sink.write(100, {"loss_scale/scale": 32768.0}); sink.close()  # doctest: +SKIP
"""

from lossscale_callbacks.integration import lazy_attributes, require

# The event-file protos: TensorBoard installed without protobuf is reported here too, naming the extra.
require("tensorboard.compat.proto.event_pb2", "tensorboard", feature="lossscale_callbacks.tensorboard")


__all__ = ["TensorBoardSink"]


# The sink is imported when it is asked for: `report` reads runs through this package's reader
# without loading the writer.
__getattr__ = lazy_attributes(__name__, {"TensorBoardSink": "lossscale_callbacks.tensorboard._sink"})


def __dir__() -> list[str]:
    """The face only: the private modules and helpers behind it stay out of ``dir()``."""
    return list(__all__)
