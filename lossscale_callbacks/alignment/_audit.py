"""Mixed-precision audit: per-layer compute/variable dtypes and op categories, framework-free.

What it flags (NVIDIA's mixed-precision training guide and the Keras mixed-precision guide: keep
float32 master weights, do reductions, softmax, normalisation statistics and the loss in float32):

* a global ``"float16"`` policy where a mixed one was meant (variables stored in float16) - ``high``;
* trainable variables that are not float32 (a model cast to float16) - ``high``;
* a softmax (or sigmoid) output layer computed in float16 - ``high``; other float16 model outputs -
  ``medium``;
* normalisation layers that keep float16 parameters/statistics - ``high``;
* loss ops (log, exp, softmax, cross-entropy) in float16 - ``high``; other deny-list ops (softmax, log,
  exp, pow) executed in float16 inside a layer's forward pass - ``low``.

Ops are grouped into the categories of TensorFlow's automatic mixed precision graph rewrite
(``AutoMixedPrecisionLists``; the seed calls the infer list "GrayList"): *allow* (always float16, e.g.
Conv2D, MatMul), *deny* (numerically unsafe in float16, e.g. Softmax, Exp, Log, Sum), *infer* (float16
unless downstream of a deny op, e.g. Add, BiasAdd, AvgPool), *clear* (no numerical effect, e.g. Relu,
Reshape, MaxPool). PyTorch ops are mapped onto the same categories (autocast's lists are analogous).

The messages say what is wrong in framework-free words; the capture's
:class:`~lossscale_callbacks.alignment._records.FrameworkAdvice` adds how to fix it in the model's framework,
keyed by the check's name.

Example:
    >>> info = PrecisionInfo("keras", global_policy="float16", layers=[
    ...     LayerPrecision("out", "Dense", "float16", ("float16",), is_output=True, activation="softmax")])
    >>> findings, _ = run_audit(info)
    >>> [(f.check, f.layer, f.severity) for f in findings]
    [('global_policy', '*', 'high'), ('variable_dtype', 'out', 'high'), ('float16_softmax', 'out', 'high')]
    >>> categorize("Conv2DBackpropFilter"), categorize("Softmax"), categorize("BiasAdd"), categorize("Relu")
    ('allow', 'deny', 'infer', 'clear')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lossscale_callbacks.alignment._records import FrameworkAdvice, Pass
from lossscale_callbacks.alignment._report import AuditFinding, worst_first

ALLOW, DENY, INFER, CLEAR, OTHER = "allow", "deny", "infer", "clear", "other"
CATEGORIES = (ALLOW, DENY, INFER, CLEAR, OTHER)

_TF_LISTS = {
    ALLOW: """BlockLSTM BlockLSTMV2 BlockLSTMGrad BlockLSTMGradV2 Conv2D Conv2DBackpropFilter
        Conv2DBackpropInput
        Conv3D Conv3DBackpropFilter Conv3DBackpropFilterV2 Conv3DBackpropInput Conv3DBackpropInputV2 CudnnRNN
        CudnnRNNBackprop CudnnRNNBackpropV2 CudnnRNNBackpropV3 CudnnRNNV2 CudnnRNNV3 Einsum
        FusedConv2DBiasActivation GRUBlockCell GRUBlockCellGrad LSTMBlockCell LSTMBlockCellGrad MatMul
        BatchMatMul BatchMatMulV2 BatchMatMulV3 DepthwiseConv2dNative DepthwiseConv2dNativeBackpropFilter
        DepthwiseConv2dNativeBackpropInput _FusedMatMul _FusedConv2D""",
    DENY: """Exp Expm1 L2Loss Mean Pow SaveV2 Softmax SoftmaxCrossEntropyWithLogits
        SparseSoftmaxCrossEntropyWithLogits Sum Log Log1p LogSoftmax Prod""",
    INFER: """Add AddN AddV2 AvgPool AvgPool3D AvgPool3DGrad AvgPoolGrad BiasAdd BiasAddGrad BiasAddV1 Elu
        EluGrad Erf Erfc FloorDiv FusedBatchNormV2 FusedBatchNormGradV2 FusedBatchNormV3 FusedBatchNormGradV3
        _FusedBatchNormEx Inv LeakyRelu LeakyReluGrad Mul RealDiv Reciprocal Selu SeluGrad Sigmoid SigmoidGrad
        Softplus SoftplusGrad Sqrt SqrtGrad Rsqrt RsqrtGrad Square SquaredDifference Sub Tanh TanhGrad
        DivNoNan MulNoNan Gelu""",
    CLEAR: """Abs ArgMax ArgMin BatchToSpace BatchToSpaceND BroadcastTo Ceil CheckNumerics ClipByValue Concat
        ConcatV2 DepthToSpace DynamicPartition DynamicStitch Enter EnsureShape Equal Exit ExpandDims
        Fill Floor
        Gather GatherNd GatherV2 Greater GreaterEqual Identity IdentityN IsFinite IsNan Less LessEqual Max
        MaxPool MaxPool3D MaxPool3DGrad MaxPoolGrad MaxPoolGradGrad MaxPoolGradV2 MaxPoolV2 Maximum Merge Min
        Minimum MirrorPad MirrorPadGrad Neg NextIteration NotEqual OnesLike Pack Pad PadV2
        PreventGradient Rank
        Relu Relu6 Relu6Grad ReluGrad Reshape ResizeNearestNeighbor ResizeNearestNeighborGrad Reverse
        ReverseSequence ReverseV2 Round Select SelectV2 Shape ShapeN Sign Size Slice Snapshot SpaceToBatch
        SpaceToBatchND SpaceToDepth Split SplitV Squeeze StopGradient StridedSlice StridedSliceGrad
        Switch Tile
        TopK TopKV2 Transpose Where ZerosLike ResourceGather Cast""",
}

_TORCH_LISTS = {
    ALLOW: """mm addmm bmm baddbmm addbmm matmul linear convolution convolution_backward _addmm_activation
        _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention lstm gru rnn_tanh rnn_relu
        _cudnn_rnn prelu _scaled_mm""",
    DENY: """_softmax _log_softmax exp expm1 log log1p log2 log10 pow sum mean prod nll_loss nll_loss_forward
        nll_loss2d_forward mse_loss binary_cross_entropy binary_cross_entropy_with_logits cross_entropy_loss
        kl_div smooth_l1_loss huber_loss l1_loss norm linalg_vector_norm cumsum cumprod softplus
        _softmax_backward_data _log_softmax_backward_data""",
    INFER: """add sub mul div rsub addcmul addcdiv sigmoid tanh gelu silu elu leaky_relu hardswish mish
        native_layer_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training
        native_group_norm rsqrt sqrt reciprocal avg_pool2d avg_pool1d adaptive_avg_pool2d sigmoid_backward
        tanh_backward gelu_backward silu_backward native_layer_norm_backward native_batch_norm_backward
        native_group_norm_backward _fused_rms_norm erf""",
    CLEAR: """relu threshold_backward view _unsafe_view reshape t transpose permute expand clone _to_copy
        max_pool2d_with_indices max_pool2d_with_indices_backward cat stack slice select squeeze unsqueeze
        embedding embedding_dense_backward detach copy_ zeros_like ones_like fill_ where abs neg max min
        amax amin argmax argmin split split_with_sizes unbind flatten contiguous alias empty_like new_zeros
        new_empty zero_ index_select gather scatter masked_fill clamp hardtanh relu6 narrow as_strided
        select_backward slice_backward expand_copy lift_fresh _reshape_alias sign sort topk""",
}

TF_OP_CATEGORIES: dict[str, str] = {op: cat for cat, ops in _TF_LISTS.items() for op in ops.split()}
TORCH_OP_CATEGORIES: dict[str, str] = {op: cat for cat, ops in _TORCH_LISTS.items() for op in ops.split()}

# The deny-list ops whose float16 execution loses accuracy in practice (exp/log overflow, softmax sums).
# Float16 reductions (Mean, Sum) are left alone: frameworks accumulate them in float32 and a correct
# mixed_float16 model (pooling, bias gradients) runs them in float16 on purpose.
_HURTING = {"Softmax", "LogSoftmax", "Exp", "Expm1", "Log", "Log1p", "Pow", "SoftmaxCrossEntropyWithLogits",
            "SparseSoftmaxCrossEntropyWithLogits", "L2Loss", "_softmax", "_log_softmax", "exp", "expm1",
            "log", "log1p", "pow", "nll_loss_forward", "mse_loss", "binary_cross_entropy",
            "binary_cross_entropy_with_logits", "kl_div"}
_SOFTMAX_OPS = {"Softmax", "LogSoftmax", "_softmax", "_log_softmax"}
_SOFTMAX_ACTIVATIONS = {"softmax", "log_softmax", "sigmoid"}
_HALF = ("float16", "bfloat16")


def categorize(op: str, framework: str = "tensorflow") -> str:
    """The mixed-precision category of a TensorFlow op type (an aten op name with ``framework="torch"``)."""
    table = TORCH_OP_CATEGORIES if framework == "torch" else TF_OP_CATEGORIES
    return table.get(op, OTHER)


@dataclass(frozen=True)
class LayerPrecision:
    """One layer's precision as configured.

    Args:
        layer: the layer path. type: class name.
        compute_dtype: the dtype its outputs are computed in.
        variable_dtypes: dtypes of its own trainable variables.
        is_output: whether it produces a model output.
        activation: ``"softmax"``/``"sigmoid"``/... when the layer applies one.
        kind: ``"normalization"`` for normalisation layers, else ``None``.
    """

    layer: str
    type: str
    compute_dtype: str
    variable_dtypes: tuple[str, ...] = ()
    is_output: bool = False
    activation: str | None = None
    kind: str | None = None


@dataclass(frozen=True)
class OpPrecision:
    """One executed op: type, dtype, layer, pass, and whether it is part of the loss / produces an output."""

    op: str
    dtype: str
    layer: str
    pass_: Pass = Pass.FORWARD
    in_loss: bool = False
    is_output: bool = False


@dataclass
class PrecisionInfo:
    """The audit's inputs, filled by a framework capture."""

    framework: str
    global_policy: str | None = None
    layers: list[LayerPrecision] = field(default_factory=list)
    ops: list[OpPrecision] = field(default_factory=list)


