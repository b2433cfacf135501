"""Tensor Core alignment checker and mixed-precision audit: the framework-free rules engine and report.

Shape capture lives in the integrations (``lossscale_callbacks.keras.alignment.check_alignment`` and
``lossscale_callbacks.torch.alignment.check_alignment``); they record the GEMMs and convolutions
of one forward and backward pass and hand them to :func:`analyze`.

Example:
    >>> from lossscale_callbacks.alignment import (
    ...     Capture, LayerInfo, ModelDim, OpRecord, analyze, FEATURES_IN, FEATURES_OUT, FORWARD)
    >>> cap = Capture("numpy", layers={"fc": LayerInfo("fc", "Linear", dims=(
    ...     ModelDim(FEATURES_IN, 64, lin_params=10), ModelDim(FEATURES_OUT, 10, lin_params=65)))})
    >>> cap.records.append(OpRecord.gemm("addmm", "fc", FORWARD, "float16", m=32, n=10, k=64))
    >>> [(f.dimension, f.value, f.suggested, f.param_cost) for f in analyze(cap).findings]
    [('features_out', 10, 16, 390)]
"""

from lossscale_callbacks.alignment.audit import (
    CATEGORIES,
    LayerPrecision,
    OpPrecision,
    PrecisionInfo,
    categorize,
    run_audit,
)
from lossscale_callbacks.alignment.gemm import einsum_gemm, matmul_gemm
from lossscale_callbacks.alignment.records import (
    BACKWARD,
    CHANNELS_IN,
    CHANNELS_OUT,
    CONV,
    EMBEDDING_DIM,
    FEATURES,
    FEATURES_IN,
    FEATURES_OUT,
    FORWARD,
    GEMM,
    HEAD_DIM,
    INPUT_GRADIENT,
    RNN_HIDDEN,
    RNN_INPUT,
    ROLES,
    TOKENS,
    VOCAB,
    WEIGHT_GRADIENT,
    Capture,
    GemmDim,
    LayerInfo,
    ModelDim,
    OpRecord,
)
from lossscale_callbacks.alignment.report import SEVERITIES, AuditFinding, Finding, Report
from lossscale_callbacks.alignment.rules import NoRuleAppliedWarning, analyze, warn_if_nothing_checked
from lossscale_callbacks.alignment.targets import (
    TARGETS,
    next_multiple,
    recommended_multiple,
    required_multiple,
    wave_efficiency,
)

__all__ = [
    "BACKWARD",
    "CATEGORIES",
    "CHANNELS_IN",
    "CHANNELS_OUT",
    "CONV",
    "EMBEDDING_DIM",
    "FEATURES",
    "FEATURES_IN",
    "FEATURES_OUT",
    "FORWARD",
    "GEMM",
    "HEAD_DIM",
    "INPUT_GRADIENT",
    "RNN_HIDDEN",
    "RNN_INPUT",
    "ROLES",
    "SEVERITIES",
    "TARGETS",
    "TOKENS",
    "VOCAB",
    "WEIGHT_GRADIENT",
    "AuditFinding",
    "Capture",
    "Finding",
    "GemmDim",
    "LayerInfo",
    "LayerPrecision",
    "ModelDim",
    "NoRuleAppliedWarning",
    "OpPrecision",
    "OpRecord",
    "PrecisionInfo",
    "Report",
    "analyze",
    "categorize",
    "einsum_gemm",
    "matmul_gemm",
    "next_multiple",
    "recommended_multiple",
    "required_multiple",
    "run_audit",
    "warn_if_nothing_checked",
    "wave_efficiency",
]
