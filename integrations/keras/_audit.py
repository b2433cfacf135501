"""The precision audit for Keras models, before training: does float16 fit, what to keep in float32, where to
start. Every Keras backend; also run by ``lossscale-callbacks audit`` on a saved ``.keras`` file.

:func:`audit_keras_precision` runs a few sample batches (eagerly, with host reads: it is not a training step):

1. in float32 (every layer's dtype policy ``float32`` for the passes, put back after): per layer the
   largest ``|output|`` (the live trace's own capture and rule, :mod:`~._forward_trace`), the largest
   weight, and the gradients' extent (the largest, and the 1% quantile of the non-zero ``|g|``);
2. in float16 (``mixed_float16``) with the layers found so far kept in float32: the layer that produced
   the first non-finite activation (or whose input only overflowed when cast to float16), added to the
   keep set until the passes are finite (:func:`lossscale_callbacks.forensics._advice.smallest_keep_set`);
3. with that set kept: the largest power-of-two loss scale at which every batch's float16 gradients are
   finite (a bisection over 2^0 to 2^24), the advised starting scale.

The rules and the words are the core's (:func:`lossscale_callbacks.forensics._advice.advise`).
:func:`keep_keras_layers_in_float32` applies a keep list: the layers (with their sublayers) get the
``float32`` dtype policy, so Keras casts their inputs to float32 and they compute in it; the weights are
the same variables.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks.integration import (
    ActivationTrace,
    AuditResult,
    GradientRange,
    advise,
    largest_finite_scale,
    smallest_keep_set,
)
from lossscale_callbacks.keras import _forward_device as device
from lossscale_callbacks.keras._forward_trace import ForwardTrace, traced_layers

__all__ = ["audit_keras_precision", "keep_keras_layers_in_float32"]

FP16_MAX = 65504.0


def _by_path(model: Any) -> dict[str, Any]:
    return dict(traced_layers(model))


def _with_sublayers(model: Any, names: Iterable[str]) -> list[Any]:
    """The named layers and every layer under them (a parent kept in float32 keeps its sublayers too)."""
    paths = _by_path(model)
    chosen: dict[int, Any] = {}
    for name in names:
        if name not in paths:
            known = list(paths)[:8]
            raise ValueError(f"layers: no layer named {name!r} in the model; its layers are named like "
                             f"{known}")
        for path, layer in paths.items():
            if path == name or path.startswith(name + "/"):
                chosen[id(layer)] = layer
    return list(chosen.values())


def _retrace(model: Any) -> None:
    """The compiled functions hold the old dtypes: made again at the next fit/evaluate/predict."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def keep_keras_layers_in_float32(model: keras.Model, layers: Iterable[str]) -> keras.Model:
    """Keep the named layers (and their sublayers) in float32 under ``mixed_float16``: each gets the
    ``float32`` dtype policy, so Keras casts its inputs to float32 and it computes in float32.

    Args:
        model: the Keras model (built).
        layers: layer paths as the audit, the trace and the forensics give them (``"block/wo"``).

    Returns:
        ``model``, changed in place; its compiled train/test/predict functions are made again.

    Raises:
        ValueError: a name is not a layer of ``model``.

    Example:
        >>> half = "mixed_float16"
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="wo", dtype=half),
        ...                           keras.layers.Dense(1, name="head", dtype=half)])
        >>> _ = keep_keras_layers_in_float32(model, ["wo"])
        >>> model.get_layer("wo").compute_dtype, model.get_layer("head").compute_dtype
        ('float32', 'float16')
    """
    for layer in _with_sublayers(model, list(layers)):  # every name checked before anything changes
        layer.dtype_policy = keras.DTypePolicy("float32")
    _retrace(model)
    return model


@contextlib.contextmanager
def _policies(model: Any, policy_of: Callable[[str], str]) -> Iterator[None]:
    """Every layer under the policy ``policy_of(path)`` for the block, then its own again."""
    found = traced_layers(model)
    before = [layer.dtype_policy for _, layer in found]
    try:
        for path, layer in found:
            layer.dtype_policy = keras.DTypePolicy(policy_of(path))
        yield
    finally:
        for (_, layer), policy in zip(found, before, strict=True):
            layer.dtype_policy = policy


def _loss(model: Any, batch: Any, loss_fn: Callable[..., Any] | None) -> Any:
    if loss_fn is not None:
        return loss_fn(model, batch)
    x, y = batch if isinstance(batch, tuple) else (batch, None)
    if not getattr(model, "compiled", False) or y is None:
        raise ValueError("loss_fn: the model is not compiled with a loss, or the batch is not (x, y); pass "
                         "loss_fn=lambda model, batch: ... returning the loss")
    return model.compute_loss(x=x, y=y, y_pred=model(x, training=True))