def run_audit(info: PrecisionInfo, advice: FrameworkAdvice | None = None
              ) -> tuple[list[AuditFinding], dict[str, dict[str, int]]]:
    """Audit findings (worst first) and op counts per category and dtype.

    ``advice``: the framework's fix for each check, added to its message (none by default).
    """
    advice = advice or FrameworkAdvice()
    found: list[AuditFinding] = []
    seen: set = set()

    def add(check: str, layer: str, severity: str, dtype: str, message: str, layers=()) -> None:
        if (check, layer) not in seen:
            seen.add((check, layer))
            found.append(AuditFinding(check, layer, severity, dtype, message + advice.sentence(check),
                                      tuple(layers) or (layer,)))

    if info.global_policy == "float16":
        add("global_policy", "*", "high", "float16",
            'the global dtype policy is "float16": variables are stored in float16 and updates underflow. '
            "Compute in float16 with float32 variables (a mixed policy).")
    half_vars = [lp for lp in info.layers if any(dt in _HALF for dt in lp.variable_dtypes)]
    for lp in half_vars:
        dtype = next(dt for dt in lp.variable_dtypes if dt in _HALF)
        add("variable_dtype", lp.layer, "high", dtype,
            f"{lp.type} keeps {dtype} trainable variables; keep float32 master weights and compute in "
            f"{dtype} only.")
    for lp in info.layers:
        if lp.kind == "normalization" and (lp.compute_dtype in _HALF and
                                           any(dt in _HALF for dt in lp.variable_dtypes)):
            add("float16_normalization", lp.layer, "high", lp.compute_dtype,
                f"{lp.type} computes statistics and keeps parameters in {lp.compute_dtype}; normalisation "
                "must run in float32.")
        if lp.is_output and lp.compute_dtype in _HALF:
            if lp.activation in _SOFTMAX_ACTIVATIONS:
                add("float16_softmax", lp.layer, "high", lp.compute_dtype,
                    f"the output {lp.activation} is computed in {lp.compute_dtype}; compute it in float32.")
            else:
                add("float16_output", lp.layer, "medium", lp.compute_dtype,
                    f"the model output is {lp.compute_dtype}; make the last layer float32 so the loss "
                    "sees float32 values.")
    for op in info.ops:
        if op.pass_ != Pass.FORWARD or op.dtype not in _HALF or op.op not in _HURTING:
            continue
        if op.in_loss:
            add("float16_loss", op.layer, "high", op.dtype,
                f"the loss runs {op.op} in {op.dtype}; compute the loss in float32.")
        elif op.is_output and op.op in _SOFTMAX_OPS:
            add("float16_softmax", op.layer, "high", op.dtype,
                f"the output {op.op} runs in {op.dtype}; compute the output softmax in float32.")
        else:
            add("float16_deny_op", op.layer, "low", op.dtype,
                f"{op.op} (deny list: numerically unsafe in float16) runs in {op.dtype} here.")
    found.sort(key=lambda a: worst_first(a.severity))
    categories: dict[str, dict[str, int]] = {}
    for op in info.ops:
        cat = categorize(op.op, "torch" if info.framework == "torch" else "tensorflow")
        counts = categories.setdefault(cat, {})
        counts[op.dtype] = counts.get(op.dtype, 0) + 1
    ordered = {cat: categories[cat] for cat in CATEGORIES if cat in categories}
    return found, ordered
