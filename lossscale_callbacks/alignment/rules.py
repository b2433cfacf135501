"""The alignment rules engine: recorded ops in, one finding per (layer, model dimension) out.

Rules, from NVIDIA's Deep Learning Performance Guide:

* **Required multiple** = 16 bytes / element size: 8 for float16/bfloat16, 4 for TF32, 16 for int8/fp8
  ("Tensor Core Requirements"). A model dimension that is not a multiple is ``high``: older
  cuBLAS/cuDNN fall back to CUDA cores, newer ones use narrower, slower Tensor Core kernels.
  With ``target="a100"``/``"h100"`` a dimension aligned to 16 but not to 128 bytes is ``low``.
* **Which model dimension becomes which GEMM dimension** ("Fully-Connected Layers"): a linear
  layer's forward pass is ``M = tokens``, ``N = out features``, ``K = in features``; the input-gradient
  pass swaps N and K; the weight-gradient pass has ``K = tokens``. All three passes of one layer give
  one finding per model dimension, never one per GEMM.
* **Convolutions** ("Convolutional Layers"): implicit GEMM with ``M = N*P*Q``, ``N = K`` (output channels),
  ``K = C*R*S``; input and output channels *per group* must be multiples. A convolution with at most 4
  input channels (the RGB stem of an image model, the only place such a layer is met in practice) is
  served by special padded kernels: an ``info`` note (``first_conv``), not a finding, wherever it is.
  Depthwise convolutions are memory-bound and never use Tensor Cores: ``info``. float16 convolutions in
  NCHW layout are transposed to NHWC by cuDNN at every call: one ``medium`` layout finding per model.
* **Recurrent layers** ("Recurrent Layers"): hidden and input sizes (and the minibatch) should be
  multiples of 8; the gates make GEMMs of ``4*hidden`` (LSTM) or ``3*hidden`` (GRU).
* **Attention**: the head size is the ``K`` of ``Q @ K^T`` and the ``N`` of ``P @ V``.
* **Vocabulary**: the output projection's ``N`` is the vocabulary; pad it (the guide's Transformer case
  pads 33708 to 33712).
* **Token/batch dimension** (``M`` forward, ``K`` of weight gradients): ``low``, never the contiguous one.
* **float32 with TF32 off** runs on CUDA cores: one ``info`` note and no multiple-of-8 findings.
* Memory-bound ops (normalisation, activations, pooling, the embedding lookup) are never recorded.

Example:
    >>> from lossscale_callbacks.alignment.records import (
    ...     FEATURES_IN, FEATURES_OUT, FORWARD, BACKWARD, LayerInfo, ModelDim, OpRecord, Capture)
    >>> cap = Capture("numpy", layers={"fc": LayerInfo("fc", "Linear", dims=(
    ...     ModelDim(FEATURES_IN, 50, lin_params=64), ModelDim(FEATURES_OUT, 64, lin_params=51)))})
    >>> cap.records = [
    ...     OpRecord.gemm("addmm", "fc", FORWARD, "float16", m=32, n=64, k=50),
    ...     OpRecord.gemm("mm", "fc", BACKWARD, "float16", m=32, n=50, k=64),
    ...     OpRecord.gemm("mm", "fc", BACKWARD, "float16", m=64, n=50, k=32)]
    >>> [(f.layer, f.dimension, f.value, f.severity, f.suggested, f.param_cost)
    ...  for f in analyze(cap).findings]
    [('fc', 'features_in', 50, 'high', 56, 384)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lossscale_callbacks.alignment import audit as _audit
from lossscale_callbacks.alignment.records import (
    BACKWARD,
    CHANNELS_IN,
    CHANNELS_OUT,
    CONV,
    FORWARD,
    GEMM,
    INPUT_GRADIENT,
    TOKENS,
    VOCAB,
    WEIGHT_GRADIENT,
    Capture,
    ModelDim,
    OpRecord,
)
from lossscale_callbacks.alignment.report import Finding, Report, worst_first
from lossscale_callbacks.alignment.targets import (
    ELEMENT_BYTES,
    GEMM_TILE,
    get_target,
    next_multiple,
    recommended_multiple,
    required_multiple,
    wave_efficiency,
)

_SIXTEEN_BIT = ("float16", "bfloat16")

_HINTS = {
    "features_in": "input features: K of the forward GEMM, N of the input-gradient GEMM",
    "features_out": "output features: N of the forward GEMM, K of the input-gradient GEMM",
    "features": "a weight axis used in a GEMM",
    "channels_in": "input channels per group: part of K = C*R*S of the implicit GEMM",
    "channels_out": "output channels per group: N of the implicit GEMM",
    "head_dim": "attention head size: K of Q @ K^T and N of P @ V",
    "vocab": "vocabulary: N of the output projection; pad the embedding and output rows",
    "embedding_dim": "embedding width used in a GEMM",
    "rnn_hidden": "RNN hidden size: K of the recurrent GEMM, N = gates * hidden",
    "rnn_input": "RNN input size: K of the input GEMM",
    "tokens": "batch/token count: M of forward GEMMs, K of weight gradients (never the contiguous one)",
}


@dataclass
class _Group:
    layer: str
    role: str
    value: int
    multiple: int = 0
    dtype: str = ""
    model_dim: ModelDim | None = None
    record: OpRecord | None = None
    ops: set = field(default_factory=set)
    passes: set = field(default_factory=set)
    layers: list = field(default_factory=list)


def _resolve(record: OpRecord, dim, capture: Capture) -> list[tuple[str, int, ModelDim | None]]:
    """Which model dimension(s) a GEMM dimension is: structure, own dims, children's, model-wide, tokens."""
    info = capture.layers.get(record.layer)
    if dim.role is not None:
        value = dim.model_value if dim.model_value is not None else dim.value
        md = None
        if info is not None:
            md = next((d for d in info.dims if d.role == dim.role and d.value == value), None)
        return [(dim.role, value, md)]
    pools = [info.dims, info.fallback] if info is not None else []
    for pool in [*pools, capture.global_dims]:
        hits = [d for d in pool if d.matches(dim.value)]
        if hits:
            seen, out = set(), []
            for d in hits:
                if (d.role, d.value) not in seen:
                    seen.add((d.role, d.value))
                    out.append((d.role, d.value, d))
            return out
    return [(TOKENS, dim.value, None)]


