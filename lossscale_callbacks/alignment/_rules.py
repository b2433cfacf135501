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
  ``K = C*R*S``; input and output channels *per group* must be multiples. The model's first
  convolution with at most 4 input channels (the RGB stem of an image model) is served by special
  padded kernels: an ``info`` note (``first_conv``), not a finding. Later narrow convolutions (the
  squeeze of a squeeze-and-excitation block) are judged like any other.
  Depthwise convolutions are memory-bound and never use Tensor Cores: ``info``. float16 convolutions in
  NCHW layout are transposed to NHWC by cuDNN at every call: one ``medium`` layout finding per model.
* **Recurrent layers** ("Recurrent Layers"): hidden and input sizes (and the minibatch) should be
  multiples of 8; the gates make GEMMs of ``4*hidden`` (LSTM) or ``3*hidden`` (GRU).
* **Attention**: the head size is the ``K`` of ``Q @ K^T`` and the ``N`` of ``P @ V``.
* **Vocabulary**: the output projection's ``N`` is the vocabulary; pad it (the guide's Transformer case
  pads 33708 to 33712).
* **Token/batch dimension** (``M`` forward, ``K`` of weight gradients): ``low``, never the contiguous one.
* **One finding per fix**: a layer's input size is the output size of the layer before it, so an input
  dimension (``features_in``, ``channels_in``, ``rnn_input``) that an earlier layer produces with the
  same value is reported once, on that earlier layer, naming its argument (``units=1008``); only an
  input read straight from the data stays on the layer that reads it, and its fix is to pad the data
  (``pad the data to 24``: no layer argument sets it, so the finding says what can be done).
* **Severity by cost**: a dimension that breaks the rule is ``high`` when its GEMMs/convolutions carry
  at least 10 % of the model's recorded FLOPs (forward and backward), ``medium`` from 1 %, ``low``
  below (a small classifier head, a narrow side branch). A model output that is the number of
  classes (a classifier head) is never ``high``: padding it means masking logits.
* **float32 with TF32 off** runs on CUDA cores: one ``info`` note and no multiple-of-8 findings.
* **Framework-free words**: a finding says what is wrong; the fix in the model's framework (a constructor
  argument of a convolution, ``channels_last``, a dtype policy) is the capture's
  :class:`~lossscale_callbacks.alignment._records.FrameworkAdvice`, added where it applies.
* Memory-bound ops (normalisation, activations, pooling, the embedding lookup) are never recorded.

