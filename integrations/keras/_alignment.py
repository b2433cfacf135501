"""Tensor Core alignment check for Keras 3 models (TensorFlow backend): graph shape capture.

:func:`check_alignment` traces one training step (the forward pass, a loss, and the gradients of the
trainable variables under ``tf.GradientTape``) into a ``tf.function`` graph, without running it, and
reads the ops that can run on Tensor Cores: ``MatMul``, ``BatchMatMulV2``/``V3``, ``Einsum``,
``Conv2D``/``Conv3D`` and their backprops, ``DepthwiseConv2dNative`` and its backprops, including the
ones inside ``while`` loop bodies (recurrent layers). The ops' dtypes give the effective precision
(``half`` under a ``mixed_float16`` policy). Ops are attributed to layers through their name scopes
(``functional_1/fc_1/MatMul``; ``gradient_tape/...`` for the backward pass), so a raw ``ops.matmul`` in
a custom layer is found like a ``Dense``.

Because nothing is executed, the check costs one trace and works for GPU-only layer configurations
on a CPU machine. TF32: TensorFlow enables TF32 for float32 by default on Ampere and newer
(``tf.config.experimental.enable_tensor_float_32_execution``); ``tf32=None`` reads that setting.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((50,)), keras.layers.Dense(64, name="fc"),
    ...                           keras.layers.Dense(16, name="out")])
    >>> report = check_alignment(model, batch_size=32, tf32=True)  # float32 model, TF32: multiples of 4
    >>> [(f.layer, f.dimension, f.value, f.severity, f.suggested) for f in report.findings]
    [('fc', 'features_in', 50, 'high', 52)]
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

try:
    import tensorflow as tf
except ImportError as exc:  # a JAX or torch install without TensorFlow
    raise ImportError("the Keras alignment check traces TensorFlow graphs and needs tensorflow, which is not "
                      "installed; the loss scaling itself runs on every Keras backend") from exc

from lossscale_callbacks.alignment import AlignmentReport, analyze
from lossscale_callbacks.integration import (
    DEFAULT_MAX_UNZIPPED_MIB,
    Capture,
    FrameworkAdvice,
    LayerInfo,
    LayerPrecision,
    ModelDim,
    ModelTooDeepError,
    OpPrecision,
    OpRecord,
    Pass,
    PrecisionInfo,
    Role,
    check_archive,
    check_batch_size,
    einsum_gemm,
    get_target,
    matmul_gemm,
    warn_if_nothing_checked,
)

_ONLY_TENSORFLOW = (
    "the Keras alignment check traces TensorFlow graphs and supports KERAS_BACKEND='tensorflow' only. "
    "Loss scaling (LossScaleOptimizer, LossScaleCallback) runs on every backend; to check alignment, "
    "build the same model under the TensorFlow backend (for example `KERAS_BACKEND=tensorflow "
    "lossscale-callbacks check your_model.py`), or, on the torch backend, call "
    "lossscale_callbacks.torch._alignment.check_alignment(model, sample, dtype='float16'), which sees the "
    "GEMMs but not the Keras layer that owns each one"
)


__all__ = ["capture", "check_alignment", "check_model_file"]

_LOSS_SCOPE = "lossscale_check_loss"
_MATMULS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"}
_CONVS = {"Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2",
          "Conv3DBackpropFilterV2"}
_DEPTHWISE = {"DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
              "DepthwiseConv2dNativeBackpropFilter"}
_TRANSPOSED_CONVS = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)
_FUNC_ATTRS = ("body", "cond", "then_branch", "else_branch", "f", "branches")
_NORM_TYPES = (keras.layers.BatchNormalization, keras.layers.LayerNormalization,
               keras.layers.GroupNormalization)
_LAST_LAYER_FLOAT32 = 'Give the last layer dtype="float32".'
# How Keras fixes what the framework-free engine finds.
_ADVICE = FrameworkAdvice(
    arguments={Role.CHANNELS_OUT: "filters"},
    fixes={"layout": 'data_format="channels_last"'},
    advice={
        "layout": 'Build the convolutions with data_format="channels_last" (Keras\' default).',
        "dtype": 'Build the model under keras.config.set_dtype_policy("mixed_float16") (or '
                 '"mixed_bfloat16"), as you train it, or enable TF32 '
                 "(tf.config.experimental.enable_tensor_float_32_execution(True)).",
        "global_policy": 'Use keras.config.set_dtype_policy("mixed_float16").',
        "variable_dtype": 'Use the "mixed_float16" dtype policy instead of float16 layers.',
        "float16_normalization": 'A "mixed_float16" dtype policy keeps normalisation in float32.',
        "float16_softmax": _LAST_LAYER_FLOAT32,
        "float16_output": _LAST_LAYER_FLOAT32,
        "float16_loss": _LAST_LAYER_FLOAT32,
    })


def _dtype_name(dtype: tf.DType, tf32: bool) -> str:
    name = {"half": "float16"}.get(dtype.name, dtype.name)
    if name == "float32" and tf32:
        return "tfloat32"
    if name in ("int8", "uint8"):
        return "int8"
    if "float8" in name:
        return "float8"
    return name


# ---- layers -----------------------------------------------------------------------------------------


def _children(layer) -> list:
    if isinstance(layer, keras.layers.RNN):
        return []  # the cell's ops are the RNN's ops
    return [c for c in getattr(layer, "_layers", []) if not isinstance(c, keras.layers.InputLayer)]


def _walk_layers(layer, path: str = ""):
    for child in _children(layer):
        child_path = f"{path}/{child.name}" if path else child.name
        yield child_path, child
        yield from _walk_layers(child, child_path)


def _own_variables(layer) -> list:
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def _generic_dims(layer) -> tuple[ModelDim, ...]:
    dims = []
    for var in _own_variables(layer):
        shape = tuple(int(s) for s in var.shape)
        if len(shape) < 2:
            continue
        for axis, size in enumerate(shape):
            dims.append(ModelDim(Role.FEATURES, size, lin_params=math.prod(shape) // max(size, 1),
                                 label=f"{var.name}.shape[{axis}]"))
    return tuple(dims)


def _typed_dims(layer) -> tuple[ModelDim, ...] | None:
    if isinstance(layer, keras.layers.Dense):
        n_in, n_out = (int(s) for s in layer.kernel.shape)
        bias = 1 if layer.use_bias else 0
        return (ModelDim(Role.FEATURES_IN, n_in, lin_params=n_out, label="kernel.shape[0]"),
                ModelDim(Role.FEATURES_OUT, n_out, lin_params=n_in + bias, label="units"))
    if isinstance(layer, keras.layers.EinsumDense):
        lhs, out = layer.equation.split("->")
        x_labels, k_labels = lhs.split(",")
        sizes = dict(zip(k_labels, (int(s) for s in layer.kernel.shape), strict=True))
        k_in = math.prod(sizes[c] for c in k_labels if c in x_labels and c not in out)
        k_out = math.prod(sizes[c] for c in k_labels if c in out and c not in x_labels)
        return (ModelDim(Role.FEATURES_IN, k_in, lin_params=k_out, label="kernel (contracted axes)"),
                ModelDim(Role.FEATURES_OUT, k_out, lin_params=k_in, label="kernel (output axes)"))
    if isinstance(layer, keras.layers.Embedding):
        vocab, width = layer.input_dim, layer.output_dim
        return (ModelDim(Role.VOCAB, vocab, lin_params=width, label="input_dim"),
                ModelDim(Role.EMBEDDING_DIM, width, lin_params=vocab, label="output_dim"))
    if isinstance(layer, keras.layers.MultiHeadAttention):
        heads, key_dim = layer.num_heads, layer.key_dim
        value_dim = layer.value_dim or key_dim
        embed = int(layer.query_dense.kernel.shape[0]) if layer.query_dense.built else 0
        dims = [ModelDim(Role.HEAD_DIM, key_dim, lin_params=2 * heads * (embed + 1), label="key_dim")]
        if value_dim != key_dim:
            dims.append(ModelDim(Role.HEAD_DIM, value_dim, lin_params=2 * heads * embed + heads,
                                 label="value_dim"))
        else:
            dims[0] = ModelDim(Role.HEAD_DIM, key_dim, lin_params=4 * heads * embed + 3 * heads,
                               label="key_dim")
        return tuple(dims)
    if isinstance(layer, keras.layers.RNN):
        # StackedRNNCells holds one cell per layer; a cell without units/kernel (a custom cell) is
        # described by its weight axes. The input of an upper cell is the hidden size of the one
        # below (as in a torch RNN with num_layers > 1): only the first cell has an rnn_input.
        dims: list[ModelDim] = []
        for index, cell in enumerate(getattr(layer.cell, "cells", None) or [layer.cell]):
            dims.extend(d for d in _rnn_cell_dims(cell) if index == 0 or d.role != Role.RNN_INPUT)
        return tuple(dims)
    if isinstance(layer, keras.layers.Layer) and "conv" in type(layer).__name__.lower():
        return ()  # convolutions carry their channels in the op itself
    return None


def _rnn_cell_dims(cell) -> tuple[ModelDim, ...]:
    kernel = getattr(cell, "kernel", None)
    units = getattr(cell, "units", None)
    if kernel is None or not isinstance(units, int) or len(kernel.shape) != 2:
        return _generic_dims(cell)
    n_in, gated = (int(s) for s in kernel.shape)
    gates = gated // units
    bias = int(np.prod(cell.bias.shape)) // units if getattr(cell, "bias", None) is not None else 0
    return (ModelDim(Role.RNN_HIDDEN, units, gemm_values=(units, gated), quad_params=gates,
                     lin_params=gates * n_in + bias, label="units"),
            ModelDim(Role.RNN_INPUT, n_in, lin_params=gated, label="input size"))


def _layer_infos(model) -> tuple[dict[str, LayerInfo], tuple[ModelDim, ...]]:
    items = [("", model), *_walk_layers(model)]
    own, global_dims = {}, []
    for path, layer in items:
        typed = _typed_dims(layer)
        own[path] = typed if typed is not None else _generic_dims(layer)
        if isinstance(layer, keras.layers.Embedding):
            global_dims.extend(own[path])
    infos = {}
    for path, layer in items:
        prefix = f"{path}/" if path else ""
        fallback = tuple(d for sub, _ in items if sub != path and sub.startswith(prefix) for d in own[sub])
        infos[path] = LayerInfo(path, type(layer).__name__, own[path], fallback)
    return infos, tuple(global_dims)


# ---- graph --------------------------------------------------------------------------------------------


# Every layer's call runs inside a name scope of its own while the step is traced: ``lsc_layer_<i>``
# (``lsc_layer_<i>_<n>`` when TensorFlow makes a repeated scope unique, as for a shared layer).
# Attribution reads that token, never the layer names: Keras' default names (``dense``, ``dense_1``)
# are the very names TensorFlow gives to repeated scopes, so matching names picks the wrong layer.
_TOKEN = "lsc_layer_"
_ABSENT = object()
_TOKEN_RE = re.compile(re.escape(_TOKEN) + r"(\d+)(?:_\d+)?")


@contextlib.contextmanager
def _layer_scopes(model):
    """Wrap each layer's ``call`` (on the instance, undone on exit) in its identity token's name scope;
    yields ``{token index: layer path}``. A layer reached twice (shared) keeps its first path."""
    paths: dict[int, str] = {}
    wrapped: list = []
    seen: set[int] = set()
    try:
        for path, layer in _walk_layers(model):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            index = len(paths)
            paths[index] = path
            original = layer.call

            def call(*args, __original=original, __scope=f"{_TOKEN}{index}", **kwargs):
                with tf.name_scope(__scope):
                    return __original(*args, **kwargs)

            functools.update_wrapper(call, original)
            # A layer may carry its own instance-level ``call``: it is put back as it was.
            wrapped.append((layer, layer.__dict__.get("call", _ABSENT)))
            object.__setattr__(layer, "call", call)
        yield paths
    finally:
        for layer, previous in wrapped:
            if previous is _ABSENT:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)


def _attribute(op_name: str, paths: dict[int, str]) -> tuple[str, str, bool]:
    """``(layer path, pass, in loss scope)`` from a graph op name: the innermost layer token in it."""
    parts = op_name.split("/")
    backward = parts[0] == "gradient_tape" or "gradients" in parts
    if "gradients" in parts:
        parts = parts[len(parts) - parts[::-1].index("gradients"):]
    elif parts[0] == "gradient_tape":
        parts = parts[1:]
    in_loss = bool(parts) and parts[0].startswith(_LOSS_SCOPE)
    path = ""
    for comp in parts[:-1]:
        match = _TOKEN_RE.fullmatch(comp)
        if match is not None:
            path = paths.get(int(match.group(1)), path)
    return path, (Pass.BACKWARD if backward else Pass.FORWARD), in_loss


def _walk_ops(graph):
    """Every op of the graph and of the functions it calls (loop bodies, branches, nested tf.functions),
    with the ops that called the function, outermost first (``()`` at top level)."""
    seen: set[str] = set()
    pending = [(graph, ())]
    while pending:
        g, context = pending.pop()
        for op in g.get_operations():
            yield op, context
            for attr in _FUNC_ATTRS:
                try:
                    value = op.get_attr(attr)
                except (ValueError, TypeError):
                    continue
                for fn in value if isinstance(value, list) else [value]:
                    name = getattr(fn, "name", None)
                    if not name or name in seen:
                        continue
                    seen.add(name)
                    found = g._get_function(name) or graph._get_function(name)
                    if found is not None:
                        pending.append((found.graph, (*context, op)))


def _shape(tensor) -> tuple | None:
    shape = tensor.shape
    if shape.rank is None:
        return None
    return tuple(shape.as_list())


def _record(op, layer: str, pass_: str, tf32: bool, transposed: bool = False) -> list[OpRecord]:
    """The Tensor Core candidates of one graph op (none for other ops).

    ``transposed``: the op belongs to a transposed convolution layer, whose forward pass is a
    ``Conv2DBackpropInput`` and whose input gradient is a ``Conv2D``: every one of its ops sees the
    layer's channels the other way round, so they are swapped back to the layer's (and torch's) view.
    """
    kind = op.type
    if kind in _MATMULS or kind == "Einsum":
        dtype = _dtype_name(op.get_attr("T"), tf32)
        a, b = _shape(op.inputs[0]), _shape(op.inputs[1]) if len(op.inputs) > 1 else None
        if a is None or b is None:
            return []
        if kind == "Einsum":
            gemm = einsum_gemm(op.get_attr("equation").decode(), a, b)
        elif kind == "MatMul":
            gemm = matmul_gemm(a, b, op.get_attr("transpose_a"), op.get_attr("transpose_b"))
        else:
            gemm = matmul_gemm(a, b, op.get_attr("adj_x"), op.get_attr("adj_y"))
        if gemm is None or min(gemm[1:]) <= 1:
            return []  # a GEMV/outer product is memory-bound
        _, m, n, k = gemm
        out = _shape(op.outputs[0])
        batch = math.prod(out) // (m * n) if out is not None and None not in out and m * n else 1
        return [OpRecord.gemm(kind, layer, pass_, dtype, m=m, n=n, k=k, batch=max(batch, 1))]
    if kind in _CONVS or kind in _DEPTHWISE:
        dtype = _dtype_name(op.get_attr("T"), tf32)
        fmt = op.get_attr("data_format").decode()
        # A backprop op in the forward pass is a transposed convolution (Conv2DTranspose). The
        # convolution's own output (for the FLOP count) is the backprops' out_backprop input.
        conv_out = _shape(op.inputs[2]) if "Backprop" in kind else _shape(op.outputs[0])
        if "BackpropInput" in kind:
            inp, filt = _shape(op.outputs[0]), _shape(op.inputs[1])
            pass_ = Pass.INPUT_GRADIENT if pass_ == Pass.BACKWARD else pass_
        elif "BackpropFilter" in kind:
            inp, filt = _shape(op.inputs[0]), _shape(op.outputs[0])
            pass_ = Pass.WEIGHT_GRADIENT if pass_ == Pass.BACKWARD else pass_
        else:
            inp, filt = _shape(op.inputs[0]), _shape(op.inputs[1])
        if inp is None or filt is None or None in filt:
            return []
        channels = inp[1] if fmt.startswith("NC") else inp[-1]
        spatial = math.prod(filt[:-2])
        layout = "NCHW" if fmt.startswith("NC") else "NHWC"
        if kind in _DEPTHWISE:
            return [OpRecord.conv(kind, layer, pass_, dtype, in_channels=channels,
                                  out_channels=channels * filt[-1], groups=channels, kernel_elems=spatial,
                                  layout=layout, output_elems=_elems(conv_out))]
        groups = max(channels // filt[-2], 1) if channels else 1
        in_channels, out_channels = channels, filt[-1]
        if transposed:
            in_channels, out_channels = out_channels * groups, in_channels // groups
        if transposed:  # the layer's output is the op's input side: count the work at the larger end
            conv_out = inp
        return [OpRecord.conv(kind, layer, pass_, dtype, in_channels=in_channels, out_channels=out_channels,
                              groups=groups, kernel_elems=spatial, layout=layout,
                              output_elems=_elems(conv_out))]
    return []


def _elems(shape: tuple | None) -> int:
    return 0 if shape is None or None in shape else math.prod(shape)


def _op_dtype(op) -> str | None:
    try:
        dtype = op.get_attr("T")
        if isinstance(dtype, tf.DType):
            return _dtype_name(dtype, False)
    except (ValueError, TypeError):
        pass
    for out in op.outputs:
        if out.dtype.is_floating:
            return _dtype_name(out.dtype, False)
    return None


# ---- sample and tracing ------------------------------------------------------------------------------


def _input_specs(model, batch_size: int):
    """``tf.TensorSpec`` s of the model's inputs at ``batch_size``: shapes only, no array is allocated
    (a batch of a billion costs what a batch of eight does)."""
    inputs = getattr(model, "_inputs_struct", None)
    if inputs is None:
        inputs = getattr(model, "inputs", None)
    if isinstance(inputs, (list, tuple)) and len(inputs) == 1:
        inputs = inputs[0]
    if inputs is None or (isinstance(inputs, (list, tuple)) and not inputs):
        raise ValueError("sample is required for a model without symbolic inputs (build it with keras.Input, "
                         "or pass a sample batch)")

    def spec(tensor):
        shape = tuple(tensor.shape)[1:]
        if any(s is None for s in shape):
            raise ValueError(f"input {tensor.name!r} has an unknown size in {tensor.shape}; "
                             "pass a sample batch")
        return tf.TensorSpec((batch_size, *shape), tf.as_dtype(tensor.dtype))

    return keras.tree.map_structure(spec, inputs)


def _spec(array) -> tf.TensorSpec:
    """The TensorSpec of one input: only shapes and dtypes are traced, nothing is executed."""
    if isinstance(array, tf.TensorSpec):
        return array
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        array = np.asarray(array)
        dtype = array.dtype
    return tf.TensorSpec(tuple(array.shape), tf.as_dtype(dtype))


def capture(model, sample: Any = None, *, batch_size: int = 8, tf32: bool | None = None,
            loss: Callable[[Any], Any] | None = None, training: bool = True) -> Capture:
    """Trace one training step of ``model`` and return what it would execute (see :func:`check_alignment`)."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a keras.Model, got {type(model).__name__}")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"{_ONLY_TENSORFLOW} (this process runs {keras.backend.backend()!r})")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if sample is None:
        sample = _input_specs(model, batch_size)
    if tf32 is None:
        tf32 = bool(tf.config.experimental.tensor_float_32_execution_enabled())
    specs = tf.nest.map_structure(_spec, sample)
    output_names: list[str] = []

    def step(x):
        with tf.GradientTape() as tape:
            y = model(x, training=training)
            output_names.extend(t.name for t in tf.nest.flatten(y))
            with tf.name_scope(_LOSS_SCOPE):
                value = loss(y) if loss is not None else tf.add_n(
                    [tf.reduce_sum(tf.cast(t, "float32")) for t in tf.nest.flatten(y)])
        return tape.gradient(value, model.trainable_variables)

    traced = tf.function(step, autograph=False)
    with _layer_scopes(model) as paths:
        graph = traced.get_concrete_function(specs).graph
    layers, global_dims = _layer_infos(model)
    transposed = {path for path, layer in _walk_layers(model) if isinstance(layer, _TRANSPOSED_CONVS)}
    records: list[OpRecord] = []
    ops: list[OpPrecision] = []
    outputs = set(output_names)
    for op, callers in _walk_ops(graph):
        layer, pass_, in_loss = _attribute(op.name, paths)
        for caller in reversed(callers):
            # Ops of a nested function (Keras' grouped convolution, its gradient) may carry no layer
            # scope of their own: the calling op, or the ops feeding it, have it.
            outer_layer, outer_pass, outer_loss = _attribute(caller.name, paths)
            if not outer_layer:
                outer_layer = next((lay for lay in (_attribute(t.op.name, paths)[0] for t in caller.inputs)
                                    if lay), "")
            layer = layer or outer_layer
            pass_ = Pass.BACKWARD if Pass.BACKWARD in (pass_, outer_pass) else Pass.FORWARD
            in_loss = in_loss or outer_loss
        if in_loss and loss is None:
            continue  # our own stand-in loss is not part of the model
        records.extend(_record(op, layer, pass_, tf32, transposed=layer in transposed))
        dtype = _op_dtype(op)
        if dtype is not None and op.type not in ("Placeholder", "Const", "ReadVariableOp", "NoOp"):
            is_output = any(out.name in outputs for out in op.outputs)
            ops.append(OpPrecision(op.type, dtype, layer, pass_, in_loss=in_loss, is_output=is_output))
    precision = PrecisionInfo("tensorflow", keras.config.dtype_policy().name, _layer_precisions(model), ops)
    outputs_of = {p.layer for p in precision.layers if p.is_output}
    return Capture("keras", records, layers, global_dims, precision, output_layers=tuple(sorted(outputs_of)),
                   advice=_ADVICE)


