"""The framework-free rules engine, report and audit, on hand-made records."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale_callbacks.alignment._audit import (
    LayerPrecision,
    OpPrecision,
    PrecisionInfo,
    categorize,
    run_audit,
)
from lossscale_callbacks.alignment._gemm import einsum_gemm, matmul_gemm
from lossscale_callbacks.alignment._records import Capture, LayerInfo, ModelDim, OpRecord, Pass, Role
from lossscale_callbacks.alignment._report import AlignmentReport, Finding
from lossscale_callbacks.alignment._rules import analyze
from lossscale_callbacks.alignment._targets import (
    next_multiple,
    recommended_multiple,
    required_multiple,
    wave_efficiency,
)


def linear(name: str, n_in: int, n_out: int) -> LayerInfo:
    return LayerInfo(name, "Linear", dims=(ModelDim(Role.FEATURES_IN, n_in, lin_params=n_out),
                                           ModelDim(Role.FEATURES_OUT, n_out, lin_params=n_in + 1)))


def linear_passes(name: str, n_in: int, n_out: int, tokens: int, dtype: str = "float16") -> list[OpRecord]:
    """The three GEMMs of a linear layer (Deep Learning Performance Guide, fully-connected layers)."""
    return [OpRecord.gemm("addmm", name, Pass.FORWARD, dtype, m=tokens, n=n_out, k=n_in),
            OpRecord.gemm("mm", name, Pass.BACKWARD, dtype, m=tokens, n=n_in, k=n_out),
            OpRecord.gemm("mm", name, Pass.BACKWARD, dtype, m=n_out, n=n_in, k=tokens)]


def mlp_capture(n_in: int, n_out: int, tokens: int, dtype: str = "float16") -> Capture:
    return Capture("test", linear_passes("fc", n_in, n_out, tokens, dtype), {"fc": linear("fc", n_in, n_out)})


def keys(report: AlignmentReport) -> set:
    return {(f.layer, f.dimension, f.value, f.severity) for f in report.findings}


def test_required_and_recommended_multiples_follow_16_and_128_bytes():
    dtypes = ("float16", "bfloat16", "tfloat32", "int8", "float8")
    assert [required_multiple(d) for d in dtypes] == [8, 8, 4, 16, 16]
    assert required_multiple("float32") is None
    assert recommended_multiple("float16", "h100") == 64
    assert recommended_multiple("tfloat32", "a100") == 32
    assert recommended_multiple("float16", "v100") is None
    assert recommended_multiple("float16", None) is None
    assert next_multiple(64, 8) == 64 and next_multiple(65, 8) == 72


def test_three_passes_of_one_layer_give_one_finding_per_dimension_with_cost():
    report = analyze(mlp_capture(50, 100, 32))
    assert keys(report) == {("fc", "features_in", 50, "high"), ("fc", "features_out", 100, "high")}
    by_dim = {f.dimension: f for f in report.findings}
    assert by_dim["features_in"].suggested == 56 and by_dim["features_in"].param_cost == 6 * 100
    assert by_dim["features_out"].suggested == 104 and by_dim["features_out"].param_cost == 4 * 51
    assert set(by_dim["features_in"].passes) == {Pass.FORWARD, Pass.INPUT_GRADIENT, Pass.WEIGHT_GRADIENT}
    assert by_dim["features_in"].required_multiple == 8


def test_token_dimension_is_low_and_model_wide():
    cap = mlp_capture(64, 64, 30)
    cap.records += linear_passes("fc2", 64, 128, 30)
    cap.layers["fc2"] = linear("fc2", 64, 128)
    report = analyze(cap)
    assert keys(report) == {("*", "tokens", 30, "low")}
    assert report.findings[0].layers == ("fc", "fc2") and report.findings[0].param_cost is None


def test_fp32_without_tf32_is_one_info_and_tf32_uses_multiples_of_4():
    off = analyze(mlp_capture(50, 30, 32, dtype="float32"))
    assert off.findings == [] and [(n.dimension, n.severity) for n in off.notes] == [("dtype", "info")]
    on = analyze(mlp_capture(50, 30, 32, dtype="tfloat32"))
    assert keys(on) == {("fc", "features_in", 50, "high"), ("fc", "features_out", 30, "high")}
    assert {f.required_multiple for f in on.findings} == {4}
    assert keys(analyze(mlp_capture(52, 28, 32, dtype="tfloat32"))) == set()  # aligned for TF32, not fp16


def test_int8_needs_multiples_of_16():
    assert keys(analyze(mlp_capture(40, 64, 32, dtype="int8"))) == {("fc", "features_in", 40, "high")}


def test_target_adds_low_findings_for_128_bytes_and_wave_efficiency():
    report = analyze(mlp_capture(1024, 200, 32768), target="a100")  # 256 tiles of 256x128: > 1 wave
    assert keys(report) == {("fc", "features_out", 200, "low")}
    assert report.findings[0].required_multiple == 64 and report.findings[0].suggested == 256
    assert report.target == "a100"
    assert report.efficiency and report.efficiency[0]["m"] == 32768
    assert 0 < report.efficiency[0]["efficiency"] <= 1
    with pytest.raises(ValueError, match="target must be one of"):
        analyze(mlp_capture(64, 64, 64), target="gtx480")


def test_wave_efficiency_counts_tiles_and_waves():
    assert wave_efficiency(256 * 108, 128, "a100") == pytest.approx(1.0)
    assert wave_efficiency(256 * 109, 128, "a100") == pytest.approx(109 / 216)


def test_convolution_rules_first_layer_depthwise_grouped_and_layout():
    recs = [
        OpRecord.conv("convolution", "stem", Pass.FORWARD, "float16",
                      in_channels=3, out_channels=32, groups=1,
                      kernel_elems=9, layout="NCHW"),
        OpRecord.conv("convolution", "dw", Pass.FORWARD, "float16",
                      in_channels=32, out_channels=32, groups=32,
                      kernel_elems=9, layout="NCHW"),
        OpRecord.conv("convolution", "grouped", Pass.FORWARD, "float16",
                      in_channels=48, out_channels=48, groups=4,
                      kernel_elems=9, layout="NCHW"),
        OpRecord.conv("convolution_backward", "grouped", Pass.WEIGHT_GRADIENT, "float16", in_channels=48,
                      out_channels=48, groups=4, kernel_elems=9, layout="NCHW"),
    ]
    report = analyze(Capture("test", recs))
    assert keys(report) == {("grouped", "channels_in", 12, "high"), ("grouped", "channels_out", 12, "high"),
                            ("*", "layout", None, "medium")}
    layout = next(f for f in report.findings if f.dimension == "layout")
    assert layout.layers == ("stem", "grouped")  # one finding for the model, depthwise not counted
    assert {(n.layer, n.dimension) for n in report.notes} == {("stem", "first_conv"), ("dw", "depthwise")}
    cin = next(f for f in report.findings if f.dimension == "channels_in")
    assert cin.param_cost == 4 * 12 * (16 - 12) * 9  # groups * K/g * delta C/g * R*S
    nhwc = analyze(Capture("test", [OpRecord.conv("Conv2D", "c", Pass.FORWARD, "float16", in_channels=64,
                                                  out_channels=64, groups=1, kernel_elems=9, layout="NHWC")]))
    assert nhwc.findings == []


def test_vocabulary_and_rnn_dimensions_match_by_value():
    cap = Capture("test", global_dims=(ModelDim(Role.VOCAB, 50257, lin_params=64),))
    cap.records = [OpRecord.gemm("mm", "head", Pass.FORWARD, "float16", m=128, n=50257, k=64)]
    cap.layers["lstm"] = LayerInfo("lstm", "LSTM", dims=(
        ModelDim(Role.RNN_HIDDEN, 30, gemm_values=(30, 120), quad_params=4, lin_params=4 * 22),
        ModelDim(Role.RNN_INPUT, 20, lin_params=120)))
    cap.records += [OpRecord.gemm("MatMul", "lstm", Pass.FORWARD, "float16", m=8, n=120, k=20),
                    OpRecord.gemm("MatMul", "lstm", Pass.FORWARD, "float16", m=8, n=120, k=30)]
    report = analyze(cap)
    # The LSTM's GEMMs are 0.2 % of this capture's FLOPs (beside a 50257-row head): low, by cost.
    assert keys(report) == {("head", "vocab", 50257, "high"), ("lstm", "rnn_hidden", 30, "low"),
                            ("lstm", "rnn_input", 20, "low")}
    by_dim = {f.dimension: f for f in report.findings}
    # A vocabulary is padded to the 128-byte multiple (64 rows in float16): 50304, as nanoGPT does.
    assert by_dim["vocab"].suggested == 50304 and by_dim["vocab"].param_cost == 47 * 64
    assert by_dim["rnn_hidden"].param_cost == 4 * (32 * 32 - 30 * 30) + 88 * 2


def test_matrix_vector_products_are_memory_bound():
    cap = Capture("test", [OpRecord.gemm("mm", "fc", Pass.FORWARD, "float16", m=1, n=50, k=30)],
                  {"fc": linear("fc", 30, 50)})
    assert analyze(cap).findings == []


@settings(max_examples=60, deadline=None)
@given(n_in=st.integers(2, 300), n_out=st.integers(2, 300), tokens=st.integers(2, 300),
       dtype=st.sampled_from(["float16", "bfloat16", "tfloat32", "int8"]))
def test_findings_are_exactly_the_misaligned_dimensions(n_in, n_out, tokens, dtype):
    if len({n_in, n_out, tokens}) < 3:
        return  # equal sizes are indistinguishable by value (documented limitation)
    mult = required_multiple(dtype)
    dims = ((Role.FEATURES_IN, n_in), (Role.FEATURES_OUT, n_out))
    expected = {("fc", role, v, "high") for role, v in dims if v % mult}
    if tokens % mult:
        expected.add(("*", "tokens", tokens, "low"))
    report = analyze(mlp_capture(n_in, n_out, tokens, dtype))
    assert keys(report) == expected
    for f in report.findings:
        assert f.suggested % mult == 0 and 0 < f.suggested - f.value < mult


def test_gemm_shape_helpers():
    assert matmul_gemm((8, 16, 64), (64, 50257)) == (1, 128, 50257, 64)
    assert matmul_gemm((4, 16, 50), (4, 50, 16)) == (4, 16, 16, 50)
    assert matmul_gemm((16, 32), (16, 64), transpose_a=True) == (1, 32, 64, 16)
    assert matmul_gemm((None, 32), (32, 64)) is None
    assert einsum_gemm("abc,cde->abde", (8, 16, 200), (200, 4, 50)) == (1, 128, 200, 200)
    assert einsum_gemm("BNTS,BSNH->BTNH", (8, 4, 16, 16), (8, 16, 4, 50)) == (32, 16, 50, 16)
    assert einsum_gemm("ab,bc,cd->ad", (2, 3), (3, 4)) is None


def test_report_table_markdown_json_and_severity_helpers():
    report = analyze(mlp_capture(50, 64, 30))
    assert report.has("high") and report.has("low") and not report.has("medium")
    assert report.has_at_least("medium") and [f.severity for f in report.at_least("low")] == ["high", "low"]
    table = str(report).splitlines()
    assert table[0].split() == ["severity", "layer", "dimension", "value", "multiple", "suggested", "+params",
                                "FLOPs", "fix", "/", "note"]
    assert table[1].split()[:6] == ["high", "fc", "features_in", "50", "8", "56"]
    md = report.to_markdown()
    assert "| high | fc | features_in | 50 | 8 | 56 | 384 | 100.0% | pad the data to 56 |" in md
    data = json.loads(report.to_json())
    assert data["findings"][0]["dimension"] == "features_in" and data["findings"][1]["layers"] == ["fc"]
    assert Finding(**{**data["findings"][0], "layers": tuple(data["findings"][0]["layers"]),
                      "ops": tuple(data["findings"][0]["ops"]),
                      "passes": tuple(data["findings"][0]["passes"])}) == report.findings[0]
    with pytest.raises(ValueError, match="severity must be one of"):
        report.has("critical")
    empty = analyze(mlp_capture(64, 64, 32))
    assert not empty and "No Tensor Core alignment findings" in str(empty)
    assert "No alignment findings" in empty.to_markdown()


def test_audit_flags_float16_policy_variables_softmax_and_loss():
    info = PrecisionInfo("tensorflow", "float16", [
        LayerPrecision("fc", "Dense", "float16", ("float16",)),
        LayerPrecision("bn", "BatchNormalization", "float16", ("float16",), kind="normalization"),
        LayerPrecision("out", "Dense", "float16", ("float16",), is_output=True, activation="softmax")],
        [OpPrecision("Log", "float16", "", in_loss=True), OpPrecision("Exp", "float16", "fc"),
         OpPrecision("Sum", "float16", "fc", pass_=Pass.BACKWARD), OpPrecision("MatMul", "float16", "fc")])
    findings, categories = run_audit(info)
    assert {(f.check, f.layer, f.severity) for f in findings} == {
        ("global_policy", "*", "high"), ("variable_dtype", "fc", "high"), ("variable_dtype", "bn", "high"),
        ("variable_dtype", "out", "high"), ("float16_normalization", "bn", "high"),
        ("float16_softmax", "out", "high"), ("float16_loss", "", "high"), ("float16_deny_op", "fc", "low")}
    assert categories == {"allow": {"float16": 1}, "deny": {"float16": 3}}


def test_audit_is_silent_on_a_correct_mixed_float16_model():
    info = PrecisionInfo("tensorflow", "mixed_float16", [
        LayerPrecision("fc", "Dense", "float16", ("float32",)),
        LayerPrecision("ln", "LayerNormalization", "float16", ("float32",), kind="normalization"),
        LayerPrecision("out", "Activation", "float32", (), is_output=True, activation="softmax")],
        [OpPrecision("MatMul", "float16", "fc"), OpPrecision("Softmax", "float32", "out", is_output=True),
         OpPrecision("Sum", "float16", "fc", pass_=Pass.BACKWARD)])
    assert run_audit(info)[0] == []


def test_op_categories_follow_the_graph_rewrite_lists():
    assert [categorize(op) for op in ("MatMul", "Einsum", "Softmax", "Exp", "AddV2", "AvgPool", "Relu",
                                      "Reshape", "SomethingElse")] == [
        "allow", "allow", "deny", "deny", "infer", "infer", "clear", "clear", "other"]
    assert [categorize(op, "torch") for op in ("addmm", "_softmax", "add", "relu")] == [
        "allow", "deny", "infer", "clear"]
