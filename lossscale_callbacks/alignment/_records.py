"""What shape capture hands to the rules engine: executed GEMM-like ops and the layers' model dimensions.

A capture (``lossscale_callbacks.keras._alignment`` or ``lossscale_callbacks.torch._alignment``)
runs one forward and backward pass and records every Tensor Core candidate it executed as an
:class:`OpRecord` (GEMM ``M``/``N``/``K``, or convolution channels per group), attributed to a layer and
a pass. Separately it describes each layer's *model dimensions* (:class:`ModelDim`: in/out features,
head size, vocabulary, RNN hidden size...), so that the engine can tell which model dimension became
which GEMM dimension: a GEMM dimension whose value equals one of the layer's model dimensions (or
the size of a GEMM built from it, such as ``4 * hidden`` for LSTM gates) takes that role; a GEMM
dimension that matches nothing is the token/batch dimension. Everything here is plain data (ints,
strings and the ``str`` enums :class:`OpKind`, :class:`Pass` and :class:`Role`, whose members are their
strings), and nothing here knows a framework: how a finding is fixed in a framework's API is the
:class:`FrameworkAdvice` its capture hands over.

Example:
    >>> fc = LayerInfo("fc", "Linear", dims=(
    ...     ModelDim(Role.FEATURES_IN, 50, lin_params=64), ModelDim("features_out", 64, lin_params=51)))
    >>> op = OpRecord.gemm("addmm", "fc", Pass.FORWARD, "float16", m=32, n=64, k=50)
    >>> [d.value for d in op.dims], op.kind == "gemm", fc.dims[1].role is Role.FEATURES_OUT
    ([32, 64, 50], True, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class _Name(str, Enum):
    """A ``str`` enum whose ``str()`` and format are its value (as ``enum.StrEnum``, Python 3.11+, does):
    members compare equal to, hash like and serialise to JSON as their strings."""

    __str__ = str.__str__
    __format__ = str.__format__


class OpKind(_Name):
    """Kinds of Tensor Core candidates. Everything else (normalisation, activations, pooling, the
    embedding lookup) is memory-bound and never recorded: alignment cannot make it faster."""

    GEMM = "gemm"
    CONV = "conv"


class Pass(_Name):
    """The pass an op runs in. Backward GEMMs are split into input- and weight-gradient by the engine
    (the weight-gradient GEMM is the one whose reduction runs over tokens)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INPUT_GRADIENT = "input-gradient"
    WEIGHT_GRADIENT = "weight-gradient"


class Role(_Name):
    """Semantic roles of model dimensions (a finding's ``dimension``)."""

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


# Effective math dtypes. "tfloat32" is float32 storage multiplied on Tensor Cores (TF32 enabled);
# "float32" is float32 on the CUDA cores (TF32 disabled): no Tensor Cores, no alignment rule.
DTYPES = ("float16", "bfloat16", "tfloat32", "float32", "float64", "int8", "float8")


