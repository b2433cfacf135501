"""The forward trace of a Keras model on the device, in ``keras.ops``: every backend, no state of its own.

A traced step records, per call of a watched layer (an **event**, in the order the calls finish), a code
for its output (0 finite, 1 an Inf, 2 a NaN), the largest finite ``|output|`` and the code of its inputs;
:func:`step_vector` folds the events into one float32 vector per step, ``[traced, producer, maxima[L],
codes[L]]``: ``producer`` is the layer of the first event whose inputs were finite and whose output was
not (the layer that *made* the first non-finite value; the layers after it only passed it on), ``-1``
when none. A nested layer finishes before its parent, so the innermost producer comes first. When no
layer made one from finite inputs, the producer is the first layer whose input was non-finite only
after Keras cast it to the layer's dtype (a float32 layer's output above 65504 entering a float16 one).

:func:`fold` adds one step's vector to the tally, branch-free on a few vectors of ``L`` values: the
interval's per-layer maxima and codes, how many traced and non-finite steps, how often each layer
produced, the ring of the last ``RING`` traced steps' maxima, and the first non-finite step of the
interval with the ring as it stood before it. :func:`decode` turns the tally, read on the host, into
NumPy fields. Step numbers are float32 (exact up to 2**24 steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from keras import ops

from lossscale_callbacks.keras._forensics_device import _segment_max

RING = 4  # the traced steps kept before a non-finite one ("the last few")


class Layout(NamedTuple):
    """Where each field lies in the tally vector of ``L`` layers (``(start, length)``)."""

    layers: int

    def fields(self) -> dict[str, tuple[int, int]]:
        sizes = {"max": self.layers, "code": self.layers, "traced": 1, "nonfinite": 1,
                 "produced": self.layers,
                 "first_producer": 1, "first_step": 1, "first_max": self.layers, "first_code": self.layers,
                 "first_ring": RING * self.layers, "first_ring_steps": RING, "ring": RING * self.layers,
                 "ring_steps": RING, "ring_pos": 1, "armed": 1, "first_armed": 1}
        out, start = {}, 0
        for name, size in sizes.items():
            out[name] = (start, size)
            start += size
        return out

    @property
    def size(self) -> int:
        return sum(n for _, n in self.fields().values())

    @property
    def reset_until(self) -> int:
        """The interval's fields (everything before the ring) are set afresh at a read."""
        return self.fields()["ring"][0]

    def zeros(self) -> np.ndarray:
        """A fresh tally (no first producer, no layer called, empty ring: ``-1``)."""
        tally = np.zeros(self.size, "float32")
        for name in ("max", "first_producer", "first_ring_steps", "ring_steps"):
            start, size = self.fields()[name]
            tally[start:start + size] = -1.0
        return tally


def output_code(tensor: Any) -> Any:
    """0 finite, 1 an Inf (and no NaN), 2 a NaN: one reduction."""
    return ops.max(ops.where(ops.isfinite(tensor), 0.0, ops.where(ops.isnan(tensor), 2.0, 1.0)))


def finite_max(tensor: Any) -> Any:
    """The largest finite ``|value|`` (float32), 0 for none: XLA's max may drop a NaN, so it is masked."""
    return ops.cast(ops.max(ops.where(ops.isfinite(tensor), ops.abs(tensor), 0.0), initial=0.0), "float32")


def step_vector(events: Sequence[tuple[int, Sequence[Any], Sequence[Any]]], layers: int, kind: Any) -> Any:
    """One traced step as ``[kind, producer, maxima[L], codes[L]]`` (float32).

    Args:
        events: per finished layer call, ``(layer index, output tensors, inputs)``; an input is the index
            of an earlier event whose output it is (its code is reused), or a tensor (reduced here).
        layers: ``L``.
        kind: ``1.0`` a scheduled trace, ``2.0`` one armed by a step skipped before it.
    """
    head = ops.stack([ops.cast(kind, "float32"), ops.convert_to_tensor(-1.0, "float32")])
    if not events:
        return ops.concatenate([head, -ops.ones((layers,), "float32"), ops.zeros((layers,), "float32")])
    out_codes: list[Any] = []
    matched: list[Any] = []  # per event: the codes of inputs that are earlier events' outputs
    own: list[Any] = []  # and of inputs reduced here (made inside a parent, or cast to the layer's dtype)
    zero = ops.zeros((), "float32")
    for _, outs, ins in events:
        out_codes.append(ops.max(ops.stack([ops.cast(output_code(t), "float32") for t in outs])))
        known = [out_codes[i] for i in ins if isinstance(i, int)]
        other = [ops.cast(output_code(t), "float32") for t in ins if not isinstance(t, int)]
        matched.append(ops.max(ops.stack(known)) if known else zero)
        own.append(ops.max(ops.stack(other)) if other else zero)
    out_code, in_known, in_own = ops.stack(out_codes), ops.stack(matched), ops.stack(own)
    maxima = ops.stack([ops.max(ops.stack([finite_max(t) for t in outs])) for _, outs, _ in events])
    ids = ops.convert_to_tensor(np.asarray([layer for layer, _, _ in events], "int32"))
    bad_out = out_code > 0
    made = ops.logical_and(bad_out, ops.equal(ops.maximum(in_known, in_own), 0.0))
    # No layer made it from finite inputs: then the first whose own input was non-finite although its
    # producers' outputs were finite (a float32 output that overflowed when cast to this layer's float16).
    cast = ops.logical_and(bad_out, ops.logical_and(ops.equal(in_known, 0.0), in_own > 0))
    chosen = ops.where(ops.any(made), made, cast)
    first = ops.argmax(ops.cast(chosen, "float32"))  # the first maximum: the earliest finished call
    producer = ops.where(ops.any(chosen), ops.cast(ops.take(ids, first), "float32"), -1.0)
    # A layer this forward pass never called (a fused path, a branch not taken) reads -1, not 0.
    called = np.zeros(layers, bool)
    called[[layer for layer, _, _ in events]] = True
    per_layer = ops.where(called, _segment_max(maxima, ids, layers), -1.0)
    codes = _segment_max(out_code, ids, layers)
    return ops.concatenate([head[:1], ops.reshape(producer, (1,)), per_layer, codes])