Example:
    >>> from lossscale_callbacks.alignment._records import Capture, LayerInfo, ModelDim, OpRecord, Pass, Role
    >>> cap = Capture("numpy", layers={"fc": LayerInfo("fc", "Linear", dims=(
    ...     ModelDim(Role.FEATURES_IN, 50, lin_params=64), ModelDim(Role.FEATURES_OUT, 64, lin_params=51)))})
    >>> cap.records = [
    ...     OpRecord.gemm("addmm", "fc", Pass.FORWARD, "float16", m=32, n=64, k=50),
    ...     OpRecord.gemm("mm", "fc", Pass.BACKWARD, "float16", m=32, n=50, k=64),
    ...     OpRecord.gemm("mm", "fc", Pass.BACKWARD, "float16", m=64, n=50, k=32)]
    >>> [(f.layer, f.dimension, f.value, f.severity, f.suggested, f.param_cost)
    ...  for f in analyze(cap).findings]
    [('fc', 'features_in', 50, 'high', 56, 384)]
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from lossscale_callbacks.alignment import _audit
from lossscale_callbacks.alignment._records import Capture, GemmDim, ModelDim, OpKind, OpRecord, Pass, Role
from lossscale_callbacks.alignment._report import AlignmentReport, Finding, worst_first
from lossscale_callbacks.alignment._targets import (
    ELEMENT_BYTES,
    GEMM_TILE,
    Target,
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


_HIGH_SHARE = 0.10
_MEDIUM_SHARE = 0.01
_INPUT_ROLES = (Role.FEATURES_IN, Role.CHANNELS_IN, Role.RNN_INPUT)
_OUTPUT_ROLES = (Role.FEATURES_OUT, Role.CHANNELS_OUT, Role.RNN_HIDDEN, Role.EMBEDDING_DIM)


@dataclass
class _Group:
    layer: str
    role: Role
    value: int
    multiple: int = 0
    dtype: str = ""
    model_dim: ModelDim | None = None
    record: OpRecord | None = None
    ops: set = field(default_factory=set)
    passes: set = field(default_factory=set)
    layers: list = field(default_factory=list)
    record_ids: set = field(default_factory=set)
    consumers: list = field(default_factory=list)  # groups merged into this one (the next layers' inputs)


def _resolve(record: OpRecord, dim: GemmDim, capture: Capture) -> list[tuple[Role, int, ModelDim | None]]:
    """Which model dimension(s) a GEMM dimension is: structure, own dims, children's, model-wide, tokens."""
    info = capture.layers.get(record.layer)
    if dim.role is not None:
        value = dim.model_value if dim.model_value is not None else dim.value
        md = None
        if info is not None:
            md = next((d for d in info.dims if d.role == dim.role and d.value == value), None)
        return [(dim.role, value, md)]
    pools = [info.dims, info.fallback] if info is not None else []
    vocabularies = {d.value for d in capture.global_dims if d.role == Role.VOCAB}
    for pool in [*pools, capture.global_dims]:
        hits = [d for d in pool if d.matches(dim.value)]
        if hits:
            seen, out = set(), []
            for d in hits:
                # An output projection as wide as an embedding table is the vocabulary (a language
                # model's head, tied or not): padded like one.
                vocabulary = d.role in (Role.FEATURES_OUT, Role.FEATURES) and d.value in vocabularies
                role = Role.VOCAB if vocabulary else d.role
                if (role, d.value) not in seen:
                    seen.add((role, d.value))
                    out.append((role, d.value, d))
            return out
    return [(Role.TOKENS, dim.value, None)]


def _pass(record: OpRecord, resolved: dict[str, list]) -> Pass:
    if record.pass_ != Pass.BACKWARD:
        return record.pass_
    k_roles = {role for role, _, _ in resolved.get("K", [])}
    return Pass.WEIGHT_GRADIENT if k_roles == {Role.TOKENS} else Pass.INPUT_GRADIENT


def _conv_cost(group: _Group, new_value: int) -> int | None:
    rec = group.record
    if rec is None:
        return None
    c = next(d.value for d in rec.dims if d.role == Role.CHANNELS_IN)
    k = next(d.value for d in rec.dims if d.role == Role.CHANNELS_OUT)
    if group.role == Role.CHANNELS_IN:
        return rec.groups * k * (new_value - c) * rec.kernel_elems
    return rec.groups * (new_value - k) * c * rec.kernel_elems


@dataclass
class _Scan:
    """One pass over a capture's records: the groups (one per layer and model dimension) and the notes."""

    capture: Capture
    target: Target | None
    groups: dict[tuple, _Group] = field(default_factory=dict)
    order: list[tuple] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    noted: set = field(default_factory=set)
    fp32_layers: list[str] = field(default_factory=list)
    nchw_layers: list[str] = field(default_factory=list)
    efficiency: dict[tuple, dict] = field(default_factory=dict)
    layer_order: dict[str, int] = field(default_factory=dict)
    first_conv: str | None = None  # the image stem: the only convolution whose few channels are the data's

    def note(self, layer: str, dimension: str, value: int, message: str) -> None:
        if (layer, dimension) not in self.noted:
            self.noted.add((layer, dimension))
            self.notes.append(Finding(layer=layer, dimension=dimension, value=value, required_multiple=None,
                                      severity="info", message=message))

    def add(self, index: int, record: OpRecord) -> None:
        """Put one record's dimensions into their groups (or a note, or nothing)."""
        multiple = required_multiple(record.dtype)
        if multiple is None:
            if record.layer not in self.fp32_layers:
                self.fp32_layers.append(record.layer)
            return
        if record.kind == OpKind.GEMM and min(d.value for d in record.dims) <= 1:
            return  # a matrix-vector product is memory-bound: no Tensor Core rule applies
        if record.kind == OpKind.CONV:
            if record.depthwise:
                self.note(record.layer, "depthwise", record.groups,
                          "depthwise convolution: memory-bound, Tensor Cores not used; not a finding")
                return
            if (record.layout == "NCHW" and record.dtype in _SIXTEEN_BIT
                    and record.layer not in self.nchw_layers):
                self.nchw_layers.append(record.layer)
            if self.first_conv is None:
                self.first_conv = record.layer
        self.layer_order.setdefault(record.layer, len(self.layer_order))
        resolved = {d.axis: _resolve(record, d, self.capture) for d in record.dims}
        pass_ = _pass(record, resolved)
        for dim in record.dims:
            for role, value, md in resolved[dim.axis]:
                if self._is_image_input(record, role, value):
                    self.note(record.layer, "first_conv", value,
                              f"convolution with {value} input channels (image input): cuDNN pads it with "
                              "special kernels; not a finding")
                    continue
                self._join(index, record, role, value, md, pass_, multiple)
        self._add_efficiency(record)

    def _is_image_input(self, record: OpRecord, role: Role, value: int) -> bool:
        return (record.kind == OpKind.CONV and role == Role.CHANNELS_IN and record.groups == 1 and value <= 4
                and record.layer == self.first_conv)

    def _join(self, index: int, record: OpRecord, role: Role, value: int, md: ModelDim | None, pass_: Pass,
              multiple: int) -> None:
        key = (Role.TOKENS, value) if role == Role.TOKENS else (record.layer, role, value)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group("*" if role == Role.TOKENS else record.layer, role, value)
            self.order.append(key)
        if multiple > group.multiple:
            group.multiple, group.dtype = multiple, record.dtype
        group.model_dim = group.model_dim or md
        if record.kind == OpKind.CONV:
            group.record = record
        group.ops.add(record.op)
        group.passes.add(pass_)
        group.record_ids.add(index)
        if record.layer not in group.layers:
            group.layers.append(record.layer)

    def _add_efficiency(self, record: OpRecord) -> None:
        tgt = self.target
        if tgt is None or record.kind != OpKind.GEMM or record.pass_ != Pass.FORWARD:
            return
        m, n, k = (d.value for d in record.dims)
        if math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1]) < tgt.sm_count:
            return  # less than one wave: the GEMM cannot fill the GPU whatever its shape
        self.efficiency.setdefault((record.layer, m, n, k), {
            "layer": record.layer, "m": m, "n": n, "k": k,
            "efficiency": round(wave_efficiency(m, n, tgt), 4)})


