"""What shape capture hands to the rules engine: executed GEMM-like ops and the layers' model dimensions.

A capture (``lossscale_callbacks.keras.alignment`` or ``lossscale_callbacks.torch.alignment``)
runs one forward and backward pass and records every Tensor Core candidate it executed as an
:class:`OpRecord` (GEMM ``M``/``N``/``K``, or convolution channels per group), attributed to a layer and
a pass. Separately it describes each layer's *model dimensions* (:class:`ModelDim`: in/out features,
head size, vocabulary, RNN hidden size...), so that the engine can tell which model dimension became
which GEMM dimension: a GEMM dimension whose value equals one of the layer's model dimensions (or
the size of a GEMM built from it, such as ``4 * hidden`` for LSTM gates) takes that role; a GEMM
dimension that matches nothing is the token/batch dimension. Everything here is plain data (ints
and strings), so a capture can be saved as JSON and analysed elsewhere.

Example:
    >>> fc = LayerInfo("fc", "Linear", dims=(
    ...     ModelDim(FEATURES_IN, 50, lin_params=64), ModelDim(FEATURES_OUT, 64, lin_params=51)))
    >>> op = OpRecord.gemm("addmm", "fc", FORWARD, "float16", m=32, n=64, k=50)
    >>> [d.value for d in op.dims]
    [32, 64, 50]
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Kinds of Tensor Core candidates. Everything else (normalisation, activations, pooling, the
# embedding lookup) is memory-bound and never recorded: alignment cannot make it faster.
GEMM = "gemm"
CONV = "conv"

# Passes. Backward GEMMs are split into input- and weight-gradient by the engine (the weight-gradient
# GEMM is the one whose reduction runs over tokens).
FORWARD = "forward"
BACKWARD = "backward"
INPUT_GRADIENT = "input-gradient"
WEIGHT_GRADIENT = "weight-gradient"

# Semantic roles of model dimensions.
FEATURES_IN = "features_in"
FEATURES_OUT = "features_out"
FEATURES = "features"  # a weight axis of a custom layer whose orientation is unknown
CHANNELS_IN = "channels_in"  # per group
CHANNELS_OUT = "channels_out"  # per group
HEAD_DIM = "head_dim"
VOCAB = "vocab"
EMBEDDING_DIM = "embedding_dim"
RNN_HIDDEN = "rnn_hidden"
RNN_INPUT = "rnn_input"
TOKENS = "tokens"
ROLES = (FEATURES_IN, FEATURES_OUT, FEATURES, CHANNELS_IN, CHANNELS_OUT, HEAD_DIM, VOCAB, EMBEDDING_DIM,
         RNN_HIDDEN, RNN_INPUT, TOKENS)

# Effective math dtypes. "tfloat32" is float32 storage multiplied on Tensor Cores (TF32 enabled);
# "float32" is float32 on the CUDA cores (TF32 disabled): no Tensor Cores, no alignment rule.
DTYPES = ("float16", "bfloat16", "tfloat32", "float32", "float64", "int8", "float8")


@dataclass(frozen=True)
class GemmDim:
    """One dimension of an executed op.

    Args:
        axis: ``"M"``, ``"N"``, ``"K"`` for a GEMM, ``"C"``/``"K"`` (per group) for a convolution.
        value: the size as executed.
        role: the semantic role when the op's structure already says it (convolution channels,
            attention head size, RNN sizes); ``None`` lets the engine match the value against the
            layer's model dimensions.
        model_value: the model dimension behind ``value`` when they differ (``hidden`` for a GEMM
            of size ``4 * hidden``); ``None`` means ``value``.
    """

    axis: str
    value: int
    role: str | None = None
    model_value: int | None = None


@dataclass(frozen=True)
class OpRecord:
    """One executed Tensor Core candidate.

    Args:
        kind: :data:`GEMM` or :data:`CONV`.
        op: the framework's op name (``"addmm"``, ``"BatchMatMulV2"``, ``"convolution"``...).
        layer: the layer/module path that executed it (``""`` when outside every layer).
        pass_: :data:`FORWARD` or :data:`BACKWARD` (or already split into input/weight gradient).
        dtype: the effective math dtype, one of :data:`DTYPES`.
        dims: the op's dimensions.
        groups: convolution groups.
        depthwise: a depthwise convolution (one input channel per group).
        layout: ``"NHWC"`` or ``"NCHW"`` for convolutions.
        kernel_elems: ``R * S`` (product of the filter's spatial sizes) for convolutions.
        flops: the op's floating-point operations (``2 * M * N * K`` times any batch of GEMMs);
            ``0`` when the capture could not tell (a GEMM's is then computed from its dims).
    """

    kind: str
    op: str
    layer: str
    pass_: str
    dtype: str
    dims: tuple[GemmDim, ...]
    groups: int = 1
    depthwise: bool = False
    layout: str | None = None
    kernel_elems: int = 1
    flops: int = 0

    @classmethod
    def gemm(cls, op: str, layer: str, pass_: str, dtype: str, *, m: int, n: int, k: int,
             roles: dict[str, tuple[str, int | None]] | None = None, batch: int = 1) -> OpRecord:
        """A GEMM ``[M, K] x [K, N]`` (``batch`` of them); ``roles`` maps an axis to ``(role, model_value)``
        when known."""
        roles = roles or {}
        dims = tuple(GemmDim(axis, int(value), *roles.get(axis, (None, None)))
                     for axis, value in (("M", m), ("N", n), ("K", k)))
        return cls(GEMM, op, layer, pass_, dtype, dims, flops=2 * int(batch) * int(m) * int(n) * int(k))

    @classmethod
    def conv(cls, op: str, layer: str, pass_: str, dtype: str, *, in_channels: int, out_channels: int,
             groups: int, kernel_elems: int, layout: str, output_elems: int = 0) -> OpRecord:
        """A convolution with ``in_channels``/``out_channels`` in total (split into groups here);
        ``output_elems``: the size of its (forward) output, for the FLOP count."""
        groups = max(int(groups), 1)
        depthwise = groups > 1 and groups == in_channels
        dims = (GemmDim("C", in_channels // groups, CHANNELS_IN),
                GemmDim("K", out_channels // groups, CHANNELS_OUT))
        flops = 2 * int(output_elems) * (in_channels // groups) * int(kernel_elems)
        return cls(CONV, op, layer, pass_, dtype, dims, groups=groups, depthwise=depthwise, layout=layout,
                   kernel_elems=int(kernel_elems), flops=flops)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "op": self.op, "layer": self.layer, "pass": self.pass_,
                "dtype": self.dtype,
                "dims": [[d.axis, d.value, d.role, d.model_value] for d in self.dims], "groups": self.groups,
                "depthwise": self.depthwise, "layout": self.layout, "kernel_elems": self.kernel_elems,
                "flops": self.flops}


@dataclass(frozen=True)
class ModelDim:
    """A model dimension a layer declares, and what changing it costs.

    Args:
        role: one of :data:`ROLES`.
        value: the model dimension (``hidden``, ``in_features``...).
        gemm_values: the GEMM sizes it shows up as; defaults to ``(value,)``. An LSTM's hidden size
            shows up as ``hidden`` and ``4 * hidden``.
        quad_params, lin_params: the layer's parameter count as a function of this dimension is
            ``quad_params * v**2 + lin_params * v + const``; the engine prices the suggested change with it.
        label: where the number comes from, for people (``"weight.shape[1]"``).
    """

    role: str
    value: int
    gemm_values: tuple[int, ...] = ()
    quad_params: int = 0
    lin_params: int = 0
    label: str = ""

    def matches(self, gemm_value: int) -> bool:
        return gemm_value in (self.gemm_values or (self.value,))

    def param_cost(self, new_value: int) -> int:
        """Extra parameters when this dimension goes from ``value`` to ``new_value``."""
        v, w = self.value, new_value
        return int(self.quad_params * (w * w - v * v) + self.lin_params * (w - v))


@dataclass(frozen=True)
class LayerInfo:
    """A layer's type and model dimensions.

    Args:
        name: the layer path (as in :attr:`OpRecord.layer`).
        type: the class name.
        dims: the layer's own model dimensions (typed for known layers, weight axes otherwise).
        fallback: weight axes of the layer's sub-layers, matched only when ``dims`` match nothing
            (a custom layer that multiplies by a child's weight directly).
    """

    name: str
    type: str
    dims: tuple[ModelDim, ...] = ()
    fallback: tuple[ModelDim, ...] = ()


@dataclass
class Capture:
    """Everything one capture recorded: ops, layers, model-wide dimensions (vocabularies).

    ``precision`` holds the mixed-precision audit's inputs (see :mod:`.audit`); ``output_layers`` the
    layers whose output is the model's output (a classifier head: its size is the number of classes).
    """

    framework: str
    records: list[OpRecord] = field(default_factory=list)
    layers: dict[str, LayerInfo] = field(default_factory=dict)
    global_dims: tuple[ModelDim, ...] = ()
    precision: object | None = None
    output_layers: tuple[str, ...] = ()
