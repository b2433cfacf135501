"""The ledger's acceptance scenario on a Fabric loop: ``FabricLossScaleMonitor.track(loader, replay=True,
loss=...)`` with ``LossScaleFabricPlugin`` in real fp16 on the CPU; the replay's ``loss`` calls the module
inside Fabric's wrapper (``model.module``), so that the replay controls autocast (Fabric's wrapper would put
its own back on for the float32 replay)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import ledger_scenario as sc  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.ledger._read import read_ledgers  # noqa: E402
from lossscale_callbacks.lightning.fabric import FabricLossScaleMonitor, LossScaleFabricPlugin  # noqa: E402


def _run(folder, ledger: bool):
    policy = DynamicPolicy(initial_scale=1024.0, growth_interval=10_000)
    plugin = LossScaleFabricPlugin(device="cpu", policy=policy)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = sc.Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    loader = fabric.setup_dataloaders(sc.loader(sc.dataset()))
    monitor = FabricLossScaleMonitor(fabric, log_every=10, echo=None)
    if ledger:
        loader = monitor.track(loader, ledger=folder, replay=True, model=model.module,
                               loss=lambda batch: sc.loss_fn(model.module, batch))
    step = 0
    for _ in range(sc.EPOCHS):
        for batch in loader:
            step += 1
            optimizer.zero_grad()
            fabric.backward(sc.loss_fn(model, batch))
            if step == sc.INJECT_AT:
                model.module.fc1.weight.grad[0, 0] = float("inf")
            optimizer.step()
            monitor.step()
    monitor.finish()
    return model.module, monitor


def test_fabric_ledger_and_bit_identical_replay(tmp_path):
    model, monitor = _run(tmp_path, True)
    plain, _ = _run(None, False)
    expected = sc.expected_bad_steps(sc.shuffled_orders())
    entries = {e.step: e for e in read_ledgers(tmp_path)}
    assert sorted(entries) == sorted([*expected, sc.INJECT_AT])
    for step, sample in expected.items():
        assert entries[step].culprits() == (sample,) and entries[step].producing_layer == "fc2"
        assert entries[step].verdict == "float16_range"
    assert entries[sc.INJECT_AT].verdict == "transient"
    assert "finite in float32: layer `fc2` exceeds float16 on this sample" in monitor.summary
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
