"""Keras graph capture: the zoo, the mixed-precision audit, the zero sample, the check command."""

from __future__ import annotations

import io
import json

import pytest

keras = pytest.importorskip("keras")

import numpy as np  # noqa: E402
from alignment_models.expected import CASES, finding_keys, note_keys  # noqa: E402
from alignment_models.reports import keras_report  # noqa: E402

from lossscale_callbacks.alignment._alignment_cli import add_check_parser, run_check  # noqa: E402
from lossscale_callbacks.alignment._records import Pass  # noqa: E402
from lossscale_callbacks.keras._alignment import capture, check_alignment, check_model_file  # noqa: E402


@pytest.fixture
def policy():
    """Set the global dtype policy for one test and always put the previous one back."""
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_model_gets_exactly_its_findings(name):
    before = keras.config.dtype_policy().name
    report = keras_report(name)
    assert keras.config.dtype_policy().name == before
    assert finding_keys(report) == CASES[name].findings, str(report)
    assert note_keys(report) == CASES[name].notes, str(report)


def _mlp(n_in=50, hidden=64, out=16, out_dtype=None, activation=None, norm=False):
    inp = keras.Input((n_in,))
    x = keras.layers.Dense(hidden, activation="relu", name="fc")(inp)
    if norm:
        x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.Dense(out, name="logits")(x)
    if activation:
        x = keras.layers.Activation(activation, dtype=out_dtype, name="probs")(x)
    return keras.Model(inp, x)


def test_forward_and_both_gradient_gemms_are_read_from_the_graph(policy):
    policy("mixed_float16")
    cap = capture(_mlp(), batch_size=32)
    seen = {(r.layer, r.pass_, tuple(d.value for d in r.dims), r.dtype) for r in cap.records}
    assert ("fc", Pass.FORWARD, (32, 64, 50), "float16") in seen
    assert ("fc", Pass.BACKWARD, (50, 64, 32), "float16") in seen  # dW = X^T dY: K = batch
    assert ("logits", Pass.BACKWARD, (32, 64, 16), "float16") in seen  # dX = dY W^T
    report = check_alignment(_mlp(), batch_size=32)
    assert [(f.layer, f.dimension, f.passes) for f in report.findings] == [
        ("fc", "features_in", (Pass.FORWARD, Pass.WEIGHT_GRADIENT))]


def test_explicit_sample_sets_the_batch_dimension(policy):
    policy("mixed_float16")
    report = check_alignment(_mlp(n_in=64), np.zeros((30, 64), "float32"))
    found = [(f.layer, f.dimension, f.value, f.severity) for f in report.findings]
    assert found == [("*", "tokens", 30, "low")]


def test_conv_backprops_are_split_into_input_and_weight_gradient(policy):
    policy("mixed_float16")
    inp = keras.Input((16, 16, 8))
    x = keras.layers.Conv2D(16, 3, name="c0")(inp)
    model = keras.Model(inp, keras.layers.Conv2D(30, 3, name="conv")(x))
    passes = {(r.layer, r.pass_) for r in capture(model).records}
    # The traced graph holds c0's input gradient too (TensorFlow prunes it only when running).
    assert passes == {("c0", Pass.FORWARD), ("c0", Pass.INPUT_GRADIENT), ("c0", Pass.WEIGHT_GRADIENT),
                      ("conv", Pass.FORWARD), ("conv", Pass.INPUT_GRADIENT), ("conv", Pass.WEIGHT_GRADIENT)}


def test_audit_flags_float16_output_softmax(policy):
    policy("mixed_float16")
    report = check_alignment(_mlp(activation="softmax", norm=True), batch_size=32)
    assert [(a.check, a.layer, a.severity) for a in report.audit] == [("float16_softmax", "probs", "high")]
    assert report.op_categories["deny"]["float16"] >= 1  # the Softmax op itself ran in half


