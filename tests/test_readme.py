"""The README's code blocks run as written, here in the test environment (tests/wheel_paths.py runs the
``# pip install`` ones again from a built wheel, each in a fresh venv with only its extras)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
GRAD_SCALER_START = 2.0**16  # torch.amp.GradScaler's init_scale, where Accelerate and Lightning start


def block_after(heading: str, index: int = 0) -> str:
    """The ``index``-th python block after the heading ``## heading`` (or ``### heading``)."""
    section = README.split(f"## {heading}\n", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def test_every_path_block_says_what_to_install_first():
    for heading in ("PyTorch", "Keras", "PyTorch Lightning", "Hugging Face Accelerate and Transformers",
                    "Dashboards and reports"):
        assert block_after(heading).startswith('# pip install "lossscale-callbacks['), heading


@pytest.mark.slow
def test_torch_block(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block_after("PyTorch"), namespace)
    state = namespace["scaler"].get_state()
    assert int(state.steps) == 300
    assert capsys.readouterr().out.startswith("Loss scaling: 300 optimizer steps")


def test_core_block():
    namespace = {"finite": False}
    exec(block_after("The core, in any loop"), namespace)
    state = namespace["state"]  # hysteresis=2: the first overflow is skipped without a backoff
    assert (float(state.scale), int(state.skipped_steps), int(state.hysteresis_left)) == (2.0**15, 1, 1)


@pytest.mark.slow
def test_keras_block(tmp_path, monkeypatch):
    import keras

    monkeypatch.chdir(tmp_path)
    previous = keras.mixed_precision.global_policy()
    try:
        namespace: dict = {}
        exec(block_after("Keras"), namespace)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert type(namespace["model"].optimizer).__module__ == "lossscale_callbacks.keras._optimizer"
    header, *rows = (tmp_path / "log.csv").read_text().splitlines()
    columns = header.split(",")
    # The two metrics asked for, in History/CSV; with validation data no NA val_loss_scale/* columns.
    ours = sorted(c for c in columns if "loss_scale/" in c)
    assert ours == ["loss_scale/scale", "loss_scale/skipped_steps"]
    last = rows[-1].split(",")
    assert len(rows) == 3 and float(last[columns.index("loss_scale/scale")]) == 2.0**15
    assert float(last[columns.index("loss_scale/skipped_steps")]) == 0.0
    assert any((tmp_path / "runs" / "exp1").rglob("events.out.tfevents.*"))


@pytest.mark.slow
def test_lightning_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    namespace: dict = {}
    exec(block_after("PyTorch Lightning"), namespace)
    trainer = namespace["trainer"]
    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin
    from lossscale_callbacks.tensorboard._reader import read_run

    assert isinstance(trainer.precision_plugin, LossScalePlugin)
    assert trainer.precision_plugin.scaler.policy.hysteresis == 2
    assert trainer.precision_plugin.scaler.policy.initial_scale == GRAD_SCALER_START  # issue 30
    (monitor,) = [cb for cb in trainer.callbacks if isinstance(cb, LossScaleMonitor)]
    assert monitor.summary.startswith("Loss scaling: 32 optimizer steps")
    (run,) = (tmp_path / "runs").rglob("events.out.tfevents.*")
    assert read_run(str(run.parent))["loss_scale/steps"][-1][1] == 32  # at Lightning's logging step


@pytest.mark.slow
def test_accelerate_block(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from hf_scripts.tiny_accelerate import reset_accelerate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reset_accelerate()
    namespace: dict = {}
    try:
        exec(block_after("Hugging Face Accelerate and Transformers"), namespace)
    finally:
        reset_accelerate()
    from lossscale_callbacks.tensorboard._reader import read_run

    assert namespace["monitor"].summary.startswith("Loss scaling: 16 optimizer steps")
    # Issue 30: the snippet starts where Accelerate's GradScaler would, not at half of it.
    assert namespace["accelerator"].scaler.policy.initial_scale == GRAD_SCALER_START
    (run,) = {path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    assert read_run(str(run))["loss_scale/steps"][-1] == (16, 16)


@pytest.mark.slow
def test_transformers_block(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from hf_scripts.tiny_accelerate import reset_accelerate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reset_accelerate()
    namespace: dict = {}
    try:
        exec(block_after("Hugging Face Accelerate and Transformers", 1), namespace)
    finally:
        reset_accelerate()
    assert namespace["trainer"].accelerator.scaler.policy.initial_scale == GRAD_SCALER_START
    assert "Loss scaling: 40 optimizer steps" in capsys.readouterr().out
    # Issue 30 acceptance 4: the file users read holds the scale (the Trainer copied the logs before).
    (saved,) = (tmp_path / "out").glob("checkpoint-*/trainer_state.json")
    history = json.loads(saved.read_text())["log_history"]
    scales = [(entry["step"], entry["loss_scale/scale"]) for entry in history if "loss_scale/scale" in entry]
    assert [step for step, _ in scales] == [10, 20, 30, 40] and all(scale > 0 for _, scale in scales)


def test_dashboards_block(tmp_path):
    """In a process of its own, as a user runs it: W&B fixes its folder at its first run in a process,
    so in this one (where other tests ran W&B first) its run would land in another test's folder."""
    (tmp_path / "block.py").write_text(block_after("Dashboards and reports"))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_DIR", None)
    done = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from lossscale_callbacks.tensorboard._reader import read_run
    from lossscale_callbacks.wandb._reader import read_run as read_wandb
    from lossscale_callbacks.wandb._reader import wait_until_finished

    assert read_run(str(tmp_path / "runs" / "exp1"))["loss_scale/scale"] == [(1, 1024.0)]
    (run,) = (tmp_path / "wandb").glob("offline-run-*")  # in the folder the user ran it from
    wait_until_finished(str(run))
    assert read_wandb(str(run))["loss_scale/scale"] == [(1, 1024.0)]


def test_alignment_block():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(50, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    namespace = {"model": model, "sample_inputs": torch.zeros(32, 50)}
    exec(block_after("Tensor Core alignment"), namespace)
    findings = {(f.layer, f.dimension, f.value) for f in namespace["report"].findings}
    assert ("0", "features_in", 50) in findings


def test_fsdp_block(monkeypatch):
    """Built as written; ``strategy="fsdp"`` needs CUDA, so the device count is mocked (nothing runs)."""
    pytest.importorskip("lightning")
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pl_cuda
    import torch

    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 8)
    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    namespace: dict = {}
    exec(block_after("FSDP"), namespace)
    from lossscale_callbacks.lightning import LossScaleFSDPPlugin

    trainer = namespace["trainer"]
    assert type(trainer.strategy).__name__ == "FSDPStrategy" and trainer.num_devices == 8
    assert isinstance(trainer.strategy.precision_plugin, LossScaleFSDPPlugin)


def test_fabric_block(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    model = torch.nn.Linear(8, 1)
    namespace = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                 "loader": [torch.randn(4, 8) for _ in range(5)], "path": str(tmp_path / "ckpt.pt")}
    code = block_after("Lightning Fabric").replace("...;", "loss = model(batch).float().pow(2).mean();")
    exec(code, namespace)
    monitor = namespace["monitor"]
    assert monitor.summary.startswith("Loss scaling: 5 optimizer steps")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert saved["loss_scale"]["steps"] == 5
    assert saved["loss_scale"]["scaler"]["scale"] == monitor.scaler.get_scale()
    assert any((tmp_path / "runs").rglob("events.out.tfevents.*"))


@pytest.mark.slow
def test_keras_precision_advisor_block(tmp_path, monkeypatch, capsys):
    import keras

    monkeypatch.chdir(tmp_path)
    previous = keras.mixed_precision.global_policy()
    try:
        namespace: dict = {}
        heading = "Precision advisor on Keras: does float16 fit, and what to keep in float32"
        exec(block_after(heading), namespace)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    advice = namespace["result"].advice
    assert (advice.fits, advice.keep_float32, namespace["result"].verified) == (False, ("wo", "add"), True)
    out = capsys.readouterr().out
    keep = "Keep these layers in float32: `wo`, `add` (`keep_keras_layers_in_float32(model, ['wo', 'add'])`)."
    assert keep in out
    assert "Loss scaling: 16 optimizer steps" in out