def analyze(capture: Capture, *, target: str | None = None) -> AlignmentReport:
    """Run the alignment rules (and the mixed-precision audit when the capture has its inputs).

    The findings say what is wrong in framework-free words; how to fix it in the model's framework
    comes from the capture's :class:`~lossscale_callbacks.alignment._records.FrameworkAdvice`.

    Args:
        capture: what a framework capture recorded.
        target: ``None`` or a GPU name from :data:`~lossscale_callbacks.alignment._targets.TARGETS`
            (``"a100"``, ``"h100"``...): adds the 128-byte recommendation and tile/wave efficiency.

    Returns:
        An :class:`~lossscale_callbacks.alignment.AlignmentReport`.
    """
    tgt = get_target(target)
    scan = _Scan(capture, tgt)
    for index, record in enumerate(capture.records):
        scan.add(index, record)
    order = _merge_inputs_into_producers(scan.groups, scan.order, scan.layer_order, tgt)
    flops = [_flops(r) for r in capture.records]
    total = sum(flops)
    outputs = set(capture.output_layers)
    first = min(scan.layer_order, key=scan.layer_order.__getitem__, default=None)  # it reads the data
    findings = [f for f in (_judge(scan.groups[key], tgt, capture, flops, total, outputs, first)
                            for key in order) if f is not None]
    if scan.nchw_layers:
        findings.append(_layout_finding(scan.nchw_layers, capture, flops, total))
    notes = scan.notes
    if scan.fp32_layers:
        notes.append(Finding(
            layer="*", dimension="dtype", value=None, required_multiple=None, severity="info",
            dtype="float32", layers=tuple(scan.fp32_layers),
            message="float32 with TF32 disabled runs on CUDA cores, not Tensor Cores: alignment rules do not "
                    "apply. Enable mixed precision (or TF32) to use Tensor Cores."
                    + capture.advice.sentence("dtype")))
    findings.sort(key=lambda f: worst_first(f.severity))
    report = AlignmentReport(findings=findings, notes=notes, framework=capture.framework,
                             target=tgt.name if tgt else None, ops_seen=len(capture.records),
                             efficiency=list(scan.efficiency.values()))
    if capture.precision is not None:
        report.audit, report.op_categories = _audit.run_audit(capture.precision, capture.advice)
    return report


