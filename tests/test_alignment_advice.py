"""The alignment vocabulary (str enums), framework-free engine words with the framework's own advice, and
``lossscale_callbacks.alignment.check_alignment`` dispatching to the model's framework."""

from __future__ import annotations

import json
import sys
import types
from importlib.metadata import EntryPoint

import pytest

from lossscale_callbacks.alignment import _checkers as checkers
from lossscale_callbacks.alignment._audit import LayerPrecision, PrecisionInfo
from lossscale_callbacks.alignment._records import (
    Capture,
    FrameworkAdvice,
    GemmDim,
    LayerInfo,
    ModelDim,
    OpKind,
    OpRecord,
    Pass,
    Role,
)
from lossscale_callbacks.alignment._rules import analyze

# Words that only a framework's API would use: the engine must say none of them by itself.
FRAMEWORK_WORDS = ("torch", "keras", "autocast", "tf.", "model.half", "mixed_float16", "dtype_policy",
                   "filters", "in_channels", "out_channels", "data_format", "memory_format")


def test_the_vocabulary_is_three_str_enums_with_the_old_strings():
    assert [m.value for m in OpKind] == ["gemm", "conv"]
    assert [m.value for m in Pass] == ["forward", "backward", "input-gradient", "weight-gradient"]
    assert [m.value for m in Role] == ["features_in", "features_out", "features", "channels_in",
                                       "channels_out", "head_dim", "vocab", "embedding_dim", "rnn_hidden",
                                       "rnn_input", "tokens"]
    member = Role.FEATURES_IN
    assert member == "features_in" and hash(member) == hash("features_in")
    assert f"{member}={50}" == "features_in=50" and str(member) == "features_in"
    assert json.dumps({member: [Pass.FORWARD]}) == '{"features_in": ["forward"]}'


def test_records_take_the_strings_too_and_refuse_unknown_ones_by_field():
    op = OpRecord.gemm("addmm", "fc", "forward", "float16", m=32, n=64, k=50,
                       roles={"K": ("head_dim", None)})
    assert op.pass_ is Pass.FORWARD and op.kind is OpKind.GEMM and op.dims[2].role is Role.HEAD_DIM
    assert ModelDim("vocab", 50257).role is Role.VOCAB
    with pytest.raises(ValueError, match=r"^pass_ must be one of \['forward', 'backward', 'input-gradient', "
                                         r"'weight-gradient'\], got 'sideways'$"):
        OpRecord.gemm("mm", "fc", "sideways", "float16", m=8, n=8, k=8)
    with pytest.raises(ValueError, match=r"^role must be one of \['features_in', .*'tokens'\], got 'width'$"):
        ModelDim("width", 8)
    with pytest.raises(ValueError, match=r"^role must be one of .*got 'width'$"):
        GemmDim("M", 8, "width")
    with pytest.raises(ValueError, match=r"^kind must be one of \['gemm', 'conv'\], got 'pool'$"):
        OpRecord("pool", "max_pool2d", "fc", Pass.FORWARD, "float16", ())


def _everything() -> Capture:
    """A capture that triggers every finding and note the engine writes text for: a misaligned linear
    layer, 16-bit NCHW convolutions, a float32 layer with TF32 off, and the whole audit."""
    conv = OpRecord.conv("convolution", "conv", Pass.FORWARD, "float16", in_channels=20, out_channels=20,
                         groups=1, kernel_elems=9, layout="NCHW", output_elems=20 * 64)
    records = [
        OpRecord.gemm("addmm", "fc", Pass.FORWARD, "float16", m=32, n=64, k=50),
        conv,
        OpRecord.gemm("addmm", "fp32", Pass.FORWARD, "float32", m=32, n=64, k=64),
    ]
    layers = {"fc": LayerInfo("fc", "Linear", dims=(ModelDim(Role.FEATURES_IN, 50, lin_params=64),
                                                    ModelDim(Role.FEATURES_OUT, 64, lin_params=51))),
              "conv": LayerInfo("conv", "Conv2d")}
    precision = PrecisionInfo("test", "float16", [
        LayerPrecision("norm", "LayerNorm", "float16", ("float16",), kind="normalization"),
        LayerPrecision("out", "Dense", "float16", ("float16",), is_output=True, activation="softmax"),
        LayerPrecision("head", "Dense", "float16", ("float32",), is_output=True)])
    return Capture("test", records, layers, precision=precision)


def _texts(report) -> list[str]:
    return [*(f.message for f in [*report.findings, *report.notes]), *(f.fix for f in report.findings),
            *(a.message for a in report.audit)]


