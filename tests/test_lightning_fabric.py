"""Lightning Fabric: ``LossScaleFabricPlugin`` and ``FabricLossScaleMonitor`` on one CPU process.

The two-process FSDP runs are in ``test_lightning_fsdp.py``; the example in ``examples/fabric_loop.py``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import TensorBoardLogger  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.lightning.fabric import (  # noqa: E402
    FabricLossScaleMonitor,
    LossScaleFabricFSDPPlugin,
    LossScaleFabricPlugin,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = DynamicPolicy(initial_scale=2.0**10, growth_interval=3)
INJECT = {2, 3, 7}


def _fabric(plugin, tmp_path, name="run"):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin],
                    loggers=[TensorBoardLogger(str(tmp_path), name=name, version=0)])
    fabric.launch()
    return fabric


def _train(fabric, steps=10, every=1, monitor=None):
    """A tiny fp16 run with Infs at INJECT: the monitor, parameters after each step, autocast dtypes..."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    params, dtypes = [], []
    # inside the module: Fabric casts what the wrapped model returns back to float32
    model.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monitor = monitor or FabricLossScaleMonitor(fabric, log_every=every, health=None)
    x = torch.randn(16, 8)
    for step in range(steps):
        optimizer.zero_grad()
        out = model(x)
        fabric.backward(out.float().pow(2).mean())
        if step in INJECT:
            model.weight.grad[0, 0] = math.inf
        optimizer.step()
        monitor.step()
        params.append(model.weight.detach().clone())
    monitor.finish()
    return monitor, params, dtypes, model, optimizer


def _scalars(log_dir, tag):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_fabric_plugin_runs_fp16_skips_inf_steps_and_logs(tmp_path):
    plugin = LossScaleFabricPlugin(device="cpu", policy=POLICY)
    fabric = _fabric(plugin, tmp_path)
    monitor, params, dtypes, _, _ = _train(fabric)
    assert set(dtypes) == {torch.float16}  # real fp16 autocast on the CPU
    for step in range(1, 10):
        assert torch.equal(params[step], params[step - 1]) == (step in INJECT), step
    state = plugin.scaler.get_state()
    assert state.skipped_steps == 3 and state.steps == 10
    # 1024, grows after 3 good steps (0-1 good, 2 and 3 skipped: 256), 4-6 grow to 512, 7 skipped: 256...
    scales = [v for _, v in _scalars(tmp_path / "run" / "version_0", "loss_scale/scale")]
    assert scales[:4] == [1024.0, 1024.0, 512.0, 256.0] and scales[-1] == state.scale
    skipped = _scalars(tmp_path / "run" / "version_0", "loss_scale/skipped_steps")
    assert skipped[-1] == (10, 3.0)
    assert monitor.summary.startswith("Loss scaling: 10 optimizer steps, 3 skipped")


def test_fabric_stock_grad_scaler_is_read_and_its_skips_counted(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    fabric = _fabric(MixedPrecision("16-mixed", "cpu", scaler=scaler), tmp_path, name="stock")
    monitor, params, _, _, _ = _train(fabric, every=5)
    # GradScaler counts no skips; the monitor counted them on the device and read twice.
    skipped = _scalars(tmp_path / "stock" / "version_0", "loss_scale/skipped_steps")
    assert [v for _, v in skipped] == [2.0, 3.0]
    ours = LossScaleFabricPlugin(device="cpu", policy=POLICY)
    _, our_params, _, _, _ = _train(_fabric(ours, tmp_path, name="ours"))
    # Same decisions and same scale as our scaler with the same settings.
    assert monitor.scaler.get_scale() == ours.scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(params, our_params, strict=True))