def _layout_finding(nchw_layers: list[str], capture: Capture, flops: list[int], total: int) -> Finding:
    """One finding for the model's 16-bit convolutions in NCHW layout."""
    nchw = set(nchw_layers)
    share = sum(f for f, r in zip(flops, capture.records, strict=True)
                if r.kind == OpKind.CONV and r.layer in nchw) / total if total else None
    # A transpose per call costs memory traffic, not a kernel fallback: medium at most, and low when
    # the convolutions are a small part of the model (a ViT's patch embedding).
    severity = "low" if share is not None and share < _HIGH_SHARE else "medium"
    return Finding(
        layer="*", dimension="layout", value=None, required_multiple=None, severity=severity,
        suggested="channels_last", layers=tuple(nchw_layers), ops=("convolution",),
        flop_share=None if share is None else round(share, 4), fix=capture.advice.fixes.get("layout", ""),
        message=f"{len(nchw_layers)} 16-bit convolution(s) run in NCHW layout; Tensor Core kernels are "
                "NHWC (channels last), so every call transposes." + capture.advice.sentence("layout"))


def _flops(record: OpRecord) -> int:
    if record.flops:
        return record.flops
    if record.kind == OpKind.GEMM:
        return 2 * math.prod(d.value for d in record.dims)
    return 0


def _unaligned(group: _Group, tgt) -> bool:
    recommended = recommended_multiple(group.dtype, tgt)
    return bool(group.value % group.multiple or (recommended and group.role != Role.TOKENS
                                                 and group.value % recommended))


def _merge_inputs_into_producers(groups: dict, order: list, layer_order: dict, tgt) -> list:
    """Fold each input-dimension group into the group of the nearest earlier layer that produces the
    same size; returns the remaining keys in order."""
    producers = [key for key in order if groups[key].role in _OUTPUT_ROLES]
    merged: set = set()
    for key in order:
        group = groups[key]
        if group.role not in _INPUT_ROLES or not _unaligned(group, tgt):
            continue
        here = layer_order.get(group.layer, -1)
        candidates = [pk for pk in producers if groups[pk].value == group.value and pk not in merged
                      and groups[pk].layer != group.layer and layer_order.get(groups[pk].layer, -1) < here]
        if not candidates:
            continue
        producer = groups[max(candidates, key=lambda pk: layer_order.get(groups[pk].layer, -1))]
        if group.multiple > producer.multiple:
            producer.multiple, producer.dtype = group.multiple, group.dtype
        producer.ops |= group.ops
        producer.passes |= group.passes
        producer.record_ids |= group.record_ids
        producer.layers.extend(lay for lay in group.layers if lay not in producer.layers)
        producer.consumers.append(group)
        merged.add(key)
    return [key for key in order if key not in merged]


def _argument(group: _Group, capture: Capture) -> str:
    """The constructor argument that sets this dimension of the group's layer, or ``""``.

    A convolution's channels are named by the framework's advice (the engine knows no framework's
    argument names); every other dimension by its model dimension's label, when that is a name.
    """
    info = capture.layers.get(group.layer)
    kind = info.type.lower() if info is not None else ""
    argument = capture.advice.arguments.get(group.role, "")
    if group.role in (Role.CHANNELS_IN, Role.CHANNELS_OUT) and "conv" in kind and argument:
        return argument
    label = group.model_dim.label if group.model_dim is not None else ""
    return label if label.isidentifier() else ""


def _param_cost(group: _Group, suggested: int) -> int | None:
    if group.role == Role.TOKENS:
        return None
    if group.record is not None and group.role in (Role.CHANNELS_IN, Role.CHANNELS_OUT):
        cost = _conv_cost(group, suggested)
    elif group.model_dim is not None:
        cost = group.model_dim.param_cost(suggested)
    else:
        return None
    for consumer in group.consumers:
        extra = _param_cost(consumer, suggested)
        if extra is None:
            return None
        cost += extra
    return cost


