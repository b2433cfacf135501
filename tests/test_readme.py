"""The README's code blocks run as written (with a tiny model and dataset supplied)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def block_after(heading: str) -> str:
    section = README.split(f"## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_core_block():
    namespace = {"finite": False}
    exec(block_after("The core, in any loop"), namespace)
    state = namespace["state"]  # hysteresis=2: the first overflow is skipped without a backoff
    assert (float(state.scale), int(state.skipped_steps), int(state.hysteresis_left)) == (2.0**15, 1, 1)


@pytest.mark.slow
def test_keras_block(tmp_path, monkeypatch):
    import keras

    monkeypatch.chdir(tmp_path)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax", dtype="float32")(
        keras.layers.Dense(16, activation="relu")(inputs)))
    rng = np.random.default_rng(0)
    ds = (rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 4, size=64))
    code = block_after("Keras").replace("model.fit(ds,", "model.fit(*ds, batch_size=16,")
    previous = keras.mixed_precision.global_policy()
    try:
        exec(code, {"model": model, "ds": ds})
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert type(model.optimizer).__module__ == "lossscale_callbacks.keras.optimizer"
    header, *rows = (tmp_path / "log.csv").read_text().splitlines()
    columns = header.split(",")
    # Quiet by default (issue 19): Keras' logs, so the CSV, get the scale and the skipped steps only.
    assert sorted(c for c in columns if c.startswith("loss_scale/")) == ["loss_scale/scale",
                                                                        "loss_scale/skipped_steps"]
    last = rows[-1].split(",")
    assert len(rows) == 3 and float(last[columns.index("loss_scale/scale")]) == 2.0**15
    assert float(last[columns.index("loss_scale/skipped_steps")]) == 0.0
    assert any((tmp_path / "runs" / "exp1").rglob("events.out.tfevents.*"))


def test_lightning_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block_after("PyTorch and PyTorch Lightning"), namespace)
    trainer = namespace["trainer"]
    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    assert isinstance(trainer.precision_plugin, LossScalePlugin)
    assert trainer.precision_plugin.scaler.policy.hysteresis == 2
    assert any(isinstance(cb, LossScaleMonitor) for cb in trainer.callbacks)
    assert len(trainer.loggers) == 2


def test_dashboards_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block_after("Dashboards and reports"), namespace)
    for sink in namespace["sinks"]:
        sink.write(1, {"loss_scale/scale": 1024.0})
        sink.close()
    from lossscale_callbacks.tensorboard.reader import read_run

    assert read_run(str(tmp_path / "runs" / "exp1"))["loss_scale/scale"] == [(1, 1024.0)]


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
