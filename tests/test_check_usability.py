"""``lossscale-callbacks check`` on the README's own Keras model: every finding says what to do, and a long
check says where its time goes (issue 30).

Runtime: about 25 s on 2 shared cores (a small model saved, then loaded and traced by Keras four times).
"""

from __future__ import annotations

import argparse
import io
import json

import pytest

keras = pytest.importorskip("keras")

from lossscale_callbacks.alignment._alignment_cli import add_check_parser, run_check  # noqa: E402


def _cli(argv):
    parser = argparse.ArgumentParser(prog="lossscale-callbacks")
    add_check_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture
def readme_model(tmp_path):
    """The README's Keras quick-start model, saved as a user would save it."""
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4, activation="softmax", dtype="float32")])
        model.save(tmp_path / "model.keras")
    finally:
        keras.config.set_dtype_policy(previous)
    return tmp_path / "model.keras"


def test_every_finding_on_the_readme_model_says_what_to_do(readme_model):
    out = io.StringIO()
    status = run_check(_cli(["check", str(readme_model), "--json"]), out=out)
    findings = json.loads(out.getvalue())["findings"]
    assert status == 1 and findings  # the data's 20 features cost this model most of its FLOPs
    assert all(f["fix"] for f in findings), findings
    (width,) = [f for f in findings if f["dimension"] == "features_in"]
    assert (width["value"], width["fix"]) == (20, "pad the data to 24")
    assert "width of the data the model reads" in width["message"]
    out = io.StringIO()
    run_check(_cli(["check", str(readme_model)]), out=out)
    row = next(line for line in out.getvalue().splitlines() if "features_in" in line)
    assert row.rstrip().endswith("pad the data to 24")


def test_progress_and_the_time_of_each_stage_are_said(readme_model):
    out, err = io.StringIO(), io.StringIO()
    run_check(_cli(["check", str(readme_model), "--progress", "on"]), out=out, err=err)
    stages = err.getvalue().splitlines()
    words = [line.split()[1] for line in stages]
    assert words == ["importing", "loading", "loaded", "traced", "rules"], stages
    assert "loaded 2 layers in " in stages[2] and " GEMM/convolution ops" in stages[3]
    lines = out.getvalue().splitlines()
    assert lines[-2].startswith("Time: importing Keras and TensorFlow ")
    assert ", loading the model (Keras) " in lines[-2] and ", the rules " in lines[-2]
    assert lines[-1].startswith("Exit status 1")
    quiet = io.StringIO()  # not a terminal: no progress unless asked for
    run_check(_cli(["check", str(readme_model)]), out=io.StringIO(), err=quiet)
    assert quiet.getvalue() == ""