def test_audit_flags_a_float16_global_policy(policy):
    policy("float16")
    report = check_alignment(_mlp(activation="softmax", out_dtype="float32", norm=True), batch_size=32)
    checks = {(a.check, a.layer, a.severity) for a in report.audit}
    assert ("global_policy", "*", "high") in checks
    assert {("variable_dtype", "fc", "high"), ("variable_dtype", "ln", "high"),
            ("float16_normalization", "ln", "high")} <= checks
    assert report.has("high")


def test_audit_is_silent_on_a_correct_mixed_float16_model(policy):
    policy("mixed_float16")
    model = _mlp(n_in=64, out=16, activation="softmax", out_dtype="float32", norm=True)
    loss = keras.losses.CategoricalCrossentropy()
    report = check_alignment(model, batch_size=32, loss=lambda y: loss(keras.ops.zeros_like(y), y))
    assert report.audit == [] and report.findings == []
    assert set(report.op_categories) >= {"allow", "deny", "infer", "clear"}
    assert set(report.op_categories["allow"]) == {"float16"}
    assert "No mixed-precision problems found." in report.to_markdown()


def test_a_float16_loss_is_flagged(policy):
    policy("float16")
    report = check_alignment(_mlp(n_in=64), batch_size=32,
                             loss=lambda y: keras.ops.mean(keras.ops.log(keras.ops.softmax(y))))
    assert ("float16_loss", "high") in {(a.check, a.severity) for a in report.audit}


def test_zero_sample_needs_known_input_shapes():
    inp = keras.Input((None, 8))
    model = keras.Model(inp, keras.layers.Dense(8)(inp))
    with pytest.raises(ValueError, match="unknown size"):
        check_alignment(model)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        check_alignment(_mlp(), batch_size=0)
    report = check_alignment(model, np.zeros((4, 16, 8), "float32"), tf32=True)
    assert report.findings == []


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="lossscale-callbacks")
    add_check_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_check_command_on_a_saved_model(tmp_path, policy):
    policy("mixed_float16")
    path = tmp_path / "model.keras"
    _mlp().save(path)
    out, err = io.StringIO(), io.StringIO()
    assert run_check(_cli(["check", str(path), "--batch-size", "32"]), out=out, err=err) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Tensor Core alignment check: model ")
    assert "precision mixed_float16" in lines[0]
    assert "batch size 32" in lines[0] and "(from model.keras)" in lines[0]
    assert "features_in" in out.getvalue() and "fc" in out.getvalue()
    assert lines[-1] == "Exit status 1: 1 finding(s) at or above --fail-on high; fix them or raise --fail-on."
    out = io.StringIO()
    args = _cli(["check", str(path), "--batch-size", "30", "--json", "--fail-on", "never"])
    assert run_check(args, out=out) == 0
    data = json.loads(out.getvalue())
    assert {(f["layer"], f["dimension"], f["value"]) for f in data["findings"]} == {
        ("fc", "features_in", 50), ("*", "tokens", 30)}
    report = check_model_file(str(path), batch_size=32, target="a100")
    assert report.target == "a100"
    err = io.StringIO()
    assert run_check(_cli(["check", str(tmp_path / "missing.keras")]), err=err) == 2
    assert "no such file" in err.getvalue()
    other = tmp_path / "model.onnx"
    other.write_bytes(b"")
    err = io.StringIO()
    assert run_check(_cli(["check", str(other)]), err=err) == 2 and "must end in" in err.getvalue()
    corrupt = tmp_path / "corrupt.keras"
    corrupt.write_bytes(b"not a zip archive")
    err = io.StringIO()
    assert run_check(_cli(["check", str(corrupt)]), err=err) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lossscale-callbacks check: error: ")
    assert "is not a model this check can read" in lines[0] and "Traceback" not in err.getvalue()
    err = io.StringIO()
    assert run_check(_cli(["check", str(tmp_path)]), err=err) == 2  # `check .`
    assert "is a directory: give a saved model file" in err.getvalue()
    with pytest.raises(SystemExit):
        _cli(["check", str(path), "--batch-size", "eight"])