def not_traced(layers: int) -> np.ndarray:
    """The vector of a step that was not traced."""
    return np.concatenate([[0.0, -1.0], np.zeros(2 * layers)]).astype("float32")


def _get(tally: Any, layout: Layout, name: str) -> Any:
    start, size = layout.fields()[name]
    return tally[start:start + size]


def fold(tally: Any, vector: Any, finite: Any, step: Any, layout: Layout) -> Any:
    """The tally after one step: its traced vector, whether the step was applied (``finite``), its number."""
    layers = layout.layers
    f = {name: _get(tally, layout, name) for name in layout.fields()}
    kind, producer = vector[0], vector[1]
    maxima, codes = vector[2:2 + layers], vector[2 + layers:]
    traced = kind > 0
    step = ops.cast(step, "float32")
    bad = ops.logical_and(traced, ops.max(codes) > 0)
    first = ops.logical_and(bad, ops.equal(f["nonfinite"][0], 0.0))  # the interval's first non-finite step
    pos = ops.cast(f["ring_pos"][0], "int32")
    row = ops.cast(ops.equal(ops.arange(RING), pos), "float32")  # one-hot: the ring slot written now
    ring = ops.reshape(f["ring"], (RING, layers))
    # The ring and the first step keep NaN/Inf themselves (their values are only copied, never compared).
    encoded = ops.where(codes >= 2, float("nan"), ops.where(codes >= 1, float("inf"), maxima))
    new_ring = ops.where(ops.logical_and(traced, row[:, None] > 0), encoded[None, :], ring)
    new_ring_steps = ops.where(ops.logical_and(traced, row > 0), step, f["ring_steps"])
    one_hot = ops.cast(ops.equal(ops.arange(layers), ops.cast(producer, "int32")), "float32")
    parts = {
        "max": ops.where(traced, ops.maximum(f["max"], maxima), f["max"]),  # -1: never called
        "code": ops.where(traced, ops.maximum(f["code"], codes), f["code"]),
        "traced": f["traced"] + ops.cast(traced, "float32"),
        "nonfinite": f["nonfinite"] + ops.cast(bad, "float32"),
        "produced": f["produced"] + one_hot * ops.cast(bad, "float32"),
        "first_producer": ops.where(first, producer, f["first_producer"]),
        "first_step": ops.where(first, step, f["first_step"]),
        "first_max": ops.where(first, encoded, f["first_max"]),
        "first_code": ops.where(first, codes, f["first_code"]),
        "first_ring": ops.where(first, f["ring"], f["first_ring"]),  # the ring before this step
        "first_ring_steps": ops.where(first, f["ring_steps"], f["first_ring_steps"]),
        "ring": ops.reshape(new_ring, (-1,)),
        "ring_steps": new_ring_steps,
        "ring_pos": ops.where(traced, ops.mod(f["ring_pos"] + 1.0, float(RING)), f["ring_pos"]),
        # A step skipped without a trace arms one for the next step: an overflow is still named.
        "armed": ops.cast(ops.logical_and(ops.logical_not(finite), ops.logical_not(traced)), "float32")
        * ops.ones((1,), "float32"),
        "first_armed": ops.where(first, ops.cast(kind > 1.5, "float32"), f["first_armed"]),
    }
    return ops.concatenate([ops.reshape(ops.cast(parts[name], "float32"), (-1,)) for name in layout.fields()])


def decode(host: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """The tally read on the host, by field (NaN/Inf put back into the maxima from the codes)."""
    out = {name: np.asarray(host[s:s + n], "float64") for name, (s, n) in layout.fields().items()}
    out["max"] = np.where(out["code"] >= 2, np.nan, np.where(out["code"] >= 1, np.inf, out["max"]))
    out["ring"] = out["ring"].reshape(RING, layout.layers)
    out["first_ring"] = out["first_ring"].reshape(RING, layout.layers)
    return out
