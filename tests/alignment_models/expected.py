"""What each zoo model must produce, framework-free: findings and info notes as comparable keys.

A finding key is ``(top-level layer, dimension, value, severity)``; a note key is
``(top-level layer, dimension, value)``. Both frameworks' versions of a model must give exactly these.

One finding per fix: a size that one layer produces and the next reads is reported on the producer
(``fc1`` ``features_out``, not also ``fc2`` ``features_in``). Severity by the share of the model's FLOPs:
a head that is the model's output is at most medium.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BATCH = 8
SEQ = 16


@dataclass(frozen=True)
class Case:
    name: str
    findings: frozenset = field(default_factory=frozenset)
    notes: frozenset = field(default_factory=frozenset)
    batch: int = BATCH
    precision: str = "float16"  # "float16": mixed precision; "float32": TF32 per `tf32`
    tf32: bool | None = None


def _f(*items):
    return frozenset(items)


CASES = {c.name: c for c in [
    Case("aligned_mlp", batch=32),
    Case("dense_in", _f(("fc1", "features_in", 50, "high")), batch=32),
    Case("dense_out", _f(("fc1", "features_out", 100, "high")), batch=32),
    Case("conv_channels", _f(("conv1", "channels_out", 30, "high")), notes=_f(("conv1", "first_conv", 3))),
    Case("rgb_first_conv", notes=_f(("conv1", "first_conv", 3))),
    Case("depthwise", notes=_f(("conv1", "first_conv", 3), ("dw", "depthwise", 32))),
    Case("conv_transpose", _f(("up", "channels_out", 20, "high")), notes=_f(("conv1", "first_conv", 3))),
    Case("grouped", _f(("grouped", "channels_in", 12, "high"), ("grouped", "channels_out", 12, "high")),
         notes=_f(("conv1", "first_conv", 3))),
    # The attention GEMMs are 3.9 % of this small model's FLOPs (sequence 16): medium, by cost.
    Case("attention_50", _f(("mha", "head_dim", 50, "medium"))),
    Case("attention_64"),
    Case("tied_vocab", _f(("head", "vocab", 50257, "high"))),
    Case("lstm", _f(("lstm", "rnn_hidden", 30, "high"), ("lstm", "rnn_input", 20, "high"))),
    Case("stacked_lstm", _f(("lstm", "rnn_hidden", 30, "high"), ("lstm", "rnn_input", 20, "high"))),
    Case("gru", _f(("gru", "rnn_hidden", 36, "high"))),
    Case("batch_only", _f(("*", "tokens", 30, "low")), batch=30),
    Case("custom_matmul", _f(("proj", "features", 50, "high")), batch=32),
    Case("fp32_tf32_off", notes=_f(("*", "dtype", None)), batch=32, precision="float32", tf32=False),
    Case("fp32_tf32_on", _f(("fc", "features_in", 50, "high"), ("fc", "features_out", 30, "medium")),
         batch=32, precision="float32", tf32=True),
]}


def top(layer: str) -> str:
    """The top-level layer of a path (``mha.out_proj`` and ``mha/query`` are both ``mha``)."""
    return layer.replace("/", ".").split(".")[0] if layer else layer


def finding_keys(report) -> frozenset:
    return frozenset((top(f.layer), f.dimension, f.value, f.severity) for f in report.findings)


def note_keys(report) -> frozenset:
    return frozenset((top(f.layer), f.dimension, f.value) for f in report.notes)
