"""The device ring of step outcomes of the Keras ``LossScaleOptimizer``: which optimizer steps were not
ordinary ones, why, at which scale; written in the step, read at the log interval with the state.

Each step's outcome code is the core's :func:`~lossscale_callbacks.skips._outcomes.step_code` (the decision
written once, against the backend's :class:`~lossscale_callbacks._ops.Ops`: ``tf`` ops in TensorFlow's traced
step, ``keras.ops`` inside JAX's jitted ``stateless_apply``, torch's own ops on the torch backend). Keras'
optimizer has one non-ordinary outcome, a skip for Inf/NaN gradients (code 1: ``"overflow"`` when the policy
scales, ``"nonfinite"`` at a fixed scale of 1).

Layout (the torch ring's, in the counters' integer dtype): ``rows`` is ``(capacity + 1, 3)``, one row
``[step, code, the scale's float32 bits]`` per non-ordinary step; each step writes its row at ``written %
(capacity + 1)`` (a one-hot ``where``, no dynamic indexing: XLA, ``tf.function`` and ``jit`` alike) and moves
``written`` on only when the code is not 0, so an ordinary step writes into the free row and the
``capacity`` newest records always stand. ``step`` counts attempted optimizer steps from 1, as the metrics'
step axis (the state's ``steps`` before the step, plus one).

The ring's two variables are outside Keras' tracking and saving, like the forensics' tally (a saved model
and a ``tf.train.Checkpoint`` hold the state, not the record), and among ``optimizer.variables`` so that a
stateless step (JAX's ``fit``) threads them. :meth:`OutcomeRing.read` copies them to the host in the same
transfer as the state (:meth:`~lossscale_callbacks.keras.LossScaleOptimizer.read_state_and_outcomes`) and
decodes the records since the previous read into an
:class:`~lossscale_callbacks.skips._outcomes.IntervalOutcomes`.

Ops added to a step (counted in ``tests/test_keras_ledger.py``): see :data:`OPS_PER_STEP`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks import LossScaleState
from lossscale_callbacks.integration import IntervalOutcomes, decode_records, nonfinite_cause, step_code
from lossscale_callbacks.keras._keras_ops import counter_dtype

DEFAULT_CAPACITY = 64
OPS_PER_STEP = {"tensorflow": 25, "jax": 14, "torch": 14}
"""The most ops the ring adds to one step, per backend, as ``tests/test_keras_ledger.py`` counts them:
TensorFlow graph ops (the variables' reads and writes included), JAX ``jaxpr`` equations, torch's dispatched
aten ops."""


def _creation_scope() -> Any:
    """Variables made while a ``tf.function`` traces the first apply must be made eagerly."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


@dataclasses.dataclass
class _Cursor:
    """Where the previous read left off: records written, steps and skipped steps of the state."""

    written: int = 0
    steps: int = 0
    skipped: int = 0


class OutcomeRing:
    """The last ``capacity`` non-ordinary steps of one Keras optimizer, on the device (see the module).

    Args:
        capacity: records kept between two reads (>= 1); more are counted, the oldest not listed.

    Example:
        >>> ring = OutcomeRing(capacity=2)
        >>> ring.build()
        >>> [tuple(v.shape) for v in ring.variable_list]
        [(3, 3), ()]
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.rows: Any = None
        self.written: Any = None
        self._cursor = _Cursor()
        self._torch_constants: Any = None

    @property
    def variable_list(self) -> list[Any]:
        """The ring's variables (part of ``optimizer.variables``), empty before :meth:`build`."""
        return [] if self.rows is None else [self.rows, self.written]

    def build(self) -> None:
        """Make the two variables (once)."""
        if self.rows is not None:
            return
        dtype = counter_dtype()
        with _creation_scope():
            self.rows = keras.Variable(np.zeros((self.capacity + 1, 3), dtype), dtype=dtype, trainable=False,
                                       aggregation="only_first_replica", name="outcome_rows")
            self.written = keras.Variable(np.zeros((), dtype), dtype=dtype, trainable=False,
                                          aggregation="only_first_replica", name="outcome_written")

    # ------------------------------------------------------------------------------ the step

    def next_values(self, rows: Any, written: Any, steps: Any, scale_bits: Any, finite: Any,
                    rule_ops: Any) -> tuple[Any, Any]:
        """The ring after one step (``keras.ops`` or TensorFlow's, traced: TensorFlow and JAX).

        Args:
            rows, written: the ring's values before the step.
            steps: the state's attempted steps before the step.
            scale_bits: the float32 scale the step used, as its bits in the counters' dtype.
            finite: whether every gradient was finite (the skip decision).
            rule_ops: the backend's ``Ops`` (the outcome code is the core's ``step_code`` on them).
        """
        dtype = keras.backend.standardize_dtype(rows.dtype)
        code = step_code(rule_ops.logical_not(finite), False, True, rule_ops)
        code = ops.cast(code, dtype)
        row = ops.stack([ops.add(steps, ops.cast(1, dtype)), code, scale_bits])
        slots = ops.arange(self.capacity + 1, dtype=dtype)
        hit = ops.expand_dims(ops.equal(slots, ops.mod(written, self.capacity + 1)), 1)
        new_rows = ops.where(hit, ops.expand_dims(row, 0), rows)
        return new_rows, ops.add(written, ops.minimum(code, ops.cast(1, dtype)))

    def record(self, state: LossScaleState, finite: Any, scale_bits: Any, rule_ops: Any) -> None:
        """One step, assigned to the variables (TensorFlow's traced step): ``state`` is before the step."""
        rows, written = self.next_values(self.rows.value, self.written.value, state.steps, scale_bits, finite,
                                         rule_ops)
        self.rows.assign(rows)
        self.written.assign(written)

    def record_torch(self, state: LossScaleState, finite: Any, rule_ops: Any) -> None:
        """One step with torch's own ops, in place (the torch backend): a row copied into its slot."""
        import torch

        rows, written = self.rows.value, self.written.value
        if self._torch_constants is None or self._torch_constants[0].device != rows.device:
            row = torch.zeros(3, dtype=rows.dtype, device=rows.device)
            self._torch_constants = (row, torch.zeros(1, dtype=rows.dtype, device=rows.device))
        row, pos = self._torch_constants
        with torch.no_grad():
            code = step_code(rule_ops.logical_not(finite), False, True, rule_ops)
            torch.stack([state.steps + 1, code.to(rows.dtype), state.scale.view(torch.int32).to(rows.dtype)],
                        out=row)
            torch.remainder(written.view(1), self.capacity + 1, out=pos)
            rows.index_copy_(0, pos, row.view(1, 3))
            written.add_(code != 0)

    # ------------------------------------------------------------------------------ reading

    def flat(self) -> list[Any]:
        """The ring's values to copy with the state (flattened, the counters' dtype)."""
        return [ops.reshape(self.rows.value, (-1,)), ops.reshape(self.written.value, (1,))]

    def decode(self, state: LossScaleState, flat: Sequence[int], policy: Any) -> IntervalOutcomes:
        """The interval since the previous read, from the state and the ring's host values (:meth:`flat`).

        A state that went back (a restored checkpoint) or a ring that did starts afresh: the interval
        is empty at the state's step.
        """
        values = np.asarray(flat, dtype=np.int64)
        n = (self.capacity + 1) * 3
        raw = values[:n].reshape(self.capacity + 1, 3)
        written = int(values[n])
        steps, skipped = int(state.steps), int(state.skipped_steps)
        cursor = self._cursor
        if steps < cursor.steps or skipped < cursor.skipped or written < cursor.written:
            self._cursor = _Cursor(written, steps, skipped)
            return IntervalOutcomes(steps + 1, steps)
        scales = raw[:, 2].astype(np.int32).view(np.float32)
        rows = [[int(s), int(c), float(x)] for (s, c, _), x in zip(raw, scales, strict=True)]
        cause = nonfinite_cause(policy)
        listed, _ = decode_records(rows, written, cursor.written, self.capacity, cause)
        new = skipped - cursor.skipped
        listed = tuple(o for o in listed if cursor.steps < o.step <= steps)
        listed = listed[max(0, len(listed) - new):]  # never more than the state's count of new skips
        self._cursor = _Cursor(written, steps, skipped)
        return IntervalOutcomes(cursor.steps + 1, steps, listed, {cause: new}, missed=new - len(listed))

    def restart(self, steps: int, skipped: int) -> None:
        """A state was assigned (loaded, carried over): the records belong to the state it replaces, so the
        ring is emptied (device writes, no read) and the next read covers only what follows."""
        if self.written is not None:
            self.written.assign(ops.zeros_like(self.written.value))
        self._cursor = _Cursor(0, steps, skipped)


__all__ = ["DEFAULT_CAPACITY", "OPS_PER_STEP", "OutcomeRing"]
