"""The ledger's acceptance scenario on Accelerate's own loop: ``Accelerator(mixed_precision="fp16")`` with our
scaler installed (``install_loss_scaler``: real fp16 autocast on the CPU), the model, optimizer and the
shuffled loader prepared, ``accelerator.backward`` and the prepared optimizer's ``step``;
``AccelerateLossScaleMonitor.track(loader, replay=True, loss=..., model=...)`` with a ``loss`` that calls the
prepared model as the loop does. An Inf is written into a gradient at step 50, and the run is left
bit-identical by the replays."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import ledger_scenario as sc  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.accelerate import AccelerateLossScaleMonitor, install_loss_scaler  # noqa: E402
from lossscale_callbacks.ledger._read import read_ledgers  # noqa: E402

DATA = sc.dataset()


def _rows(x):
    """The dataset rows of a batch's inputs, found by their values."""
    return (x[:, None, :] == DATA.tensors[0][None, :, :]).all(-1).nonzero()[:, 1].tolist()


def _run(folder, ledger: bool):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000))
    torch.manual_seed(0)
    model = sc.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, sc.loader(DATA))
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=10, trackers=False, echo=None)
    if ledger:
        loader = monitor.track(loader, ledger=folder, replay=True, model=model,
                               loss=lambda batch: sc.loss_fn(model, batch))
    seen: dict[int, list[int]] = {}  # step -> the samples of its batch
    step = 0
    for _ in range(sc.EPOCHS):
        for batch in loader:
            step += 1
            seen[step] = _rows(batch[0])
            accelerator.backward(sc.loss_fn(model, batch))
            if step == sc.INJECT_AT:
                model.fc1.weight.grad[0, 0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    monitor.finish()
    return model, monitor, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate")
    return folder, _run(folder, True), _run(None, False)


def test_accelerate_ledger_holds_the_bad_samples_steps_and_step_50_transient(runs):
    folder, (_, monitor, seen), _ = runs
    expected = {step: sorted(set(rows) & set(sc.BAD)) for step, rows in seen.items()
                if set(rows) & set(sc.BAD)}
    assert len(expected) == 6 and sc.INJECT_AT not in expected
    entries = {e.step: e for e in read_ledgers(folder)}
    assert sorted(entries) == sorted([*expected, sc.INJECT_AT])
    for step, samples in expected.items():
        entry = entries[step]
        assert list(entry.samples()) == seen[step]  # the sampler's indices: the samples the step was given
        assert sorted(entry.culprits()) == samples and entry.producing_layer == "fc2"
        assert entry.verdict == "float16_range"  # reproducible at any scale, finite in float32
        assert entry.replay.float32 is True and entry.replay.low is False
    assert entries[sc.INJECT_AT].verdict == "transient"
    assert "finite in float32: layer `fc2` exceeds float16 on this sample" in monitor.summary


def test_accelerate_replay_leaves_the_run_bit_identical(runs):
    _, (replayed, monitor, seen), (plain, plain_monitor, plain_seen) = runs
    assert seen == plain_seen
    for a, b in zip(replayed.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert monitor.scaler.get_state() == plain_monitor.scaler.get_state()