def _member(enum: type[_Name], name: str, value: object) -> _Name:
    """``value`` as a member of ``enum`` (its string is accepted), or a ``ValueError`` naming ``name``."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in enum]}, got {value!r}") from None


@dataclass(frozen=True)
class GemmDim:
    """One dimension of an executed op.

    Args:
        axis: ``"M"``, ``"N"``, ``"K"`` for a GEMM, ``"C"``/``"K"`` (per group) for a convolution.
        value: the size as executed.
        role: the semantic :class:`Role` when the op's structure already says it (convolution channels,
            attention head size, RNN sizes); ``None`` lets the engine match the value against the
            layer's model dimensions.
        model_value: the model dimension behind ``value`` when they differ (``hidden`` for a GEMM
            of size ``4 * hidden``); ``None`` means ``value``.
    """

    axis: str
    value: int
    role: Role | None = None
    model_value: int | None = None

    def __post_init__(self) -> None:
        if self.role is not None:
            object.__setattr__(self, "role", _member(Role, "role", self.role))


@dataclass(frozen=True)
class OpRecord:
    """One executed Tensor Core candidate.

    Args:
        kind: an :class:`OpKind`.
        op: the framework's op name (``"addmm"``, ``"BatchMatMulV2"``, ``"convolution"``...).
        layer: the layer/module path that executed it (``""`` when outside every layer).
        pass_: a :class:`Pass`: forward or backward (or already split into input/weight gradient).
        dtype: the effective math dtype, one of :data:`DTYPES`.
        dims: the op's dimensions.
        groups: convolution groups.
        depthwise: a depthwise convolution (one input channel per group).
        layout: ``"NHWC"`` or ``"NCHW"`` for convolutions.
        kernel_elems: ``R * S`` (product of the filter's spatial sizes) for convolutions.
        flops: the op's floating-point operations (``2 * M * N * K`` times any batch of GEMMs);
            ``0`` when the capture could not tell (a GEMM's is then computed from its dims).
    """

    kind: OpKind
    op: str
    layer: str
    pass_: Pass
    dtype: str
    dims: tuple[GemmDim, ...]
    groups: int = 1
    depthwise: bool = False
    layout: str | None = None
    kernel_elems: int = 1
    flops: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _member(OpKind, "kind", self.kind))
        object.__setattr__(self, "pass_", _member(Pass, "pass_", self.pass_))

    @classmethod
    def gemm(cls, op: str, layer: str, pass_: Pass, dtype: str, *, m: int, n: int, k: int,
             roles: dict[str, tuple[Role, int | None]] | None = None, batch: int = 1) -> OpRecord:
        """A GEMM ``[M, K] x [K, N]`` (``batch`` of them); ``roles`` maps an axis to ``(role, model_value)``
        when known."""
        roles = roles or {}
        dims = tuple(GemmDim(axis, int(value), *roles.get(axis, (None, None)))
                     for axis, value in (("M", m), ("N", n), ("K", k)))
        return cls(OpKind.GEMM, op, layer, pass_, dtype, dims,
                   flops=2 * int(batch) * int(m) * int(n) * int(k))

    @classmethod
    def conv(cls, op: str, layer: str, pass_: Pass, dtype: str, *, in_channels: int, out_channels: int,
             groups: int, kernel_elems: int, layout: str, output_elems: int = 0) -> OpRecord:
        """A convolution with ``in_channels``/``out_channels`` in total (split into groups here);
        ``output_elems``: the size of its (forward) output, for the FLOP count."""
        groups = max(int(groups), 1)
        depthwise = groups > 1 and groups == in_channels
        dims = (GemmDim("C", in_channels // groups, Role.CHANNELS_IN),
                GemmDim("K", out_channels // groups, Role.CHANNELS_OUT))
        flops = 2 * int(output_elems) * (in_channels // groups) * int(kernel_elems)
        return cls(OpKind.CONV, op, layer, pass_, dtype, dims, groups=groups, depthwise=depthwise,
                   layout=layout, kernel_elems=int(kernel_elems), flops=flops)


@dataclass(frozen=True)
class ModelDim:
    """A model dimension a layer declares, and what changing it costs.

    Args:
        role: a :class:`Role`.
        value: the model dimension (``hidden``, ``in_features``...).
        gemm_values: the GEMM sizes it shows up as; defaults to ``(value,)``. An LSTM's hidden size
            shows up as ``hidden`` and ``4 * hidden``.
        quad_params, lin_params: the layer's parameter count as a function of this dimension is
            ``quad_params * v**2 + lin_params * v + const``; the engine prices the suggested change with it.
        label: where the number comes from, for people (``"weight.shape[1]"``).
    """

    role: Role
    value: int
    gemm_values: tuple[int, ...] = ()
    quad_params: int = 0
    lin_params: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", _member(Role, "role", self.role))

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


@dataclass(frozen=True)
class FrameworkAdvice:
    """How a framework fixes what the engine finds: the one part of a report that knows a framework's API.

    The engine says what is wrong in framework-free words (a 16-bit convolution in NCHW layout, float16
    trainable variables...); the capture of the framework that built the model hands this over with its
    records, and the engine adds it to the findings it applies to. Anything left out gets no advice.

    Args:
        arguments: the constructor argument that sets a convolution's channels, by :class:`Role`
            (torch: ``{"channels_in": "in_channels", "channels_out": "out_channels"}``); it names the
            fix (``out_channels=32``). Other layers' arguments come with their :class:`ModelDim` labels.
        fixes: the short fix of a model-wide finding, by its dimension (``{"layout": "channels_last"}``).
        advice: a sentence added to a message, by a finding's dimension (``"layout"``, ``"dtype"``) or
            an audit result's check (``"variable_dtype"``, ``"float16_softmax"``...).

    Example:
        >>> FrameworkAdvice(advice={"layout": "Use model.to(memory_format=torch.channels_last)."}).sentence(
        ...     "layout")
        ' Use model.to(memory_format=torch.channels_last).'
    """

    arguments: Mapping[str, str] = field(default_factory=dict)
    fixes: Mapping[str, str] = field(default_factory=dict)
    advice: Mapping[str, str] = field(default_factory=dict)

    def sentence(self, key: str) -> str:
        """The advice for ``key``, with a leading space to append to a message (``""`` when none)."""
        text = self.advice.get(key, "")
        return f" {text}" if text else ""


@dataclass
class Capture:
    """Everything one capture recorded: ops, layers, model-wide dimensions (vocabularies).

    ``precision`` holds the mixed-precision audit's inputs (a
    :class:`~lossscale_callbacks.integration.PrecisionInfo`); ``output_layers`` the layers whose output is
    the model's output (a classifier head: its size is the number of classes);
    ``advice`` how the capture's framework fixes a finding (none by default).
    """

    framework: str
    records: list[OpRecord] = field(default_factory=list)
    layers: dict[str, LayerInfo] = field(default_factory=dict)
    global_dims: tuple[ModelDim, ...] = ()
    precision: object | None = None
    output_layers: tuple[str, ...] = ()
    advice: FrameworkAdvice = field(default_factory=FrameworkAdvice)
