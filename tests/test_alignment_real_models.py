"""The alignment checker on models as people build them: Keras' default layer names, nested and shared
layers, keras.applications, and torch ResNet-50 / GPT-2 small / BERT-base / ViT-B/16 at full size.

Every case asserts the exact findings: the layer object whose argument must change, the argument, the
suggested value and the severity weighted by the model's FLOPs. A classifier head is never ``high``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(report) -> set:
    return {(f.layer, f.dimension, f.value, f.severity, f.fix) for f in report.findings}


# ------------------------------------------------------------------------------ Keras, default names


@pytest.fixture
def mixed_float16():
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    yield keras
    keras.config.set_dtype_policy(previous)


def test_keras_default_names_put_the_finding_on_the_layer_whose_units_change(mixed_float16):
    keras = mixed_float16
    from lossscale_callbacks.keras._alignment import check_alignment

    # The issue's model, built as tutorials build it: every name is Keras' own (dense, dense_1, ...).
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1001), keras.layers.Dense(1024),
                              keras.layers.Dense(10)])
    first, second, head = model.layers
    report = check_alignment(model, batch_size=64)
    assert rows(report) == {(first.name, "features_out", 1001, "high", "units=1008"),
                            (head.name, "features_out", 10, "low", "units=16")}
    (finding,) = [f for f in report.findings if f.value == 1001]
    # One row for the fix: the GEMMs of both layers that see 1001 (dense's N, dense_1's K).
    assert finding.layers == (first.name, second.name) and finding.flop_share > 0.99
    assert f"It feeds `{second.name}`" in finding.message
    assert finding.param_cost == 7 * (1024 + 1) + 7 * 1024


def test_keras_default_names_conv_then_conv(mixed_float16):
    keras = mixed_float16
    from lossscale_callbacks.keras._alignment import check_alignment

    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(30, 3),
                              keras.layers.Conv2D(64, 3), keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(10, dtype="float32")])
    conv, conv_1 = model.layers[:2]
    report = check_alignment(model, batch_size=32)
    assert rows(report) == {(conv.name, "channels_out", 30, "high", "filters=32"),
                            # the float32 head runs as TF32 (multiple 4): 10 -> 12, a negligible cost
                            (model.layers[-1].name, "features_out", 10, "low", "units=12")}
    assert [(n.layer, n.dimension) for n in report.notes] == [(conv.name, "first_conv")]
    assert {f.layers for f in report.findings if f.value == 30} == {(conv.name, conv_1.name)}


def test_keras_one_dimension_is_one_row_even_across_precisions(mixed_float16):
    keras = mixed_float16
    from lossscale_callbacks.keras._alignment import check_alignment

    # 1001 is a float16 N of `dense` and a TF32 K of the float32 head: one row, the stricter multiple.
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1001),
                              keras.layers.Dense(16, dtype="float32")])
    report = check_alignment(model, batch_size=64, tf32=True)
    assert [(f.layer, f.value, f.required_multiple, f.suggested) for f in report.findings] == [
        (model.layers[0].name, 1001, 8, 1008)]


def test_targets_include_current_gpus():
    from lossscale_callbacks.alignment._targets import get_target

    assert {name: get_target(name).sm_count for name in ("l4", "RTX 4090", "h200", "B200")} == {
        "l4": 58, "RTX 4090": 128, "h200": 132, "B200": 148}
    with pytest.raises(ValueError, match="target must be one of"):
        get_target("k80")


def test_keras_nested_and_shared_layers_are_named_by_identity(mixed_float16):
    keras = mixed_float16
    from lossscale_callbacks.keras._alignment import check_alignment

    inner = keras.Sequential([keras.layers.Dense(1001), keras.layers.Dense(256)])
    shared = keras.layers.Dense(100)
    a, b = keras.Input((64,)), keras.Input((64,))
    merged = keras.layers.Concatenate()([shared(a), shared(b)])  # one layer, called twice
    out = keras.layers.Dense(1, dtype="float32")(inner(merged))
    model = keras.Model([a, b], out)
    report = check_alignment(model, batch_size=64)
    findings = {(f.layer, f.dimension, f.value): f for f in report.findings}
    assert set(findings) == {(shared.name, "features_out", 100),
                             (f"{inner.name}/{inner.layers[0].name}", "features_out", 1001)}
    assert findings[(shared.name, "features_out", 100)].fix == "units=104"
    assert findings[(f"{inner.name}/{inner.layers[0].name}", "features_out", 1001)].severity == "high"


# ---------------------------------------------------------------------------------- torch, same cases


def test_torch_default_names_match_keras():
    torch = pytest.importorskip("torch")
    from lossscale_callbacks.torch._alignment import check_alignment

    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(1024, 1001), nn.ReLU(), nn.Linear(1001, 1024), nn.Linear(1024, 10))
    assert rows(check_alignment(mlp, torch.zeros(64, 1024), dtype="float16")) == {
        ("0", "features_out", 1001, "high", "out_features=1008"),
        ("3", "features_out", 10, "low", "out_features=16")}
    convs = nn.Sequential(nn.Conv2d(3, 30, 3), nn.Conv2d(30, 64, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, 10))
    sample = torch.zeros(32, 3, 32, 32).to(memory_format=torch.channels_last)
    report = check_alignment(convs.to(memory_format=torch.channels_last), sample, dtype="float16")
    assert {(f.layer, f.dimension, f.value, f.fix) for f in report.findings if f.severity == "high"} == {
        ("0", "channels_out", 30, "out_channels=32")}
    assert not [f for f in report.findings if f.layer == "4" and f.severity == "high"]  # the head


# ------------------------------------------------------------------------------ keras.applications

KERAS_APPLICATIONS = {
    "ResNet50": set(),
    "MobileNetV2": set(),
    # The squeeze-and-excitation squeezes (input filters / 4) are narrow 1x1 convolutions on pooled
    # activations: misaligned, but a negligible share of the FLOPs.
    "EfficientNetB0": {(f"block{b}_se_reduce", "channels_out", v, "low", f"filters={s}") for b, v, s in [
        ("2a", 4, 8), ("2b", 6, 8), ("3a", 6, 8), ("3b", 10, 16), ("4a", 10, 16), ("4b", 20, 24),
        ("4c", 20, 24), ("5a", 20, 24), ("5b", 28, 32), ("5c", 28, 32), ("6a", 28, 32)]},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KERAS_APPLICATIONS))
def test_keras_applications(name, mixed_float16):
    keras = mixed_float16
    from lossscale_callbacks.keras._alignment import check_alignment

    model = getattr(keras.applications, name)(weights=None)
    report = check_alignment(model, batch_size=32)
    assert rows(report) == KERAS_APPLICATIONS[name], str(report)
    notes = {(n.dimension, n.value) for n in report.notes}
    assert ("first_conv", 3) in notes  # the RGB stem is not a finding
    depthwise = [n for n in report.notes if n.dimension == "depthwise"]
    assert bool(depthwise) == (name != "ResNet50")  # depthwise convolutions: notes, never findings
    # The float16 softmax of the applications' classifier is a precision problem, not an alignment one.
    assert {a.check for a in report.audit} == {"float16_softmax"}


# ------------------------------------------------------------------------------------ torch, real size

TORCH_MODELS = {
    # torchvision's ResNet-50 in the default NCHW layout: the stem is a note, the layout a finding.
    "resnet50": ({("*", "layout", None, "medium", "channels_last")}, {("conv1", "first_conv", 3)}),
    # GPT-2's tied head: the vocabulary, padded to 50304 (nanoGPT's figure), 27 % of the FLOPs.
    "gpt2": ({("lm_head", "vocab", 50257, "high", "out_features=50304")}, set()),
    # BERT's 30522-word vocabulary is only looked up (no MLM head here): not a GEMM, not a finding.
    "bert": (set(), set()),
    # ViT-B/16: 197 tokens (196 patches + class token) misalign the attention GEMMs, a low finding;
    # the patch embedding is the only convolution (0.4 % of the FLOPs): a low layout finding.
    "vit": ({("*", "tokens", 197, "low", ""), ("*", "layout", None, "low", "channels_last")},
            {("patch_embed", "first_conv", 3)}),
}


@pytest.mark.parametrize("name", sorted(TORCH_MODELS))
def test_torch_real_models(name):
    pytest.importorskip("torch")
    from alignment_models.torch_real import build

    from lossscale_callbacks.torch._alignment import check_alignment

    model, sample = build(name, batch=8)  # on the meta device: shapes only
    report = check_alignment(model, sample, dtype="float16")
    findings, notes = TORCH_MODELS[name]
    assert rows(report) == findings, str(report)
    assert {(n.layer, n.dimension, n.value) for n in report.notes} == notes
    if name == "gpt2":
        (vocab,) = report.findings
        assert vocab.suggested == 50304 and vocab.severity == "high" and 0.2 < vocab.flop_share < 0.35


# --------------------------------------------------------------------------- check on a huge batch


@pytest.mark.slow
def test_check_on_a_billion_batch_is_fast_and_small(tmp_path):
    pytest.importorskip("tensorflow")
    build = ("import keras; keras.config.set_dtype_policy('mixed_float16'); "
             "keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(30, 3), "
             "keras.layers.Flatten(), keras.layers.Dense(1001), "
             "keras.layers.Dense(10, dtype='float32')]).save('m.keras')")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    subprocess.run([sys.executable, "-c", build], cwd=tmp_path, env=env, check=True, timeout=120,
                   capture_output=True)
    # This one process's own CPU time and peak memory (wait4 on it; RUSAGE_CHILDREN would be the largest
    # of every child pytest has had, and wall time on a busy machine is not the work done).
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "lossscale_callbacks._cli", "check", "m.keras",
                                  "--batch-size", "1000000000"], cwd=tmp_path, env=env, stdout=out,
                                 stderr=err, text=True)
        deadline = time.monotonic() + 120
        while (waited := os.wait4(child.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                child.kill()
                pytest.fail("the check ran over 120 s")
            time.sleep(0.05)
        child.returncode = os.waitstatus_to_exitcode(waited[1])
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    usage = waited[2]
    cpu_s, peak_kib = usage.ru_utime + usage.ru_stime, usage.ru_maxrss
    assert child.returncode == 1, stderr[-2000:]
    assert "batch size 1,000,000,000" in stdout.splitlines()[0]
    assert "units=1008" in stdout and "filters=32" in stdout
    assert stderr == ""  # TensorFlow's start-up logging is silenced
    assert cpu_s < 30 and peak_kib < 2 * 1024 * 1024, (cpu_s, peak_kib)
