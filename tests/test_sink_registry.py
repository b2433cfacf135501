"""A new sink is one class and one registry entry, usable by name from the loop and every integration.

The sink below writes JSON lines; ``register_sink("jsonl", JsonLinesSink)`` is the only other line.
A real loop writes through it by name and the file is read back; each integration is constructed with
``sinks={"jsonl": path}`` (its loop opens the sink by name) and a real Keras ``fit`` writes through it.
About 15 s on 2 CPU cores (the Keras fit and the framework imports).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from lossscale_callbacks import LoggingLoop
from lossscale_callbacks import _sinks as sinks_module
from lossscale_callbacks.extend import register_sink


class JsonLinesSink:
    """The whole new sink: one JSON object a line, ``{"step": ..., "metrics": {...}}``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.file = None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.file is None:
            self.file = self.path.open("a")
        self.file.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")

    def write_text(self, tag: str, markdown: str) -> None:
        pass

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture()
def jsonl(monkeypatch):
    monkeypatch.setattr(sinks_module, "_REGISTRY", {})  # the registration is undone after the test
    register_sink("jsonl", JsonLinesSink)


def test_a_registered_sink_is_written_by_name_from_a_plain_loop(jsonl, tmp_path):
    from lossscale_callbacks import DynamicPolicy, initial_state, next_state

    path = tmp_path / "run.jsonl"
    policy = DynamicPolicy(initial_scale=1024.0, growth_interval=50)
    loop = LoggingLoop(policy, log_every=100, sinks={"jsonl": str(path)}, echo=None)
    state = initial_state(policy)
    for step in range(1, 301):
        state = next_state(policy, state, finite=step % 97 != 0)
        loop.maybe_observe(int(state.steps), lambda state=state: state)
    loop.finish(state)
    lines = _lines(path)
    assert [line["step"] for line in lines] == [100, 200, 300]
    assert lines[-1]["metrics"]["loss_scale/skipped_steps"] == 3


def test_an_unknown_name_is_a_value_error_naming_the_known_ones(jsonl):
    with pytest.raises(ValueError, match=r"sinks: each name must be one of \[.*'jsonl'.*\].*got \['csv'\]"):
        LoggingLoop(log_every=10, sinks={"csv": "x.csv"})


def test_register_sink_checks_its_arguments():
    with pytest.raises(ValueError, match="name must be an identifier other than"):
        register_sink("tensorboard", JsonLinesSink)
    with pytest.raises(ValueError, match="factory must be a sink class"):
        register_sink("jsonl", "not callable")


# integration face -> how to build it with sinks= (each builds its LoggingLoop, which checks the name)
def _builders(tmp_path):
    def keras_callback(sinks):
        module = importlib.import_module("lossscale_callbacks.keras")
        return module.LossScaleCallback(log_every=1, sinks=sinks)

    def lightning_monitor(sinks):
        module = importlib.import_module("lossscale_callbacks.lightning")
        return module.LossScaleMonitor(log_every=1, sinks=sinks)

    def trainer_callback(sinks):
        module = importlib.import_module("lossscale_callbacks.transformers")
        return module.LossScaleTrainerCallback(log_every=1, sinks=sinks)

    def accelerate_monitor(sinks):
        accelerate = importlib.import_module("accelerate")
        face = importlib.import_module("lossscale_callbacks.accelerate")
        accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
        face.install_loss_scaler(accelerator)
        return face.AccelerateLossScaleMonitor(accelerator, log_every=1, sinks=sinks)

    def fabric_monitor(sinks):
        fabric_face = importlib.import_module("lossscale_callbacks.lightning.fabric")
        lightning = importlib.import_module("lightning")
        fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[fabric_face.LossScaleFabricPlugin()])
        return fabric_face.FabricLossScaleMonitor(fabric, log_every=1, sinks=sinks)

    return {"keras": keras_callback, "lightning": lightning_monitor, "transformers": trainer_callback,
            "accelerate": accelerate_monitor, "lightning.fabric": fabric_monitor}


@pytest.mark.parametrize("integration", ["keras", "lightning", "lightning.fabric", "accelerate",
                                         "transformers"])
def test_every_integration_takes_the_sink_by_name(jsonl, tmp_path, integration):
    pytest.importorskip(integration.split(".")[0])
    build = _builders(tmp_path)[integration]
    made = build({"jsonl": str(tmp_path / "run.jsonl")})
    loop = made.loop
    assert loop._named == {"jsonl": str(tmp_path / "run.jsonl")}
    with pytest.raises(ValueError, match="sinks: each name must be one of"):
        build({"nope": 1})


def test_a_keras_fit_writes_through_the_sink_by_name(jsonl, tmp_path):
    keras = pytest.importorskip("keras")
    import numpy as np

    from lossscale_callbacks.keras import LossScaleCallback

    path = tmp_path / "fit.jsonl"
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[LossScaleCallback(log_every=2, sinks={"jsonl": str(path)}, health=None)])
    lines = _lines(path)
    assert lines and lines[-1]["step"] == 4  # the callback's own reads, up to the last of 4 batches
    assert all(line["metrics"]["loss_scale/scale"] > 0 for line in lines)
