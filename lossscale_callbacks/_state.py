"""The running values of loss scaling, held by the framework on its device."""

from __future__ import annotations

from typing import Any, NamedTuple


class LossScaleState(NamedTuple):
    """Everything the update rule carries from one optimizer step to the next.

    A ``NamedTuple`` so that ``tf.nest``, ``torch.utils._pytree`` and ``jax.tree_util`` treat
    it as a structure of tensors: an integration keeps each field in a framework variable or
    tensor on the device, and checkpoints it with the model.

    Attributes:
        scale: the current loss scale, float32.
        growth_counter: consecutive finite steps since the last growth or overflow.
        hysteresis_left: overflows still tolerated before the next backoff; refilled to the
            policy's ``hysteresis`` on growth.
        skipped_steps: cumulative number of skipped (non-finite) steps.
        steps: cumulative number of optimizer steps attempted, skipped ones included.
    """

    scale: Any
    growth_counter: Any
    hysteresis_left: Any
    skipped_steps: Any
    steps: Any


STATE_FIELDS: tuple[str, ...] = LossScaleState._fields
