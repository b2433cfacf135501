"""The overflow forensics of the Keras ``LossScaleOptimizer`` on the device, in ``keras.ops``: every backend.

One set of functions for TensorFlow, JAX and torch (:class:`Tally` in, :class:`Tally` out, no state of
their own), so the TensorFlow step assigns their results to variables, JAX's stateless step threads
them through ``jit``, and torch's step runs them eagerly:

- :func:`bad_flags`: one 0/1 per gradient, from the reductions the skip check itself makes (one
  ``all(isfinite)`` per gradient); :func:`layer_flags` folds them into one per layer (a segment sum
  over the variables' layer ids, which the layout maps by variable).
- :func:`fold_skip`: on a skipped step (the callers run it in a ``cond`` on the device, or on torch
  where the step already read the flag), the cause (non-finite loss, Inf or NaN gradients: the NaN
  pass runs here, on skipped steps only), the per-layer counts and the **origin**: with the layer
  flags in forward order, the last flagged layer, counted one-hot.
- :func:`sample`: every ``headroom_every`` steps, per layer the largest ``|scaled gradient|`` (a NaN
  wins), the values below float16's smallest subnormal, and a histogram of ``log2 |scaled gradient|``
  (the float32 exponent bits, exact).
- :class:`Packed`, :func:`split`/:func:`join`: the tally as the optimizer holds it, one integer and one
  float32 vector (a jitted step threads two arrays, not nine).
- :func:`pack`/:func:`unpack`: the whole tally as one integer vector (the float32 values as their
  bits), so the read at the log interval is one device-to-host copy.

Integers are the counters' dtype (int64; int32 on JAX without x64), so TensorFlow keeps them on the
GPU; exact up to 2**31 (JAX) per interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from lossscale_callbacks.integration import FP16_MIN_SUBNORMAL, HISTOGRAM_EXPONENTS
from lossscale_callbacks.keras._keras_ops import counter_dtype

_LO, _HI = HISTOGRAM_EXPONENTS
BINS = _HI - _LO


class Tally(NamedTuple):
    """What one optimizer's forensics hold between two reads (``L`` layers, ``V`` optimizer variables).

    Attributes:
        causes: skipped steps per cause, ``[loss_nonfinite, grad_inf, grad_nan, grad_nonfinite]``.
        layer_skips: ``[L]``, skipped steps (finite loss) in which the layer was flagged.
        origins: ``[L]``, skipped steps (finite loss) in which the layer was the last flagged one.
        sampled: 1 when a headroom sample was taken since the last read.
        sample_scale: the loss scale at that sample (float32).
        sample_max: ``[L]``, the largest ``|scaled gradient|`` (float32; NaN wins; 0 for no gradient).
        sample_under: ``[L]``, gradient values below float16's smallest subnormal once scaled.
        sample_seen: ``[V]``, 1 for the optimizer variables that had a gradient in the sample.
        histogram: ``[BINS]``, ``log2 |scaled gradient|`` counts (see ``HISTOGRAM_EDGES``).
    """

    causes: Any
    layer_skips: Any
    origins: Any
    sampled: Any
    sample_scale: Any
    sample_max: Any
    sample_under: Any
    sample_seen: Any
    histogram: Any


class Packed(NamedTuple):
    """The tally as the optimizer holds it: two vectors, so a jitted step threads two arrays, not nine.

    Attributes:
        counts: the integer fields of :class:`Tally` one after the other (``COUNTS`` order).
        floats: the float32 fields (``FLOATS`` order).
    """

    counts: Any
    floats: Any


COUNTS = ("causes", "layer_skips", "origins", "sampled", "sample_under", "sample_seen", "histogram")
FLOATS = ("sample_scale", "sample_max")
# The counters a read starts afresh: the leading fields of ``counts`` (the sample stays until replaced).
RESET = ("causes", "layer_skips", "origins", "sampled")


def _sizes(layers: int, variables: int) -> dict[str, int]:
    return dict(zip(Tally._fields, (4, layers, layers, 1, 1, layers, layers, variables, BINS), strict=True))


def reset_length(layers: int) -> int:
    """How many leading values of ``counts`` a read sets back to 0 (the ``RESET`` fields)."""
    return sum(_sizes(layers, 0)[name] for name in RESET)


def zeros(layers: int, variables: int) -> Packed:
    """A fresh tally as NumPy arrays (the variables' initial values)."""
    sizes = _sizes(layers, variables)
    return Packed(np.zeros(sum(sizes[n] for n in COUNTS), counter_dtype()),
                  np.zeros(sum(sizes[n] for n in FLOATS), "float32"))


def split(packed: Packed, layers: int, variables: int) -> Tally:
    """:class:`Packed` as a :class:`Tally` of slices (scalars for ``sampled`` and ``sample_scale``)."""
    sizes, fields = _sizes(layers, variables), {}
    for vector, names in ((packed.counts, COUNTS), (packed.floats, FLOATS)):
        start = 0
        for name in names:
            part = vector[start:start + sizes[name]]
            fields[name] = ops.reshape(part, ()) if name in ("sampled", "sample_scale") else part
            start += sizes[name]
    return Tally(**fields)


def join(tally: Tally, like: Packed) -> Packed:
    """A :class:`Tally` as :class:`Packed`, in ``like``'s dtypes (the branches of a ``cond`` must agree)."""
    return Packed(*(ops.cast(ops.concatenate([ops.reshape(getattr(tally, n), (-1,)) for n in names]), v.dtype)
                    for names, v in ((COUNTS, like.counts), (FLOATS, like.floats))))


def _torch() -> bool:
    return keras.backend.backend() == "torch"


def _segment_sum(data: Any, ids: Any, segments: int) -> Any:
    if _torch():  # Keras' torch segment_sum goes through float32 and a host-made shape tensor
        import torch

        return torch.zeros(segments, dtype=data.dtype, device=data.device).index_add_(0, ids.long(), data)
    return ops.segment_sum(data, ids, num_segments=segments)


def _segment_max(data: Any, ids: Any, segments: int) -> Any:
    """Per segment the largest of non-negative ``data``, 0 for an empty segment."""
    if _torch():
        import torch

        return torch.zeros(segments, dtype=data.dtype, device=data.device).scatter_reduce_(
            0, ids.long(), data, "amax")
    return ops.maximum(ops.segment_max(data, ids, num_segments=segments), 0.0)


def bad_flags(grads: Sequence[Any]) -> Any:
    """``[n]`` float32: 1 where a gradient holds an Inf or NaN (the skip check's reductions), 0 else."""
    finite = ops.stack([ops.all(ops.isfinite(g)) for g in grads])
    return 1.0 - ops.cast(finite, "float32")  # 2 ops for all of them, not 2 more per gradient


def bad_codes(grads: Sequence[Any]) -> Any:
    """``[n]`` float32: per gradient 0 when finite, 1 when it holds an Inf (and no NaN), 2 when a NaN: one
    reduction per gradient, as the skip check's own, so a skipped step's cause needs no second pass."""
    return ops.stack([ops.max(ops.where(ops.isfinite(g), 0.0, ops.where(ops.isnan(g), 2.0, 1.0)))
                      for g in grads])


def layer_flags(bad: Any, ids: Any, layers: int) -> Any:
    """``[L]`` float32: 1 where any of the layer's gradients is flagged in ``bad``."""
    return ops.minimum(_segment_sum(bad, ids, layers), 1.0)


def any_nan(grads: Sequence[Any]) -> Any:
    """Whether any gradient holds a NaN (run on skipped steps only)."""
    return ops.any(ops.stack([ops.any(ops.isnan(g)) for g in grads]))


def fold_skip(tally: Tally, flags: Any, loss_bad: Any, nan: Any) -> Tally:
    """Count one skipped step: its cause, its flagged layers and its origin (the last flagged layer)."""
    count = counter_dtype()
    loss = ops.cast(loss_bad, count)
    grad = 1 - loss  # the layers and the kind are counted only when the loss was finite
    nan = ops.cast(nan, count)
    causes = ops.stack([loss, grad * (1 - nan), grad * nan, ops.zeros((), count)])
    flagged = ops.cast(flags, count)
    # Forward order: the flagged layer with the largest position is the one nearest the loss.
    weights = flagged * ops.arange(1, flags.shape[0] + 1, dtype=count)
    last = ops.max(weights, initial=0)
    origin = ops.cast(ops.logical_and(ops.equal(weights, last), last > 0), count)
    return tally._replace(causes=tally.causes + causes, layer_skips=tally.layer_skips + flagged * grad,
                          origins=tally.origins + origin * grad)


def _floor_log2_bins(scaled: Any) -> Any:
    """The histogram bin of each value: ``floor(log2 v)`` from the float32 exponent bits, clipped to the
    edges; zeros and non-finite values go to an extra bin (dropped when read)."""
    bits = ops.view(scaled, "int32")
    exponent = ops.bitwise_and(ops.right_shift(bits, 23), 255) - 127
    bins = ops.clip(exponent, _LO, _HI - 1) - _LO
    usable = ops.logical_and(scaled > 0, ops.isfinite(scaled))
    return ops.where(usable, bins, BINS)


def sample(tally: Tally, grads: Sequence[Any], ids: Any, seen: Any, factor: Any, scale: Any) -> Tally:
    """The headroom sample of this step (replaces the previous one): per layer the largest scaled value,
    the underflowing values, which variables took part, and the histogram; ``factor`` turns the given
    gradients into scaled ones (the scale when they were unscaled already, else 1)."""
    count = counter_dtype()
    layers = tally.layer_skips.shape[0]
    maxes, nans, unders = [], [], []
    histogram = ops.zeros((BINS + 1,), count)
    for grad in grads:
        scaled = ops.abs(ops.reshape(ops.cast(grad, "float32"), (-1,))) * factor
        nan = ops.any(ops.isnan(scaled))
        # XLA's max may drop a NaN: it is carried beside the maximum and wins when read back.
        maxes.append(ops.where(nan, 0.0, ops.max(scaled, initial=0.0)))
        nans.append(ops.cast(nan, "float32"))
        tiny = ops.logical_and(scaled > 0, scaled < FP16_MIN_SUBNORMAL)
        unders.append(ops.sum(ops.cast(tiny, count)))
        bins = _floor_log2_bins(scaled)
        histogram = histogram + _segment_sum(ops.ones_like(bins, dtype=count), bins, BINS + 1)
    nan_layers = _segment_sum(ops.stack(nans), ids, layers) > 0
    largest = ops.where(nan_layers, float("nan"), _segment_max(ops.stack(maxes), ids, layers))
    return tally._replace(
        sampled=ops.ones((), count), sample_scale=ops.cast(scale, "float32"), sample_max=largest,
        sample_under=_segment_sum(ops.stack(unders), ids, layers), sample_seen=ops.cast(seen, count),
        histogram=histogram[:BINS])


def pack(packed: Packed) -> Any:
    """The tally as one integer vector for the host: the counts, then the float32 values as their bits."""
    bits = ops.cast(ops.view(ops.cast(packed.floats, "float32"), "int32"), packed.counts.dtype)
    return ops.concatenate([packed.counts, bits])


def unpack(host: np.ndarray, layers: int, variables: int) -> Tally:
    """:func:`pack`'s vector, back on the host, as a tally of NumPy arrays."""
    sizes = _sizes(layers, variables)
    out, start = {}, 0
    for name in COUNTS + FLOATS:
        part = np.asarray(host[start:start + sizes[name]])
        start += sizes[name]
        out[name] = part.astype(np.int32).view(np.float32) if name in FLOATS else part.astype(np.int64)
    return Tally(**out)
