"""How the Keras ``LossScaleOptimizer`` is wired to overflow forensics (``diagnose=``): settings, the model
whose layers name the report, the device-side accumulators and the read at the log interval.

The accumulators themselves (:class:`~lossscale_callbacks.keras.tf_forensics.KerasForensics`) run on the
TensorFlow backend only for now; this module holds what the optimizer needs to switch them on and off.
The wiring is a plain object, outside Keras' tracking: neither a saved model nor a ``tf.train.Checkpoint``
depends on ``diagnose``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from lossscale_callbacks._validation import check_int
from lossscale_callbacks.forensics import check_diagnose
from lossscale_callbacks.state import LossScaleState

# The optimizer and the callback refuse diagnose off TensorFlow with these same words.
DIAGNOSE_TF_ONLY = ("diagnose (overflow forensics) is built for the TensorFlow backend of Keras for now, "
                    f"got KERAS_BACKEND={keras.backend.backend()!r}; pass diagnose=False (loss scaling "
                    "itself runs on every backend)")


def check_diagnose_settings(diagnose: Any, headroom_every: Any) -> tuple[bool | str, int]:
    """``(diagnose, headroom_every)`` checked, or a ``ValueError`` naming the argument (also off TensorFlow).

    Example:
        >>> check_diagnose_settings(False, 1000)
        (False, 1000)
    """
    check_diagnose(diagnose)
    check_int("headroom_every", headroom_every)
    if diagnose and keras.backend.backend() != "tensorflow":
        raise ValueError(DIAGNOSE_TF_ONLY)
    return diagnose, headroom_every


class ForensicsWiring:
    """The forensics of one optimizer: what was asked for, which model names the layers, the accumulators.

    Args:
        diagnose: ``False``, ``True`` or ``"every_step"`` (see :mod:`lossscale_callbacks.forensics`).
        headroom_every: steps between float16 headroom samples.

    Example:
        >>> wiring = ForensicsWiring(False, 1000)
        >>> wiring.accumulators is None
        True
    """

    def __init__(self, diagnose: bool | str, headroom_every: int) -> None:
        self.settings = check_diagnose_settings(diagnose, headroom_every)
        self.model: Any = None
        self.accumulators: Any = None

    def configure(self, diagnose: bool | str, headroom_every: int, variables: Sequence[Any] | None) -> None:
        """Switch on or off; ``variables`` (the optimizer's, once built) get accumulators right away."""
        settings = check_diagnose_settings(diagnose, headroom_every)
        if settings != self.settings or (diagnose and self.accumulators is None):
            self.settings = settings
            self.accumulators = None
            self.build(variables)

    def watch(self, model: Any, variables: Sequence[Any] | None) -> None:
        """Name the layers by ``model``'s layer objects from now on (rebuilds live accumulators)."""
        self.model = model
        if self.accumulators is not None:
            self.accumulators = None
            self.build(variables)

    def build(self, variables: Sequence[Any] | None) -> None:
        """Make the accumulators for ``variables`` when forensics are on and there are none yet (``None``:
        the optimizer is not built)."""
        mode, every = self.settings
        if not mode or variables is None or self.accumulators is not None:
            return
        import tensorflow as tf

        from lossscale_callbacks.keras.tf_forensics import KerasForensics, variable_layers

        variables = list(variables)
        names = variable_layers(variables, self.model)
        sizes = [int(np.prod(v.shape)) for v in variables]
        # Variables made while a tf.function traces the first apply must be made eagerly.
        with tf.init_scope():
            self.accumulators = KerasForensics(mode, every, names, sizes)

    def read(self, state: LossScaleState) -> Any:
        """The interval's ``IntervalForensics`` (``None`` when off), at the step and scale of ``state``
        (host values). Host reads: call it at the log interval."""
        if self.accumulators is None:
            return None
        return self.accumulators.read(int(state.steps), float(state.scale))
