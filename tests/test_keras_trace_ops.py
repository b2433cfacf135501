"""The ops the Keras forward trace adds to a traced step, counted in TensorFlow graphs: linear in the number
of layer calls, and the fold into the tally the same whatever that number (the figures in the README)."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("counts TensorFlow graph ops (KERAS_BACKEND=tensorflow)", allow_module_level=True)

from lossscale_callbacks.keras import _forward_device as device  # noqa: E402

SKIP = ("Placeholder", "Const", "Identity", "NoOp")


def _ops(function, *specs) -> int:
    graph = tf.function(function).get_concrete_function(*specs).graph
    return len([op for op in graph.get_operations() if op.type not in SKIP])


def step_ops(calls: int, chained: bool) -> int:
    """Ops of one traced step's vector for ``calls`` layer calls; ``chained``: each call's input is the
    previous call's output (matched by identity, not reduced again)."""
    def vector(*tensors):
        events = [(i, [tensors[i + 1]], [i - 1] if chained and i else [tensors[0]]) for i in range(calls)]
        return device.step_vector(events, calls, 1.0)

    return _ops(vector, *[tf.TensorSpec((8, 16), tf.float16) for _ in range(calls + 1)])


def fold_ops(layers: int) -> int:
    layout = device.Layout(layers)
    return _ops(lambda t, v, f, s: device.fold(t, v, f, s, layout),
                tf.TensorSpec((layout.size,), tf.float32), tf.TensorSpec((2 + 2 * layers,), tf.float32),
                tf.TensorSpec((), tf.bool), tf.TensorSpec((), tf.int64))


def test_a_traced_step_adds_ops_linear_in_the_layer_calls():
    for chained in (True, False):
        counts = {n: step_ops(n, chained) for n in (1, 2, 4, 8)}
        per_call = counts[2] - counts[1]
        assert all(counts[n] == counts[1] + per_call * (n - 1) for n in counts), counts
        # two reductions per output (Inf/NaN code, largest finite |value|), one more per unmatched input
        assert per_call <= (17 if chained else 22), counts
        assert counts[1] - per_call <= 46, counts


def test_the_fold_is_the_same_for_any_number_of_layers():
    assert fold_ops(1) == fold_ops(8) == fold_ops(64) <= 96
