"""LossScaleCallback: quiet defaults in Keras' logs, arguments and extras checked at construction, one W&B run
per fit even after a crash (issues 19, 20, 24)."""

import csv
import glob
import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from keras_scripts.toy import build_model, make_data  # noqa: E402

from lossscale_callbacks._metrics import METRIC_NAMES, SCALE, SKIPPED_STEPS  # noqa: E402
from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks._sinks import InMemorySink  # noqa: E402
from lossscale_callbacks.keras._callback import LossScaleCallback  # noqa: E402

POLICY = DynamicPolicy(initial_scale=256.0, growth_interval=4, max_scale=4096.0)


@pytest.fixture(autouse=True)
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _fit(callbacks, epochs=1, batches=4, poisoned=(1,), verbose=0):
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
    x, y = make_data(batches, poisoned=poisoned)
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, callbacks=callbacks, verbose=verbose)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensorboard": ""}, "tensorboard must be None or a non-empty"),
    ({"wandb": {"mode": "nonsense"}}, "mode must be one of"),
    ({"wandb": {"projekt": "x"}}, "wandb.init"),
    ({"sinks": None}, "sinks must be an iterable"),
    ({"log_metrics": ["loss_scale/nope"]}, "log_metrics"),
])
def test_bad_sink_arguments_are_refused_at_construction_not_in_fit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleCallback(**kwargs)


@pytest.mark.slow
def test_keras_logs_get_the_scale_and_the_skips_only_while_the_sinks_get_everything(capsys):
    batch_keys, memory = [], InMemorySink()
    spy = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batch_keys.append(
        sorted(k for k in logs if k.startswith("loss_scale/"))))
    history = _fit([LossScaleCallback(log_every=2, policy=POLICY, sinks=[memory]), spy], epochs=2)
    assert batch_keys[0] == [] and batch_keys[1] == sorted([SCALE, SKIPPED_STEPS])  # read at step 2
    # The epoch logs (History, CSVLogger, EarlyStopping) get ours only when asked for.
    assert [k for k in history.history if k.startswith("loss_scale/")] == []
    assert set(memory.records[0][1]) >= set(METRIC_NAMES)  # the sinks have the whole schema
    chosen = [SCALE, SKIPPED_STEPS]
    asked = _fit([LossScaleCallback(log_every=2, policy=POLICY, log_metrics=chosen)], epochs=2)
    assert sorted(k for k in asked.history if k.startswith("loss_scale/")) == sorted([SCALE, SKIPPED_STEPS])
    assert asked.history[SKIPPED_STEPS] == [1, 2]
    # The progress bar shows the two values, nothing else of ours.
    capsys.readouterr()
    _fit([LossScaleCallback(log_every=2, policy=POLICY, health=None)], poisoned=(), verbose=1)
    bar = capsys.readouterr().out.split("Loss scaling:")[0]  # what the progress bar printed
    assert "loss_scale/scale: " in bar and "loss_scale/skipped_steps: " in bar
    assert "skipped_in_interval" not in bar and "growth_counter" not in bar and "skip_rate" not in bar


HIDDEN = """
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorboard":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
from lossscale_callbacks.keras._callback import LossScaleCallback
try:
    LossScaleCallback(tensorboard="runs/x")
except ImportError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.slow
def test_tensorboard_without_its_extra_fails_at_construction_with_the_pip_command():
    out = subprocess.run([sys.executable, "-c", HIDDEN], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("MissingExtraError"), out.stdout + out.stderr[-2000:]
    assert 'pip install "lossscale-callbacks[tensorboard]"' in out.stdout


class _Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("simulated crash")


@pytest.mark.slow
def test_a_crashed_fit_has_its_wandb_run_finished_before_the_next_fit_opens_its_own(tmp_path, monkeypatch):
    wandb_reader = pytest.importorskip("lossscale_callbacks.wandb._reader")
    monkeypatch.setenv("WANDB_MODE", "offline")
    callback = LossScaleCallback(log_every=1, policy=POLICY, health=None,
                                 wandb={"dir": str(tmp_path), "project": "t", "mode": "offline"})
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
    x, y = make_data(4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[callback, _Crash()])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[callback])
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2
    for run in runs:
        wandb_reader.wait_until_finished(run)  # the crashed fit's run was finished too
    steps = sorted(wandb_reader.read_run(run)["loss_scale/steps"][-1][1] for run in runs)
    assert steps == [3.0, 7.0]  # 3 steps before the crash; the second fit's 4 more, its own run


@pytest.mark.slow
def test_csvlogger_without_validation_gets_no_loss_scale_columns_by_default(tmp_path):
    """Keras' CSVLogger adds a val_ twin of every epoch-log key when there is no validation data."""
    csv_path = tmp_path / "log.csv"
    _fit([LossScaleCallback(log_every=2, policy=POLICY), keras.callbacks.CSVLogger(str(csv_path))], epochs=2)
    columns = csv_path.read_text().splitlines()[0].split(",")
    assert "loss" in columns and "val_loss" in columns  # Keras' own doubling, unchanged
    assert [c for c in columns if "loss_scale/" in c] == []


@pytest.mark.parametrize("poisoned, shown", [((), "0"), ((1,), "1")])
def test_the_progress_bar_shows_the_skipped_steps_as_an_integer(tmp_path, capsys, poisoned, shown):
    """Issue 30: the bar showed ``loss_scale/skipped_steps: 0.0000e+00``."""
    csv_logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    history = _fit([LossScaleCallback(log_every=2, policy=POLICY, health=None, log_metrics=[SKIPPED_STEPS]),
                    csv_logger], poisoned=poisoned, verbose=1)
    bar = capsys.readouterr().out.split("Loss scaling:")[0]
    assert f"loss_scale/skipped_steps: {shown} " in bar or bar.rstrip().endswith(f"skipped_steps: {shown}")
    assert "e+00" not in bar
    assert history.history[SKIPPED_STEPS] == [float(shown)]  # History keeps a number
    (row,) = csv.DictReader(open(tmp_path / "log.csv"))
    assert row[SKIPPED_STEPS] == shown  # as the int it was before