def _layer_precisions(model) -> list[LayerPrecision]:
    output_layers = set()
    for tensor in getattr(model, "outputs", None) or []:
        history = getattr(tensor, "_keras_history", None)
        if history is not None:
            output_layers.add(id(history.operation))
    result = []
    for path, layer in _walk_layers(model):
        activation = getattr(layer, "activation", None)
        act_name = getattr(activation, "__name__", None) if activation is not None else None
        if isinstance(layer, keras.layers.Softmax):
            act_name = "softmax"
        result.append(LayerPrecision(
            path, type(layer).__name__, str(layer.compute_dtype),
            tuple(sorted({str(v.dtype) for v in _own_variables(layer)})),
            is_output=id(layer) in output_layers, activation=act_name,
            kind="normalization" if isinstance(layer, _NORM_TYPES) else None))
    return result


def _model_policy(model) -> str:
    """The dtype policy most of the model's weighted layers use (a loaded model keeps its own)."""
    names = [getattr(getattr(layer, "dtype_policy", None), "name", None)
             for _, layer in _walk_layers(model) if layer.weights]
    names = [n for n in names if n]
    return max(set(names), key=names.count) if names else keras.config.dtype_policy().name


def check_alignment(model, sample: Any = None, *, batch_size: int = 8, target: str | None = None,
                    tf32: bool | None = None, loss: Callable[[Any], Any] | None = None) -> AlignmentReport:
    """Check a Keras model's GEMMs/convolutions against the Tensor Core rules, and audit its precision.

    The precision is the model's own: build it under ``keras.config.set_dtype_policy("mixed_float16")``
    (or give layers a ``dtype``) as you train it.

    Args:
        model: a built ``keras.Model``.
        sample: one batch of inputs (arrays or tensors; a list or dict of them for several inputs);
            ``None`` builds zeros of the model's input shapes with ``batch_size``.
        batch_size: the batch size of the zero sample (use your training batch size: it is a GEMM dimension).
        target: ``None`` or a GPU name (``"a100"``, ``"h100"``, ``"v100"``...) for its recommendations.
        tf32: whether float32 runs as TF32; ``None`` reads TensorFlow's setting (on by default).
        loss: ``loss(y_pred) -> scalar`` traced as part of the step (and audited); ``None`` uses a
            float32 sum of the outputs.

    Returns:
        An :class:`~lossscale_callbacks.alignment.AlignmentReport`.
    """
    return _check(model, sample, batch_size, target, tf32, loss, _silent)[0]