def test_the_engine_says_what_is_wrong_without_any_framework_api():
    report = analyze(_everything())
    dimensions = {f.dimension for f in [*report.findings, *report.notes]}
    assert {"features_in", "channels_in", "channels_out", "layout", "dtype"} <= dimensions
    assert {a.check for a in report.audit} == {"global_policy", "variable_dtype", "float16_normalization",
                                               "float16_softmax", "float16_output"}
    texts = _texts(report)
    assert [(text, word) for text in texts for word in FRAMEWORK_WORDS if word in text.lower()] == []
    layout = next(f for f in report.findings if f.dimension == "layout")
    assert layout.fix == "" and "NCHW" in layout.message and layout.suggested == "channels_last"
    assert next(f for f in report.findings if f.dimension == "channels_out").fix == ""


def test_the_capture_s_advice_names_the_fix_in_its_framework():
    capture = _everything()
    capture.advice = FrameworkAdvice(
        arguments={Role.CHANNELS_OUT: "width_out"}, fixes={"layout": "nhwc=True"},
        advice={"layout": "Call model.nhwc().", "variable_dtype": "Call model.master_weights().",
                "dtype": "Turn TF32 on."})
    report = analyze(capture)
    by_dimension = {f.dimension: f for f in [*report.findings, *report.notes]}
    assert by_dimension["layout"].fix == "nhwc=True"
    assert by_dimension["layout"].message.endswith("so every call transposes. Call model.nhwc().")
    assert by_dimension["channels_out"].fix == "width_out=24"
    assert by_dimension["channels_in"].fix == ""  # no argument given for it: no fix invented
    assert by_dimension["dtype"].message.endswith("to use Tensor Cores. Turn TF32 on.")
    audit = {a.check: a.message for a in report.audit}
    assert audit["variable_dtype"].endswith(" Call model.master_weights().")
    # No advice for it: the engine's sentence alone.
    assert audit["float16_output"] == ("the model output is float16; make the last layer float32 so the loss "
                                       "sees float32 values.")
    # The findings are plain strings, in their repr and in the JSON (the enums' values).
    assert repr(by_dimension["channels_out"]).startswith("Finding(layer='conv', dimension='channels_out'")
    assert json.loads(report.to_json())["findings"][0]["dimension"] in {"features_in", "channels_in",
                                                                        "channels_out", "layout"}


def _nchw_torch_model():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3))
    return model, torch.zeros(8, 16, 12, 12)


def test_torch_advice_is_torch_s():
    from lossscale_callbacks.torch._alignment import check_alignment

    model, sample = _nchw_torch_model()
    layout = next(f for f in check_alignment(model, sample, dtype="float16").findings
                  if f.dimension == "layout")
    assert layout.fix == "channels_last" and "model.to(memory_format=torch.channels_last)" in layout.message


@pytest.mark.slow
def test_keras_advice_is_keras_s_and_never_torch_s():
    pytest.importorskip("tensorflow")
    import keras

    from lossscale_callbacks.keras._alignment import check_alignment

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((16, 12, 12)),
                                  keras.layers.Conv2D(30, 3, data_format="channels_first", name="c1"),
                                  keras.layers.Conv2D(64, 3, data_format="channels_first", name="c2")])
        report = check_alignment(model, batch_size=8)
    finally:
        keras.config.set_dtype_policy(previous)
    by_dimension = {f.dimension: f for f in report.findings}
    assert by_dimension["layout"].fix == 'data_format="channels_last"'
    assert 'data_format="channels_last"' in by_dimension["layout"].message
    assert by_dimension["channels_out"].fix == "filters=32"
    assert all("torch" not in text for text in _texts(report))


def test_check_alignment_dispatches_to_the_model_s_framework():
    from lossscale_callbacks.alignment import check_alignment
    from lossscale_callbacks.torch._alignment import check_alignment as torch_check

    model, sample = _nchw_torch_model()
    ours = check_alignment(model, sample, dtype="float16")
    assert ours.framework == "torch" and ours.findings == torch_check(model, sample, dtype="float16").findings
    with pytest.raises(ValueError, match="dtype is required"):  # the torch check's own arguments apply
        check_alignment(model, sample)
    with pytest.raises(ValueError, match=r"model must be a keras\.Model or a torch\.nn\.Module, got list"):
        check_alignment([1, 2, 3])


def test_check_alignment_finds_the_capture_through_the_entry_points_first(monkeypatch):
    from lossscale_callbacks.alignment import check_alignment

    seen = []
    fake = types.ModuleType("fake_torch_checker")
    fake.check_alignment = lambda model, sample, **kw: seen.append((model, sample, kw)) or "fake report"
    monkeypatch.setitem(sys.modules, "fake_torch_checker", fake)
    point = EntryPoint("torch", "fake_torch_checker", checkers.ENTRY_POINT_GROUP)
    monkeypatch.setattr(checkers, "entry_points", lambda group: [point] if group == point.group else [])
    model, sample = _nchw_torch_model()
    assert check_alignment(model, sample, dtype="bfloat16") == "fake report"
    assert seen == [(model, sample, {"dtype": "bfloat16"})]