@pytest.mark.parametrize("stock", [False, True])
def test_monitor_state_round_trip_through_fabric_save_and_load(tmp_path, stock):
    def plugin():
        if stock:
            return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0,
                                                                                growth_interval=3))
        return LossScaleFabricPlugin(device="cpu", policy=POLICY)

    fabric = _fabric(plugin(), tmp_path, name="a")
    monitor, _, _, model, optimizer = _train(fabric, steps=5)
    path = str(tmp_path / "ckpt.pt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "loss_scale": monitor})
    saved = monitor.reader.read()
    saved_skipped = (saved if isinstance(saved, dict) else saved._asdict())["skipped_steps"]

    other = _fabric(plugin(), tmp_path, name="b")
    new_model = torch.nn.Linear(8, 4)
    new_model, new_optimizer = other.setup(new_model, torch.optim.SGD(new_model.parameters(), lr=0.1))
    new_monitor = FabricLossScaleMonitor(other, log_every=1, health=None)
    # Single-device Fabric calls load_state_dict itself for objects in `state`.
    other.load(path, {"model": new_model, "optimizer": new_optimizer, "loss_scale": new_monitor})
    restored = new_monitor.reader.read()
    def as_dict(state):
        return state if isinstance(state, dict) else state._asdict()

    assert as_dict(restored) == as_dict(saved)
    assert new_monitor.scaler.get_scale() == monitor.scaler.get_scale()
    # Counting goes on from the checkpoint: one more step is step 6, an interval of one step.
    new_optimizer.zero_grad()
    other.backward(new_model(torch.randn(4, 8)).float().pow(2).mean())
    new_optimizer.step()
    snapshot = new_monitor.step()
    assert (snapshot.step, snapshot.interval_steps, snapshot.skipped_in_interval) == (6, 1, 0)
    assert snapshot.skipped_steps == saved_skipped


def test_monitor_refuses_bad_arguments_and_bad_state(tmp_path):
    plain = Fabric(accelerator="cpu", devices=1, precision="32-true")
    with pytest.raises(ValueError, match="loss scaler"):
        FabricLossScaleMonitor(plain)
    fabric = _fabric(LossScaleFabricPlugin(device="cpu", policy=POLICY), tmp_path)
    with pytest.raises(ValueError, match="log_every"):
        FabricLossScaleMonitor(fabric, log_every=0)
    monitor = FabricLossScaleMonitor(fabric, log_every=1, health=None)
    before = monitor.scaler.get_state()
    stock_state = {"steps": 2, "skipped_steps": 0}
    for bad in ({}, {"steps": -1, "scaler": {}}, {"steps": 2, "scaler": {}, "stock": stock_state},
                {"steps": 2, "scaler": {"scale": float("nan")}}):
        with pytest.raises(ValueError):
            monitor.load_state_dict(bad)
        assert monitor.scaler.get_state() == before and monitor.reader.steps == 0  # nothing half-loaded


def test_plugins_check_their_arguments():
    with pytest.raises(ValueError, match="precision"):
        LossScaleFabricPlugin("16-true", device="cpu")
    with pytest.raises(ValueError, match="device"):
        LossScaleFabricPlugin(device="tpu")
    with pytest.raises(ValueError, match="policy"):
        LossScaleFabricFSDPPlugin(device="cpu", policy="dynamic")
    bf16 = LossScaleFabricPlugin("bf16-mixed", device="cpu")
    assert bf16.scaler.get_scale() == 1.0  # bf16: no scaling, but Inf/NaN steps still skipped and counted


@pytest.mark.slow
def test_fabric_example_resumes_the_scale_from_its_checkpoint(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fabric_loop.py"), "--steps", "120",
                           "--log-every", "10", "--inject-inf-every", "35"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    full_text, resumed_text = proc.stdout.split("-- resumed from the checkpoint written at step 60")

    def rows(text):  # step -> (scale, skipped)
        return {int(r[1]): (r[5], r[7]) for r in (line.split() for line in text.splitlines())
                if r and r[0] == "step"}

    full, resumed = rows(full_text), rows(resumed_text)
    assert sorted(resumed) == list(range(70, 121, 10))
    # The scale and the skip count go on from the checkpoint: the same as the uninterrupted run.
    assert {s: full[s] for s in resumed} == resumed
    assert full[120][1] == "3" and "Loss scaling: 120 optimizer steps, 3 skipped" in resumed_text
    scale = _scalars(tmp_path / "runs" / "fabric_loop" / "resumed", "loss_scale/scale")
    assert [s for s, _ in scale] == list(range(70, 121, 10))