def _pass(record: OpRecord, resolved: dict[str, list]) -> str:
    if record.pass_ != BACKWARD:
        return record.pass_
    k_roles = {role for role, _, _ in resolved.get("K", [])}
    return WEIGHT_GRADIENT if k_roles == {TOKENS} else INPUT_GRADIENT


def _conv_cost(group: _Group, new_value: int) -> int | None:
    rec = group.record
    if rec is None:
        return None
    c = next(d.value for d in rec.dims if d.role == CHANNELS_IN)
    k = next(d.value for d in rec.dims if d.role == CHANNELS_OUT)
    if group.role == CHANNELS_IN:
        return rec.groups * k * (new_value - c) * rec.kernel_elems
    return rec.groups * (new_value - k) * c * rec.kernel_elems


def analyze(capture: Capture, *, target: str | None = None) -> Report:
    """Run the alignment rules (and the mixed-precision audit when the capture has its inputs).

    Args:
        capture: what a framework capture recorded.
        target: ``None`` or a GPU name from :data:`~lossscale_callbacks.alignment.targets.TARGETS`
            (``"a100"``, ``"h100"``...): adds the 128-byte recommendation and tile/wave efficiency.

    Returns:
        A :class:`~lossscale_callbacks.alignment.report.Report`.
    """
    tgt = get_target(target)
    groups: dict[tuple, _Group] = {}
    order: list[tuple] = []
    notes: list[Finding] = []
    noted: set = set()
    fp32_layers: list[str] = []
    nchw_layers: list[str] = []
    efficiency: dict[tuple, dict] = {}

    def note(layer: str, dimension: str, value, message: str) -> None:
        if (layer, dimension) not in noted:
            noted.add((layer, dimension))
            notes.append(Finding(layer=layer, dimension=dimension, value=value, required_multiple=None,
                                 severity="info", message=message))

    for record in capture.records:
        multiple = required_multiple(record.dtype)
        if multiple is None:
            if record.layer not in fp32_layers:
                fp32_layers.append(record.layer)
            continue
        if record.kind == GEMM and min(d.value for d in record.dims) <= 1:
            continue  # a matrix-vector product is memory-bound: no Tensor Core rule applies
        if record.kind == CONV:
            if record.depthwise:
                note(record.layer, "depthwise", record.groups,
                     "depthwise convolution: memory-bound, Tensor Cores not used; not a finding")
                continue
            if record.layout == "NCHW" and record.dtype in _SIXTEEN_BIT and record.layer not in nchw_layers:
                nchw_layers.append(record.layer)
        resolved = {d.axis: _resolve(record, d, capture) for d in record.dims}
        pass_ = _pass(record, resolved)
        for dim in record.dims:
            for role, value, md in resolved[dim.axis]:
                if record.kind == CONV and role == CHANNELS_IN and record.groups == 1 and value <= 4:
                    note(record.layer, "first_conv", value,
                         f"convolution with {value} input channels (image input): cuDNN pads it with "
                         "special kernels; not a finding")
                    continue
                key = (TOKENS, value) if role == TOKENS else (record.layer, role, value)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = _Group("*" if role == TOKENS else record.layer, role, value)
                    order.append(key)
                if multiple > group.multiple:
                    group.multiple, group.dtype = multiple, record.dtype
                group.model_dim = group.model_dim or md
                if record.kind == CONV:
                    group.record = record
                group.ops.add(record.op)
                group.passes.add(pass_)
                if record.layer not in group.layers:
                    group.layers.append(record.layer)
        if tgt is not None and record.kind == GEMM and record.pass_ == FORWARD:
            m, n, k = (d.value for d in record.dims)
            if math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1]) < tgt.sm_count:
                continue  # less than one wave: the GEMM cannot fill the GPU whatever its shape
            efficiency.setdefault((record.layer, m, n, k), {
                "layer": record.layer, "m": m, "n": n, "k": k,
                "efficiency": round(wave_efficiency(m, n, tgt), 4)})

    findings = [f for f in (_judge(groups[key], tgt) for key in order) if f is not None]
    if nchw_layers:
        findings.append(Finding(
            layer="*", dimension="layout", value=None, required_multiple=None, severity="medium",
            suggested="channels_last", layers=tuple(nchw_layers), ops=("convolution",),
            message=f"{len(nchw_layers)} 16-bit convolution(s) run in NCHW layout; Tensor Core kernels are "
                    "NHWC, so every call transposes. Use model.to(memory_format=torch.channels_last) "
                    "and channels_last inputs."))
    if fp32_layers:
        notes.append(Finding(
            layer="*", dimension="dtype", value=None, required_multiple=None, severity="info",
            dtype="float32", layers=tuple(fp32_layers),
            message="float32 with TF32 disabled runs on CUDA cores, not Tensor Cores: alignment rules do not "
                    "apply. Enable mixed precision (or TF32) to use Tensor Cores."))
    findings.sort(key=lambda f: worst_first(f.severity))
    report = Report(findings=findings, notes=notes, framework=capture.framework,
                    target=tgt.name if tgt else None, ops_seen=len(capture.records),
                    efficiency=list(efficiency.values()))
    if capture.precision is not None:
        report.audit, report.op_categories = _audit.run_audit(capture.precision)
    return report