def _gradients(fn: Callable[[], Any], variables: list[Any]) -> list[Any]:
    """The gradients of ``fn()`` with respect to ``variables``, with the backend's own autodiff."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = ops.cast(fn(), "float32")
        return list(tape.gradient(loss, variables))
    from lossscale_callbacks.keras._backend_steps import _jax_gradients, _torch_gradients

    gradients = _jax_gradients if backend == "jax" else _torch_gradients
    return gradients(lambda: ops.cast(fn(), "float32"), variables)


class _Runner:
    """The sample batches run one way or another, with the forward trace's capture on the model."""

    def __init__(self, model: Any, batches: list[Any], loss_fn: Callable[..., Any] | None) -> None:
        self.model, self.batches, self.loss_fn = model, batches, loss_fn
        self.trace = ForwardTrace(1)
        self.trace.watch(model)
        self.variables = list(model.trainable_variables)

    def close(self) -> None:
        self.trace.unwatch()

    def _forward(self, batch: Any) -> np.ndarray:
        """One forward pass and its loss: ``[kind, producer, maxima, codes, loss code]`` on the host."""
        loss = _loss(self.model, batch, self.loss_fn)
        forward, self.trace._finished = self.trace._finished, None
        events = forward.events if forward is not None else []
        vector = np.asarray(ops.convert_to_numpy(device.step_vector(events, len(self.trace.layers), 1.0)))
        loss_code = float(np.asarray(ops.convert_to_numpy(device.output_code(ops.cast(loss, "float32")))))
        return np.concatenate([vector, [loss_code]])

    def _grads(self, batch: Any, scale: float) -> list[np.ndarray]:
        grads = _gradients(lambda: _loss(self.model, batch, self.loss_fn) * scale, self.variables)
        self.trace._finished = None
        return [np.asarray(ops.convert_to_numpy(g), "float64") for g in grads if g is not None]

    def reference(self) -> tuple[ActivationTrace, GradientRange | None]:
        """In float32: per layer the largest ``|output|`` over the batches, and the gradients' extent."""
        layers = self.trace.layers
        with _policies(self.model, lambda path: "float32"):
            rows = [self._forward(batch)[2:2 + len(layers)] for batch in self.batches]
            grads = [np.abs(g).ravel() for batch in self.batches for g in self._grads(batch, 1.0)]
        worst = np.max(np.stack(rows), axis=0)
        called = [i for i in range(len(layers)) if worst[i] >= 0]
        trace = ActivationTrace(layers=tuple(layers[i] for i in called), steps=(len(self.batches),),
                                maxima=worst[called][None, :], traced=len(self.batches))
        values = np.concatenate(grads) if grads else np.zeros(0)
        values = values[(values > 0) & np.isfinite(values)]
        if not values.size:
            return trace, None
        return trace, GradientRange(largest=float(values.max()), smallest=float(np.quantile(values, 1e-2)))

    def half(self, keep: Sequence[str], scale: float | None = None) -> tuple[str | None, bool]:
        """In ``mixed_float16`` with ``keep`` (and their sublayers) in float32: ``(forward producer or the
        layer nearest the loss with non-finite gradients, all finite)``; gradients only with ``scale``."""
        kept = {id(layer) for layer in _with_sublayers(self.model, keep)}
        paths = _by_path(self.model)
        with _policies(self.model, lambda path: "float32" if id(paths[path]) in kept else "mixed_float16"):
            for batch in self.batches:
                vector = self._forward(batch)
                if vector[1] >= 0:
                    return self.trace.layers[int(vector[1])], False
                if vector[-1] > 0:  # a non-finite loss with no layer to name: the loss itself
                    return None, False
                if scale is not None and not all(np.isfinite(g).all() for g in self._grads(batch, scale)):
                    return None, False
        return None, True

    def largest_scale(self, keep: Sequence[str]) -> float:
        """The largest power of two (2^0 to 2^24) at which every batch's float16 gradients are finite."""
        return largest_finite_scale(lambda scale: self.half(keep, scale)[1])


def _weights_over(model: Any) -> dict[str, float]:
    """Per layer, its largest weight when above float16's max."""
    over = {}
    for path, layer in traced_layers(model):
        values = [float(np.max(np.abs(ops.convert_to_numpy(w)))) for w in layer._trainable_variables
                  if np.prod(w.shape)] if hasattr(layer, "_trainable_variables") else []
        if values and max(values) > FP16_MAX:
            over[path] = max(values)
    return over


def _code(names: Sequence[str]) -> str:
    return f"keep_keras_layers_in_float32(model, {list(names)!r})"


