"""The ledger's acceptance scenario through Lightning: ``LossScaleMonitor(ledger=True, replay=True)`` with
``LossScalePlugin`` on the CPU in real fp16, the train loader shuffled with seed 0, an Inf written into a
gradient at step 50 (``on_after_backward``), and the run left bit-identical by the replays; then a run
resumed without the bad batches through the exported ``skip_batches.json``, consumed as Lightning's
``SpikeDetection`` users consume it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import ledger_scenario as sc  # noqa: E402
from lightning_scripts import tiny  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.ledger._read import read_ledgers  # noqa: E402
from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin  # noqa: E402

tiny.quiet_lightning_warnings()


DATA = sc.dataset()


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = sc.Net()
        self.logged = 0
        self.seen: dict[int, list[int]] = {}  # step -> the samples of its batch, found by their values

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        rows = (batch[0][:, None, :] == DATA.tensors[0][None, :, :]).all(-1).nonzero()[:, 1].tolist()
        self.seen.setdefault(self.trainer.global_step + 1, rows)  # the first call: the step's own
        loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss.float())
        self.logged += 1
        return loss

    def on_after_backward(self):
        if self.trainer.global_step + 1 == sc.INJECT_AT:
            self.net.fc1.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def _fit(folder, ledger: bool):
    pl.seed_everything(0, workers=False)
    module = Module()
    plugin = LossScalePlugin("16-mixed", device="cpu",
                             policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000))
    monitor = LossScaleMonitor(log_every=10, ledger=folder if ledger else False, replay=ledger, echo=None)
    trainer = pl.Trainer(plugins=[plugin], callbacks=[monitor],
                         **tiny.trainer_kwargs(max_epochs=sc.EPOCHS, max_steps=-1))
    trainer.fit(module, sc.loader(DATA))
    return module, monitor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning")
    return folder, _fit(folder, True), _fit(None, False)


def test_lightning_ledger_holds_the_bad_samples_steps_and_step_50_transient(runs):
    folder, (module, monitor), _ = runs
    expected = {step: sorted(set(rows) & set(sc.BAD)) for step, rows in module.seen.items()
                if set(rows) & set(sc.BAD)}
    assert len(expected) == 6 and sc.INJECT_AT not in expected
    entries = {e.step: e for e in read_ledgers(folder)}
    assert sorted(entries) == sorted([*expected, sc.INJECT_AT])
    for step, samples in expected.items():
        entry = entries[step]
        assert list(entry.samples()) == module.seen[step]  # the samples the step was given, in order
        assert sorted(entry.culprits()) == samples and entry.producing_layer == "net.fc2"
        assert entry.verdict == "float16_range"
        assert [(m.epoch, m.batch) for m in entry.micro_batches] == [((step - 1) // 64, (step - 1) % 64)]
    assert entries[sc.INJECT_AT].verdict == "transient"
    assert "any scale; finite in float32: layer `net.fc2` exceeds float16 on this sample" in monitor.summary


def test_lightning_replay_leaves_the_run_and_its_logs_unchanged(runs):
    _, (replayed, _), (plain, _) = runs
    for a, b in zip(replayed.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert replayed.logged == plain.logged + 3 * 7  # the replays ran training_step, their self.log was silent


class SkippingModule(Module):
    """Skips the batches of a ``skip_batches.json``. Lightning's ``SpikeDetection`` writes that file (a JSON
    list of ``batch_idx``) and nothing in Lightning reads it back: a run honours it in its own
    ``training_step``, which returns ``None`` for those batches (automatic optimization then runs no backward
    and no optimizer step)."""

    def __init__(self, path) -> None:
        super().__init__()
        with open(path) as handle:
            self.skip = set(json.load(handle))
        self.trained: list[list[int]] = []  # the samples of each batch trained on, in order
        self.skipped = 0
        self.injected_at: int | None = None
        self._after_skip = False

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            self.skipped += 1
            self._after_skip = True
            return None
        rows = (batch[0][:, None, :] == DATA.tensors[0][None, :, :]).all(-1).nonzero()[:, 1].tolist()
        self.trained.append(rows)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        # A one-off Inf in the first step trained right after a skipped batch: the ledger must file that
        # step's samples alone, not the skipped batch's with them.
        if self._after_skip and self.injected_at is None:
            self.injected_at = len(self.trained)
            self.net.fc1.weight.grad[0, 0] = float("inf")
        self._after_skip = False


def test_a_lightning_run_resumed_with_the_exported_skip_batches_json_trains_no_bad_sample(runs, tmp_path):
    folder, _, _ = runs
    cli = [sys.executable, "-m", "lossscale_callbacks._cli", "report", str(folder)]
    done = subprocess.run([*cli, "--skip-list", str(tmp_path / "skip")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "skip" / "skip_batches.json"
    batches = json.loads(path.read_text())
    blamed = [e for e in read_ledgers(folder) if e.verdict == "float16_range"]
    assert batches == sorted({m.batch for e in blamed for m in e.micro_batches})  # batch_idx within its epoch
    assert path.read_text() == json.dumps(batches, indent=4)  # byte for byte what SpikeDetection writes
    pl.seed_everything(0, workers=False)
    module = SkippingModule(path)
    plugin = LossScalePlugin("16-mixed", device="cpu",
                             policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000))
    monitor = LossScaleMonitor(log_every=10, ledger=tmp_path / "resumed", echo=None)
    trainer = pl.Trainer(plugins=[plugin], callbacks=[monitor],
                         **tiny.trainer_kwargs(max_epochs=sc.EPOCHS, max_steps=-1))
    trainer.fit(module, sc.loader(DATA))  # the same seeded order: each epoch skips the listed batch_idx
    assert module.skipped == sc.EPOCHS * len(batches)
    assert not any(set(rows) & set(sc.BAD) for rows in module.trained)
    # The one bad step left is the injected one, with the samples of the batch it trained on alone (the
    # skipped batch before it is no part of any step).
    (entry,) = read_ledgers(tmp_path / "resumed")
    assert entry.step == module.injected_at
    assert [list(m.samples) for m in entry.micro_batches] == [module.trained[module.injected_at - 1]]
