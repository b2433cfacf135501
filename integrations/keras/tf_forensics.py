"""Overflow forensics for Keras' ``LossScaleOptimizer(diagnose=...)`` on TensorFlow, traced into the step.

What a step costs: the per-variable finiteness flags are the ones the skip decision already computes
(one reduction per gradient); the loss flag is one scalar op; the counters a handful of tiny ops. The
Inf-or-NaN check runs inside a ``tf.cond`` that only takes its branch on a skipped step, and the
headroom sample (largest ``|scaled gradient|``, underflowing values, histogram) inside one that only
takes it every ``headroom_every`` steps: both decided on the device, no host read. The variables live
outside Keras' tracking, so saved models do not change with ``diagnose``; :meth:`read` is the one host
read, at the log interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lossscale_callbacks.forensics import (
    CAUSES,
    FP16_MIN_SUBNORMAL,
    HISTOGRAM_EXPONENTS,
    IntervalForensics,
    LayerHeadroom,
    layer_of,
)

_LO, _HI = HISTOGRAM_EXPONENTS


def _variable(value: Any, dtype: tf.DType, name: str) -> tf.Variable:
    return tf.Variable(tf.constant(value, dtype), trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_WRITE,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _floor_log2(x: tf.Tensor) -> tf.Tensor:
    """``floor(log2 x)`` of positive normal float32 values, exactly: the exponent bits."""
    bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 23), 0xFF) - 127


class KerasForensics:
    """Device-side accumulators for one optimizer's variables (see the module docstring).

    Args:
        mode: ``True`` or ``"every_step"`` (then the headroom is sampled at every step).
        headroom_every: steps between headroom samples.
        names: one layer name per trainable variable, in the optimizer's variable order.
        sizes: each variable's number of values.
    """

    def __init__(self, mode: bool | str, headroom_every: int, names: Sequence[str],
                 sizes: Sequence[int]) -> None:
        self.mode = mode
        self.headroom_every = 1 if mode == "every_step" else int(headroom_every)
        self.names = list(names)
        self.sizes = [int(s) for s in sizes]
        self.layers = list(dict.fromkeys(self.names))
        position = {layer: i for i, layer in enumerate(self.layers)}
        self._layer_ids = [position[n] for n in self.names]
        n, layers = len(self.names), len(self.layers)
        self.counts = _variable([0.0] * layers, tf.float32, "forensics_layer_skips")
        self.causes = _variable([0] * 4, tf.int64, "forensics_causes")
        self.loss_bad = _variable(False, tf.bool, "forensics_loss_bad")
        self.sample_max = _variable([0.0] * n, tf.float32, "forensics_max_abs_scaled")
        self.sample_under = _variable([0] * n, tf.int64, "forensics_underflow")
        self.sample_hist = _variable([0] * (_HI - _LO), tf.int64, "forensics_histogram")
        self.sample_scale = _variable(0.0, tf.float32, "forensics_sample_scale")
        self.sampled = _variable(False, tf.bool, "forensics_sampled")

    # ------------------------------------------------------------------------------ traced

    def on_loss(self, loss: tf.Tensor) -> None:
        """``scale_loss`` saw this loss: remember whether it was finite."""
        bad = tf.logical_not(tf.reduce_all(tf.math.is_finite(tf.cast(loss, tf.float32))))
        self.loss_bad.assign(tf.logical_or(self.loss_bad, bad))

    def on_step(self, grads: Sequence[Any], per_grad_finite: tf.Tensor, finite: tf.Tensor, scale: tf.Tensor,
                steps: tf.Tensor, already_unscaled: bool) -> None:
        """After the skip decision: fold the step into the counters; sample the headroom when due."""
        skipped = tf.logical_not(finite)
        loss_bad = tf.logical_and(skipped, self.loss_bad)
        grad_skip = tf.logical_and(skipped, tf.logical_not(self.loss_bad))
        flags = tf.cast(tf.logical_not(per_grad_finite), tf.float32)
        layer_flags = tf.math.unsorted_segment_max(flags, tf.constant(self._layer_ids), len(self.layers))
        self.counts.assign_add(layer_flags * tf.cast(grad_skip, tf.float32))
        dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]

        def any_nan() -> tf.Tensor:
            return tf.reduce_any(tf.stack([tf.reduce_any(tf.math.is_nan(g)) for g in dense if g is not None]))

        # The NaN pass runs on skipped steps only, decided on the device.
        nan = tf.cond(grad_skip, any_nan, lambda: tf.constant(False))
        self.causes.assign_add(tf.cast(tf.stack([
            loss_bad, tf.logical_and(grad_skip, tf.logical_not(nan)), tf.logical_and(grad_skip, nan),
            tf.constant(False)]), tf.int64))
        self.loss_bad.assign(False)
        factor = scale if already_unscaled else tf.ones_like(scale)
        due = tf.equal(tf.math.floormod(tf.cast(steps, tf.int64), self.headroom_every), 0)

        def sample() -> tf.Tensor:
            maxes, unders = [], []
            hist = tf.zeros([_HI - _LO], tf.int64)
            for g in dense:
                if g is None:
                    maxes.append(tf.constant(0.0))
                    unders.append(tf.constant(0, tf.int64))
                    continue
                scaled = tf.abs(tf.cast(tf.reshape(g, [-1]), tf.float32)) * factor
                maxes.append(tf.reduce_max(tf.concat([scaled, [0.0]], 0)))
                unders.append(tf.math.count_nonzero(tf.logical_and(scaled > 0, scaled < FP16_MIN_SUBNORMAL),
                                                    dtype=tf.int64))
                usable = tf.boolean_mask(scaled, tf.logical_and(scaled > 0, tf.math.is_finite(scaled)))
                bins = tf.clip_by_value(_floor_log2(usable), _LO, _HI - 1) - _LO
                hist += tf.math.bincount(bins, minlength=_HI - _LO, maxlength=_HI - _LO, dtype=tf.int64)
            # NaN beats every number in the max (XLA's reduce_max would drop it).
            maxes = [tf.where(tf.reduce_any(tf.math.is_nan(tf.reshape(g, [-1]))), float("nan"), m)
                     if g is not None else m for g, m in zip(dense, maxes, strict=True)]
            self.sample_max.assign(tf.stack(maxes))
            self.sample_under.assign(tf.stack(unders))
            self.sample_hist.assign(hist)
            self.sample_scale.assign(scale)
            self.sampled.assign(True)
            return tf.constant(True)

        tf.cond(due, sample, lambda: tf.constant(False))

    # ------------------------------------------------------------------------------ host

    def read(self, step: int, scale: float) -> IntervalForensics:
        """The interval's forensics as host numbers (one read of the variables), and a fresh interval."""
        causes = [int(v) for v in self.causes.numpy()]
        counts = [int(v) for v in self.counts.numpy()]
        layer_skips = {layer: c for layer, c in zip(self.layers, counts, strict=True) if c}
        headroom: tuple[LayerHeadroom, ...] = ()
        histogram = None
        headroom_scale = None
        if bool(self.sampled.numpy()):
            maxes, unders = self.sample_max.numpy().tolist(), self.sample_under.numpy().tolist()
            by_layer: dict[str, list[float]] = {}
            for name, big, under, size in zip(self.names, maxes, unders, self.sizes, strict=True):
                entry = by_layer.setdefault(name, [0.0, 0, 0])
                entry[0] = big if big != big or big > entry[0] else entry[0]  # NaN wins
                entry[1] += int(under)
                entry[2] += size
            headroom = tuple(LayerHeadroom(n, float(v[0]), int(v[1]), int(v[2])) for n, v in by_layer.items())
            histogram = tuple(int(c) for c in self.sample_hist.numpy())
            headroom_scale = float(self.sample_scale.numpy())
            self.sampled.assign(False)
        self.counts.assign(tf.zeros_like(self.counts))
        self.causes.assign(tf.zeros_like(self.causes))
        return IntervalForensics(
            step=step, scale=scale,
            causes=dict(zip(CAUSES, causes, strict=True)),
            layer_skips=layer_skips, layer_order=tuple(self.layers), headroom=headroom, histogram=histogram,
            headroom_scale=headroom_scale)


def variable_layers(variables: Sequence[Any], model: Any = None) -> list[str]:
    """The layer that owns each variable: found by identity in ``model``'s layers (their path in nested
    models), else from the variable's path (``dense_1/kernel`` → ``dense_1``)."""
    owner: dict[int, str] = {}
    if model is not None:
        def visit(layer: Any, prefix: str) -> None:
            for sub in getattr(layer, "_layers", None) or getattr(layer, "layers", None) or ():
                path = f"{prefix}{sub.name}"
                for weight in getattr(sub, "_trainable_variables", None) or sub.trainable_weights:
                    owner.setdefault(id(weight), path)
                visit(sub, path + "/")

        visit(model, "")
    names = []
    for v in variables:
        path = getattr(v, "path", None) or getattr(v, "name", "variable")
        names.append(owner.get(id(v)) or layer_of(str(path).split(":")[0], "/"))
    return names