def _judge(group: _Group, tgt, capture: Capture, flops: list[int], total: int,
           outputs: set[str], data_layer: str | None = None) -> Finding | None:
    value, multiple = group.value, group.multiple
    recommended = recommended_multiple(group.dtype, tgt)
    share = sum(flops[i] for i in group.record_ids) / total if total else None
    is_head = group.layer in outputs and group.role == Role.FEATURES_OUT
    if value % multiple:
        used = multiple
        if group.role == Role.TOKENS:
            severity = "low"
        elif share is None:
            severity = "high"
        else:
            severity = "high" if share >= _HIGH_SHARE else "medium" if share >= _MEDIUM_SHARE else "low"
        if is_head and severity == "high":
            severity = "medium"
    elif recommended and group.role != Role.TOKENS and value % recommended:
        severity, used = "low", recommended
    else:
        return None
    if group.role == Role.VOCAB:
        # Padding a vocabulary costs a few rows and nothing else: go to the 128-byte multiple
        # (64 in 16 bits, the padding of nanoGPT's 50304) whatever the target.
        used = max(used, recommended or 0, 128 // ELEMENT_BYTES[group.dtype])
    suggested = next_multiple(value, used)
    cost = _param_cost(group, suggested)
    size = ELEMENT_BYTES[group.dtype] * used
    what = _HINTS.get(group.role, group.role)
    argument = _argument(group, capture)
    fix = f"{argument}={suggested}" if argument else ""
    reads_data = not fix and group.layer == data_layer and group.role in _INPUT_ROLES and not group.consumers
    if reads_data:  # no layer sets it: the data does, and padding the data is what can be done
        fix = f"pad the data to {suggested}"
    if group.role == Role.VOCAB:
        advice = f"pad the vocabulary to {suggested} (the extra rows are never used as labels)"
    elif group.role == Role.TOKENS:
        advice = f"use a batch (x sequence) size that is a multiple of {used}"
    elif reads_data:
        advice = (f"it is the width of the data the model reads (no layer sets it): pad the data to "
                  f"{suggested} with {suggested - value} zero column(s) in the input pipeline, or leave it "
                  "if this layer's cost does not matter")
    elif is_head:
        advice = (f"it is the model's output ({value} classes?): pad the head to {suggested} and mask the "
                  "extra logits only if its cost matters")
    else:
        advice = f"use {fix or suggested}"
    consumers = [c.layer for c in group.consumers]
    feeds = f" It feeds {', '.join(f'`{c}`' for c in consumers)} (its input size changes with it)." \
        if consumers else ""
    cost_words = ""
    if share is not None and group.role != Role.TOKENS:
        cost_words = (f" {share:.1%} of the model's GEMM/convolution FLOPs run with it; misaligned, cuBLAS/"
                      "cuDNN choose slower kernels for them (narrower Tensor Core tiles, or CUDA cores).")
    message = (f"{group.role}={value} is not a multiple of {used} ({size} bytes of {group.dtype}); "
               f"{what}. {advice[0].upper()}{advice[1:]}.{feeds}{cost_words}")
    # The report holds plain strings (the enums' values): its repr and JSON read as they always have.
    passes = tuple(str(p) for p in (Pass.FORWARD, Pass.INPUT_GRADIENT, Pass.WEIGHT_GRADIENT)
                   if p in group.passes)
    return Finding(layer=group.layer, dimension=str(group.role), value=value, required_multiple=used,
                   severity=severity, suggested=suggested, param_cost=cost, dtype=group.dtype,
                   layers=tuple(group.layers), ops=tuple(sorted(group.ops)), passes=passes,
                   message=message, fix=fix, flop_share=None if share is None else round(share, 4))


class NoRuleAppliedWarning(UserWarning):
    """The check ran, but no Tensor Core rule applied (float32 without TF32, or no GEMM recorded)."""


def warn_if_nothing_checked(report: AlignmentReport, precision_hint: str) -> AlignmentReport:
    """Warn, instead of passing silently, when a report is clean only because no rule applied."""
    fp32 = any(n.dimension == "dtype" for n in report.notes)
    if report.ops_seen == 0:
        warnings.warn("the alignment check recorded no GEMM or convolution: nothing was checked",
                      NoRuleAppliedWarning, stacklevel=3)
    elif fp32 and not report.findings:
        warnings.warn("no Tensor Core rule applied: the model computes in float32 with TF32 off, on CUDA "
                      f"cores. Check the precision you train in: {precision_hint}", NoRuleAppliedWarning,
                      stacklevel=3)
    return report