def _silent(_: str) -> None:
    pass


def _check(model, sample: Any, batch_size: int, target: str | None, tf32: bool | None,
           loss: Callable[[Any], Any] | None, say: Callable[[str], None]) -> tuple[AlignmentReport, dict]:
    """:func:`check_alignment`, saying each stage to ``say``; also returns the seconds of each stage."""
    get_target(target)
    if tf32 is None and keras.backend.backend() == "tensorflow":
        tf32 = bool(tf.config.experimental.tensor_float_32_execution_enabled())
    start = time.perf_counter()
    cap = capture(model, sample, batch_size=batch_size, tf32=tf32, loss=loss)
    traced = time.perf_counter()
    say(f"traced one training step in {traced - start:.1f} s ({len(cap.records)} GEMM/convolution ops); "
        "applying the rules")
    report = analyze(cap, target=target)
    seconds = {"capture": round(traced - start, 3), "rules": round(time.perf_counter() - traced, 3)}
    say(f"rules applied in {seconds['rules']:.1f} s")
    first = tf.nest.flatten(sample)[0] if sample is not None else None
    batch = int(first.shape[0]) if first is not None and first.shape and first.shape[0] else batch_size
    report.context = {"model": model.name, "framework": "keras", "parameters": int(model.count_params()),
                      "precision": _model_policy(model), "batch_size": batch, "tf32": tf32}
    return warn_if_nothing_checked(report, "build the model under keras.config.set_dtype_policy("
                                   "'mixed_float16') (or 'mixed_bfloat16'), as you train it"), seconds