def audit_keras_precision(model: keras.Model, batches: Iterable[Any],
                    loss_fn: Callable[[keras.Model, Any], Any] | None = None, *,
                    max_rounds: int = 8) -> AuditResult:
    """Can this Keras model train in float16? Which layers must stay float32, which loss scale to start at.

    Runs the sample batches forward and backward in float32, then in ``mixed_float16`` (see the module
    docstring); the weights are not changed and every layer's dtype policy is put back.

    Args:
        model: a built Keras model (any dtype policy).
        batches: a few sample batches, ``(x, y)`` tuples for a compiled model, else what ``loss_fn`` takes.
        loss_fn: ``loss_fn(model, batch)`` returns the loss; default: the compiled loss of ``(x, y)``.
        max_rounds: the most float16 runs spent finding the keep set.

    Returns:
        An :class:`~lossscale_callbacks.forensics._advice.AuditResult`: ``.advice`` (``fits``,
        ``keep_float32``, ``use_bfloat16``, ``initial_scale``, ``growth_interval``, the words),
        ``.markdown()``, ``.to_dict()``.

    Raises:
        ValueError: no batch, or no loss (the model is not compiled and no ``loss_fn`` was given).

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")])
        >>> model.compile(loss="mse")
        >>> x = np.ones((8, 4), "float32")
        >>> result = audit_keras_precision(model, [(x, x[:, :1])])
        >>> result.advice.fits, result.advice.keep_float32
        (True, ())
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches: give at least one sample batch")
    runner = _Runner(model, batches, loss_fn)
    try:
        trace, gradients = runner.reference()
        keep, verified = smallest_keep_set(lambda kept: runner.half(kept)[0], max_rounds)
        verified = verified and runner.half(keep)[1]
        over = {layer: value for layer, value in trace.latest().items()
                if math.isfinite(value) and value > FP16_MAX}
        for layer, value in _weights_over(model).items():
            over[layer] = max(over.get(layer, 0.0), value)
        scale = runner.largest_scale(keep) if verified else None
    finally:
        runner.close()
    advice = advise(over_range=over, producers=dict.fromkeys(keep, 1), keep_float32=keep, gradients=gradients,
                    initial_scale=scale, code=_code)
    return AuditResult(advice=advice, trace=trace, gradients=gradients, batches=len(batches),
                       reference="float32", verified=verified)


def _sample_batches(model: Any, data: str | None, batches: int, batch_size: int, seed: int = 0) -> list[Any]:
    """``(x, y)`` batches from an ``.npz`` file (arrays ``x`` and optionally ``y``, loaded without pickle), or
    standard-normal inputs of the model's input shape when no file is given."""
    if data is not None:
        with np.load(data, allow_pickle=False) as arrays:
            if "x" not in arrays:
                raise ValueError(f"{data}: the sample file needs an array named 'x' (and optionally 'y'); it "
                                 f"has {sorted(arrays.files)}")
            x, y = arrays["x"], arrays["y"] if "y" in arrays else None
        return [(x[i:i + batch_size], None if y is None else y[i:i + batch_size])
                for i in range(0, min(len(x), batches * batch_size), batch_size)]
    rng = np.random.default_rng(seed)
    shapes = [tuple(batch_size if d is None else d for d in t.shape) for t in model.inputs]
    out = []
    for _ in range(batches):
        xs = [rng.standard_normal(shape).astype("float32") for shape in shapes]
        out.append((xs[0] if len(xs) == 1 else xs, None))
    return out


def _file_loss(model: Any, batch: Any) -> Any:
    """The compiled loss when the batch has targets; else the mean square of the outputs (a stand-in that
    still runs every layer's backward pass)."""
    x, y = batch
    prediction = model(x, training=True)
    if y is not None and getattr(model, "compiled", False) and getattr(model, "loss", None) is not None:
        return model.compute_loss(x=x, y=y, y_pred=prediction)
    outputs = keras.tree.flatten(prediction)
    return ops.mean(ops.stack([ops.mean(ops.square(ops.cast(p, "float32"))) for p in outputs]))


def audit_model_file(path: str, *, data: str | None = None, batches: int = 2, batch_size: int = 8,
                     max_unzipped_mib: float = 1024.0) -> AuditResult:
    """Load a ``.keras`` file and audit it: the ``lossscale-callbacks audit`` command.

    The archive is bounded before Keras reads it
    (:func:`~lossscale_callbacks.alignment._check_limits.check_archive`) and loaded with Keras'
    ``safe_mode`` (no lambda deserialised). Sample batches come from ``data`` (an
    ``.npz`` with ``x`` and optionally ``y``) or are standard-normal inputs of the model's input shape;
    without targets the loss is the mean square of the outputs.

    Raises:
        ValueError: the file is not a model, or ``data`` has no ``x``.
        ArchiveTooLargeError: the archive would inflate to more than ``max_unzipped_mib``.
    """
    from lossscale_callbacks.integration import check_archive

    check_archive(path, max_unzipped_mib)
    model = keras.saving.load_model(path, compile=True, safe_mode=True)
    return audit_keras_precision(model, _sample_batches(model, data, batches, batch_size), _file_loss)
