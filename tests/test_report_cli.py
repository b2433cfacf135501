"""``lossscale-callbacks report``: plain-words summary, PNG, JSON equal to the written values, exit 2."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import wandb
from repo_scripts import load_script
from report_json import the_read_run

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks import _metrics as m
from lossscale_callbacks._cli import main
from lossscale_callbacks.report._report_cli import write_png
from lossscale_callbacks.report._run_readers import READER_GROUP, load_reader
from lossscale_callbacks.report._run_report import build_report
from lossscale_callbacks.tensorboard import TensorBoardSink
from lossscale_callbacks.wandb import WandbSink
from lossscale_callbacks.wandb._reader import wait_until_finished

CLI = Path(sys.executable).with_name("lossscale-callbacks")


def train(sinks, steps=2000, log_every=100, policy=None):
    example = load_script("examples/plain_loop_sinks.py")
    return example.train(sinks, steps=steps, log_every=log_every, policy=policy)


@pytest.fixture(autouse=True)
def no_run_left_behind():
    yield
    if wandb.run is not None:
        wandb.run.finish()


def expected_numbers(written):
    step, last = written[-1]
    scales = [metrics[m.SCALE] for _, metrics in written]
    return {
        "steps": step,
        "skipped_steps": int(last[m.SKIPPED_STEPS]),
        "skip_rate": last[m.SKIPPED_STEPS] / step,
        "final_scale": last[m.SCALE],
        "min_scale_seen": min(scales),
        "max_scale_seen": max(scales),
        "log_points": len(written),
    }


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tb") / "run"
    policy = DynamicPolicy(initial_scale=2.0**16, growth_interval=200)
    written = train([TensorBoardSink(folder)], policy=policy)
    return folder, written


def test_readers_are_found_through_entry_points():
    from importlib.metadata import entry_points

    names = {entry.name for entry in entry_points(group=READER_GROUP)}
    assert {"tensorboard", "wandb"} <= names
    assert all(callable(load_reader(name)) for name in ("tensorboard", "wandb"))


def test_report_on_a_tensorboard_run_prints_the_summary_and_writes_a_png(tensorboard_run, tmp_path, capsys):
    folder, written = tensorboard_run
    expected = expected_numbers(written)
    png = tmp_path / "scale.png"
    assert main(["report", str(folder), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"Optimizer steps attempted: {expected['steps']}" in out
    skipped = f"{expected['skipped_steps']} ({expected['skip_rate']:.2%})"
    assert f"Skipped steps (Inf/NaN gradients): {skipped}" in out
    assert f"final {expected['final_scale']:g}" in out
    assert f"ranged from {expected['min_scale_seen']:g} to {expected['max_scale_seen']:g}" in out
    assert "Steps at the minimum scale (1)" in out and "Health: OK" in out
    assert png_size(png) == (900, 600)


def test_json_numbers_equal_the_written_ones(tensorboard_run, capsys):
    folder, written = tensorboard_run
    assert main(["report", str(folder), "--json"]) == 0
    payload = the_read_run(capsys.readouterr().out)
    for key, value in expected_numbers(written).items():
        assert payload[key] == value, key
    assert payload["reader"] == "tensorboard" and payload["healthy"] is True and payload["verdicts"] == []
    assert payload["min_scale"] == 1.0 and payload["png"] is None


def test_report_on_a_wandb_offline_run(tmp_path, capsys):
    written = train([WandbSink(project="t", dir=str(tmp_path), mode="offline")])
    capsys.readouterr()  # the training loop's own summary
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wait_until_finished(str(run_dir))
    (run_file,) = run_dir.glob("*.wandb")
    for path in (tmp_path, tmp_path / "wandb", run_dir, run_file):
        assert main(["report", str(path), "--json"]) == 0
        payload = the_read_run(capsys.readouterr().out)
        assert payload["reader"] == "wandb"
        for key, value in expected_numbers(written).items():
            assert payload[key] == value, (path, key)


def test_health_problems_are_reported_in_plain_words(tmp_path, capsys):
    # A collapsed run: the scale sits at its minimum and every step is skipped.
    sink = TensorBoardSink(tmp_path)
    for step in range(100, 2100, 100):
        sink.write(step, {m.SCALE: 1.0, m.GROWTH_COUNTER: 0.0, m.SKIPPED_STEPS: float(step),
                          m.SKIPPED_IN_INTERVAL: 100.0, m.SKIP_RATE: 1.0})
    sink.close()
    assert main(["report", str(tmp_path), "--png", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "Health: 3 problem(s) found." in out
    assert "consecutive_skips" in out and "skip_rate" in out and "stuck_at_min_scale" in out
    assert "Steps at the minimum scale (1): about 1900" in out
    png_size(tmp_path / "p.png")


def test_min_scale_comes_from_the_run_or_the_option():
    series = {m.SCALE: [(100, 4.0), (200, 4.0)], "loss_scale/min_scale": [(100, 4.0), (200, 4.0)]}
    assert build_report("r", series).steps_at_min_scale == 100
    assert build_report("r", series, min_scale=1.0).steps_at_min_scale == 0


def test_a_run_without_skipped_steps_does_not_claim_zero_skips(tmp_path):
    series = {m.SCALE: [(100, 1024.0), (200, 2048.0)]}
    report = build_report("r", series)
    assert report.skipped_steps is None and report.skip_rate is None
    assert report.to_json()["skipped_steps"] is None
    text = report.text()
    assert "not logged by this run" in text and "could not be judged" in text and "Health: OK" not in text
    png = tmp_path / "p.png"
    write_png(report, str(png))
    png_size(png)
    logged = build_report("r", {**series, m.SKIPPED_STEPS: [(100, 0.0), (200, 0.0)]})
    assert (logged.skipped_steps, logged.skip_rate) == (0, 0.0)
    # 200 steps are too few to tell whether the scale recovers: said, not called OK.
    assert "Health: no problem found, but not everything could be judged" in logged.text()


def _one_line_error(code, err, out=""):
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lossscale-callbacks report: error: ") and "Traceback" not in err
    return lines[0]


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt_tb = tmp_path / "corrupt_tb"
    corrupt_tb.mkdir()
    (corrupt_tb / "events.out.tfevents.1.host").write_bytes(random.Random(3).randbytes(300))
    corrupt_wandb = tmp_path / "offline-run-20250101_000000-abc"
    corrupt_wandb.mkdir()
    # A chunk header of a kind no writer uses (9): corrupt, not a copy cut short (random bytes would be
    # the latter now and then, see test_wandb_sink.test_reader_errors).
    (corrupt_wandb / "run-abc.wandb").write_bytes(b":W&B\xe1\xbe\x00" + struct.pack("<IHB", 0, 10, 9)
                                                   + random.Random(3).randbytes(293))
    not_a_run = tmp_path / "notes.txt"
    not_a_run.write_text("hello")
    no_scale = tmp_path / "no_scale"
    sink = TensorBoardSink(no_scale)
    sink.write(1, {"epoch_loss": 0.5})
    sink.close()
    zero_scale = tmp_path / "zero_scale"
    sink = TensorBoardSink(zero_scale)
    sink.write(1, {m.SCALE: 1.0, m.SKIPPED_STEPS: 0.0})
    sink.write(2, {m.SCALE: 0.0, m.SKIPPED_STEPS: 0.0})
    sink.close()
    cases = {
        tmp_path / "missing": "no such file",
        empty: "no TensorBoard or W&B run here",
        corrupt_tb: "corrupt TensorBoard event file",
        corrupt_wandb: "corrupt W&B run file",
        not_a_run: "no loss-scale lines in 1 line (formats known:",  # a text file says what it is
        no_scale: "no loss_scale/scale series",
        zero_scale: "holds 0.0 at step 2: not a loss scale",
    }
    for path, message in cases.items():
        code = main(["report", str(path)])
        captured = capsys.readouterr()
        assert message in _one_line_error(code, captured.err, captured.out), path


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "big"])
def test_bad_min_scale_option_exits_2_naming_it(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path), "--min-scale", value])
    assert exc.value.code == 2
    assert "--min-scale" in capsys.readouterr().err


def test_unwritable_png_exits_2(tensorboard_run, tmp_path, capsys):
    folder, _ = tensorboard_run
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = main(["report", str(folder), "--png", str(blocker / "p.png")])
    captured = capsys.readouterr()
    assert "cannot write" in _one_line_error(code, captured.err)


def test_the_console_script_gives_no_traceback(tensorboard_run, tmp_path):
    folder, written = tensorboard_run
    bad = subprocess.run([str(CLI), "report", str(tmp_path / "nothing-here")], capture_output=True, text=True,
                         timeout=60)
    _one_line_error(bad.returncode, bad.stderr, bad.stdout)
    good = subprocess.run([str(CLI), "report", str(folder), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert good.returncode == 0, good.stderr
    assert the_read_run(good.stdout)["steps"] == written[-1][0]


def test_keras_tensorboard_callback_tags_are_understood(tmp_path, capsys):
    # Keras' TensorBoard callback writes logs as train/batch_<name> (per batch) and train/epoch_<name>.
    train_dir, validation_dir = tmp_path / "logs" / "train", tmp_path / "logs" / "validation"
    keras_like = TensorBoardSink(train_dir)
    for step in (10, 20, 30):
        keras_like.write(step, {"batch_" + m.SCALE: 2.0**step, "batch_" + m.SKIPPED_STEPS: 1.0,
                                "batch_loss": 0.1})
    keras_like.write(1, {"epoch_" + m.SCALE: 2.0**30, "epoch_loss": 0.1})
    keras_like.close()
    validation = TensorBoardSink(validation_dir)
    validation.write(1, {"epoch_loss": 0.2})
    validation.close()
    assert main(["report", str(tmp_path / "logs"), "--json"]) == 0
    payload = the_read_run(capsys.readouterr().out)
    assert (payload["steps"], payload["skipped_steps"], payload["final_scale"]) == (30, 1, 2.0**30)

    only_epochs = TensorBoardSink(tmp_path / "epochs")
    only_epochs.write(1, {"epoch_" + m.SCALE: 4.0})
    only_epochs.close()
    code = main(["report", str(tmp_path / "epochs")])
    assert "per-epoch" in _one_line_error(code, capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------
# Runs written by the framework integrations


@pytest.mark.slow
def test_report_on_a_keras_run(tmp_path, capsys):
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    import numpy as np

    from lossscale_callbacks._sinks import InMemorySink
    from lossscale_callbacks.keras import LossScaleCallback
    from lossscale_callbacks.tensorboard._reader import read_run

    log_dir = tmp_path / "logs"
    memory = InMemorySink()
    # A first scale of 2**24 overflows float16 gradients: the run skips steps until it settles.
    policy = DynamicPolicy(initial_scale=2.0**24, growth_interval=6)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(160, 4)).astype("float32")
        y = (x @ np.array([[50.0], [-20.0], [10.0], [40.0]], dtype="float32"))
        callbacks = [
            # ours first: Keras hands one logs dict down the list
            LossScaleCallback(log_every=2, policy=policy, sinks=[memory], health=None,
                              tensorboard=str(log_dir / "train")),
            keras.callbacks.TensorBoard(str(log_dir), update_freq=1, write_graph=False),
        ]
        model.fit(x, y, batch_size=8, epochs=2, callbacks=callbacks, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    capsys.readouterr()  # the callback's own end-of-run paragraph
    step, last = memory.records[-1]
    assert step == 40 and last[m.SKIPPED_STEPS] > 0
    # Our sink and Keras' TensorBoard callback share the train/ run folder.
    series = read_run(str(log_dir / "train"))
    ours = dict(series[m.SCALE])
    assert ours == {s: metrics[m.SCALE] for s, metrics in memory.records}
    assert dict(series["batch_" + m.SCALE]).items() <= ours.items()
    for path in (log_dir, log_dir / "train"):
        png = tmp_path / "keras.png"
        assert main(["report", str(path), "--json", "--png", str(png)]) == 0
        payload = the_read_run(capsys.readouterr().out)
        assert payload["steps"] == step and payload["skipped_steps"] == int(last[m.SKIPPED_STEPS])
        assert payload["final_scale"] == last[m.SCALE] and payload["log_points"] == len(ours)
        png_size(png)
    assert main(["report", str(log_dir)]) == 0
    out = capsys.readouterr().out
    assert f"Optimizer steps attempted: {step}" in out and "Skipped steps" in out and "Health:" in out


@pytest.mark.slow
def test_report_on_a_lightning_run(tmp_path, capsys):
    pl = pytest.importorskip("lightning.pytorch")
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    x = torch.randn(160, 4)
    y = x @ torch.tensor([[50.0], [-20.0], [10.0], [40.0]])
    logger = pl.loggers.TensorBoardLogger(str(tmp_path / "tb"), name="run", version=0)
    plugin = LossScalePlugin("16-mixed", device="cpu", policy=DynamicPolicy(initial_scale=2.0**24,
                                                                             growth_interval=6))
    trainer = pl.Trainer(max_steps=20, plugins=[plugin], callbacks=[LossScaleMonitor(log_every=2,
                                                                                     health=None)],
                         logger=logger, accelerator="cpu", devices=1, log_every_n_steps=2,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, y), batch_size=8))
    capsys.readouterr()  # the monitor's own end-of-run paragraph
    state = plugin.scaler.get_state()
    assert state.steps == 20 and state.skipped_steps > 0

    png = tmp_path / "lightning.png"
    for path in (tmp_path / "tb", logger.log_dir):
        assert main(["report", str(path), "--json", "--png", str(png)]) == 0
        payload = the_read_run(capsys.readouterr().out)
        assert payload["steps"] == state.steps and payload["skipped_steps"] == state.skipped_steps
        assert payload["final_scale"] == state.scale and payload["log_points"] == 10
        png_size(png)
    assert main(["report", logger.log_dir]) == 0
    assert f"Skipped steps (Inf/NaN gradients): {state.skipped_steps}" in capsys.readouterr().out


# ---- many runs, CI use, pipes, odd files ----

def _loop_run(folder, steps, p_inf, seed=0, growth_interval=50):
    import numpy as np

    from lossscale_callbacks import LoggingLoop, initial_state, next_state

    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=growth_interval)
    loop = LoggingLoop(policy, sinks=[TensorBoardSink(folder)], log_every=25, health=None, echo=None)
    rng = np.random.default_rng(seed)
    state = initial_state(policy)
    for _ in range(steps):
        state = next_state(policy, state, bool(rng.random() > p_inf))
        loop.maybe_observe(int(state.steps), lambda: state)  # noqa: B023
    loop.finish(state)
    loop.close()


@pytest.fixture(scope="module")
def many_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("many") / "runs"
    _loop_run(root / "healthy", 2000, 0.005)
    _loop_run(root / "collapsing", 2000, 0.3, seed=1)
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "readme.txt").write_text("not a run")
    return root


def test_report_on_a_folder_of_runs_prints_one_row_per_run(many_runs, capsys):
    assert main(["report", str(many_runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "steps", "skipped", "skip", "rate", "final", "scale", "health"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"collapsing", "healthy"}
    assert "problem(s)" in rows["collapsing"] and rows["healthy"].rstrip().endswith("OK")
    assert main(["report", str(many_runs), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [os.path.basename(r["path"]) for r in payload["runs"]] == ["collapsing", "healthy"]
    healthy = payload["runs"][1]
    # --json carries the series, the summary text and the bounds
    assert healthy["series"][m.SCALE][0][0] == 25 and healthy["summary"].startswith("Run: ")
    assert healthy["bounds"] == {"min_scale": 1.0, "max_scale": 2.0**24}


def test_fail_unhealthy_exits_1_for_ci(many_runs, capsys):
    assert main(["report", str(many_runs / "healthy"), "--fail-unhealthy"]) == 0
    assert main(["report", str(many_runs), "--fail-unhealthy"]) == 1
    assert "1 of 2 run(s) unhealthy" in capsys.readouterr().err
    assert main(["report", str(many_runs)]) == 0  # without the option, a verdict is not an error


@pytest.mark.parametrize("name, ok", [("p.png", True), ("p.svg", True), ("p.pdf", True), ("p.jpg", False),
                                      ("p", False)])
def test_png_honours_the_extension_or_refuses_it(many_runs, tmp_path, capsys, name, ok):
    status = main(["report", str(many_runs / "healthy"), "--png", str(tmp_path / name)])
    if ok:
        assert status == 0
        data = (tmp_path / name).read_bytes()
        assert data[:4] == {"png": b"\x89PNG", "svg": b"<?xm", "pdf": b"%PDF"}[name.split(".")[-1]]
    else:
        assert status == 2 and not (tmp_path / name).exists()
        assert "must end in one of .png, .svg, .pdf" in capsys.readouterr().err


def test_piped_into_head_there_is_no_traceback(many_runs):
    command = f"{CLI} report {many_runs} --json | head -n 1"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "{"
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr


def test_a_fifo_named_like_an_event_file_in_a_sub_folder_does_not_hang_the_report(many_runs, tmp_path):
    import shutil

    root = tmp_path / "runs"
    shutil.copytree(many_runs / "healthy", root / "healthy")
    (root / "pipes").mkdir()
    os.mkfifo(root / "pipes" / "events.out.tfevents.123.host")
    out = subprocess.run([str(CLI), "report", str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Optimizer steps attempted: 2000" in out.stdout


def test_the_verdict_on_a_long_run_is_full_and_on_a_short_run_honest(tmp_path, capsys):
    _loop_run(tmp_path / "short", 120, 0.05)
    assert main(["report", str(tmp_path / "short")]) == 0
    out = capsys.readouterr().out
    assert "Health: OK" not in out and "low skip rate" not in out
    assert "the skip rate could not be judged: only 20 steps came after the 100-step warm-up" in out
    _loop_run(tmp_path / "long", 3000, 0.001, growth_interval=100)
    assert main(["report", str(tmp_path / "long")]) == 0
    assert "Health: OK (no run of 50 skipped steps in a row; at most 5.0% of the steps after" in \
        capsys.readouterr().out