def check_model_file(path: str, *, batch_size: int = 8, target: str | None = None, tf32: bool | None = None,
                     max_unzipped_mib: float = DEFAULT_MAX_UNZIPPED_MIB,
                     progress: Callable[[str], None] | None = None) -> AlignmentReport:
    """Load a ``.keras`` file (without compiling) and check it: the ``lossscale-callbacks check`` command.

    The file is looked at before Keras loads it (see :mod:`lossscale_callbacks.alignment._check_limits`): an
    archive that would inflate to more than ``max_unzipped_mib`` MiB is refused, and so is a batch
    size TensorFlow cannot trace. A model nested deeper than Python's recursion limit allows is a
    :class:`~lossscale_callbacks.alignment._check_limits.ModelTooDeepError`; run the check through
    :func:`~lossscale_callbacks.alignment._check_limits.run_deep` (as the command does) for a higher limit.
    ``progress`` is called with a line as each stage (load, trace, rules) starts and ends; the seconds
    of each go into the report's ``context["seconds"]``.

    Raises:
        ValueError: ``batch_size`` out of range.
        ArchiveTooLargeError: the archive would inflate to more than the limit, or than it declares.
        ModelTooDeepError: the model needs more Python frames than the recursion limit.
    """
    check_batch_size(batch_size)
    check_archive(path, max_unzipped_mib)
    say = progress or _silent
    try:
        start = time.perf_counter()
        say(f"loading {os.path.basename(path)} with Keras (its own load; the longest stage for a big model)")
        model = keras.saving.load_model(path, compile=False)
        loaded = time.perf_counter() - start
        say(f"loaded {sum(1 for _ in _walk_layers(model))} layers in {loaded:.1f} s; tracing one training "
            f"step at batch size {batch_size}")
        report, seconds = _check(model, None, batch_size, target, tf32, None, say)
    except RecursionError as exc:
        limit = sys.getrecursionlimit()
        raise ModelTooDeepError(f"{path}: loading and tracing the model needs more than Python's recursion "
                                f"limit of {limit} frames", limit) from exc
    report.context["seconds"] = {"load": round(loaded, 3), **seconds}
    return report
