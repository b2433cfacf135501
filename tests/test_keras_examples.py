"""The Keras examples run as a user would run them (the quickstart is the README's demo)."""

import glob
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _run(script, cwd, merged=False):
    """The script's stdout (``merged``: stdout and stderr as one stream, as a terminal shows them)."""
    # A W&B run started earlier in this pytest process leaves WANDB_* variables (service
    # address, run id) behind; the example must start its own run, as a user's would.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", WANDB_MODE="offline", WANDB_SILENT="true", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.stderr or proc.stdout)[-3000:]
    return proc.stdout


# What TensorFlow's C++ start-up writes to stderr whatever TF_CPP_MIN_LOG_LEVEL says.
START_UP_NOISE = ("absl::InitializeLog", "oneDNN custom operations", "cpu_feature_guard",
                  "This TensorFlow binary is optimized")


@pytest.mark.slow
def test_keras_quickstart(tmp_path):
    # The demo (`python3 dev.py demo`), with stderr where a terminal shows it: no TensorFlow start-up lines.
    out = _run("keras_quickstart.py", tmp_path, merged=True)
    assert out.splitlines()[0] == "Epoch 1/4", out[:2000]
    assert not [line for line in out.splitlines() if any(noise in line for noise in START_UP_NOISE)]
    assert "Loss scaling: 256 optimizer steps" in out
    assert "Loss-scale trajectory" in out and "loss_scale/scale" in out  # progress bar shows the metrics
    # Overflow forensics, one sentence per finding: the cause, where the overflow started (the demo's
    # model overflows mostly in its first Dense layer, Keras' default name), the layers as a table,
    # the headroom against float16's maximum (never a negative "below").
    assert "skipped steps had Inf gradients with a finite loss: the scale was too high" in out
    assert "The overflow started in layer `dense` in " in out
    assert "| layer | overflow started here | non-finite gradients |" in out and "| `dense` | " in out
    assert "Largest scaled gradient at the last headroom sample: 2^" in out
    assert "(float16's max is 2^15.99)" in out and not re.search(r"2\^-[\d.]+ below", out)
    assert glob.glob(str(tmp_path / "runs" / "keras_quickstart" / "events.out.tfevents.*"))
    assert glob.glob(str(tmp_path / "runs" / "wandb" / "offline-run-*" / "*.wandb"))
    # The precision audit (issue 27): the layers to keep in float32 and the starting scale.
    keep = "Keep these layers in float32: `wo`, `add` (`keep_keras_layers_in_float32(model, ['wo', 'add'])`)"
    assert keep in out
    assert "Start the loss scale at 2^" in out
    bar = out.split("Loss-scale trajectory")[0]  # quiet by default (issue 19): the scale and the skips
    assert "loss_scale/skipped_steps" in bar and "loss_scale/skip_rate" not in bar


@pytest.mark.slow
def test_keras_custom_loop(tmp_path):
    out = _run("keras_custom_loop.py", tmp_path)
    assert "Loss scaling: 192 optimizer steps" in out and "applied steps (optimizer.iterations)" in out