def _judge(group: _Group, tgt) -> Finding | None:
    value, multiple = group.value, group.multiple
    recommended = recommended_multiple(group.dtype, tgt)
    if value % multiple:
        severity = "low" if group.role == TOKENS else "high"
        used = multiple
    elif recommended and group.role != TOKENS and value % recommended:
        severity, used = "low", recommended
    else:
        return None
    suggested = next_multiple(value, used)
    if group.role == TOKENS:
        cost = None
    elif group.record is not None and group.role in (CHANNELS_IN, CHANNELS_OUT):
        cost = _conv_cost(group, suggested)
    elif group.model_dim is not None:
        cost = group.model_dim.param_cost(suggested)
    else:
        cost = None
    size = ELEMENT_BYTES[group.dtype] * used
    what = _HINTS.get(group.role, group.role)
    if group.role == VOCAB:
        advice = f"pad the vocabulary to {suggested}"
    elif group.role == TOKENS:
        advice = f"use a batch (x sequence) size that is a multiple of {used}"
    else:
        advice = f"use {suggested}"
    message = (f"{group.role}={value} is not a multiple of {used} ({size} bytes of {group.dtype}); "
               f"{what}. {advice[0].upper()}{advice[1:]}.")
    return Finding(layer=group.layer, dimension=group.role, value=value, required_multiple=used,
                   severity=severity, suggested=suggested, param_cost=cost, dtype=group.dtype,
                   layers=tuple(group.layers), ops=tuple(sorted(group.ops)),
                   passes=tuple(p for p in (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT) if p in group.passes),
                   message=message)
