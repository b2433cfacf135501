"""The ledger's acceptance scenario through the Transformers ``Trainer``: a ``datasets.Dataset`` with an
index column (``idx``, dropped from the batches by ``remove_unused_columns``),
``LossScaleTrainerCallback(ledger=True, replay=True, ids="idx")`` in real fp16 on the CPU, an Inf written
into a gradient at step 50, and the run left bit-identical by the replays."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ledger_scenario as sc  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.ledger._read import read_ledgers  # noqa: E402
from lossscale_callbacks.transformers import LossScaleTrainerCallback  # noqa: E402

DATA = sc.dataset()
IDS = [1000 + i for i in range(sc.N)]  # the index column: not the row positions


class Model(torch.nn.Module):
    """The scenario's net as a Trainer model: ``forward(x, labels)`` returns the loss; records the rows
    (by value) of the first forward of each step: the samples the step was given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = sc.Net()
        self.step = 0
        self.seen: dict[int, list[int]] = {}

    def forward(self, x, labels):
        out = self.net(x)
        if self.training and torch.is_grad_enabled():
            rows = (x[:, None, :] == DATA.tensors[0][None, :, :].to(x.dtype)).all(-1).nonzero()[:, 1].tolist()
            self.seen.setdefault(self.step + 1, rows)
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels), "logits": out}


class Inject(TrainerCallback):
    def __init__(self, model: Model) -> None:
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        self.model.step = state.global_step
        if state.global_step + 1 == sc.INJECT_AT:  # one backward pass only: a one-off fault
            handles = []

            def once(grad):
                handles[0].remove()
                return grad.clone().fill_(float("inf"))

            handles.append(self.model.net.fc1.weight.register_hook(once))


def _train(out: str, ledger: bool):
    model = Model()
    data = datasets.Dataset.from_dict({"x": DATA.tensors[0].tolist(), "labels": DATA.tensors[1].tolist(),
                                       "idx": IDS}).with_format("torch")
    args = TrainingArguments(output_dir=out, fp16=True, use_cpu=True, num_train_epochs=sc.EPOCHS,
                             per_device_train_batch_size=sc.BATCH, learning_rate=1e-3,
                             lr_scheduler_type="constant", optim="sgd", logging_steps=10, report_to=[],
                             save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
                             max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Inject(model)])
    callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000),
                                        ledger=ledger, replay=ledger, ids="idx" if ledger else None,
                                        echo=None)
    callback.attach(trainer)
    trainer.train()
    return model, callback


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("trainer"))
    return folder, _train(folder, True), _train(str(tmp_path_factory.mktemp("plain")), False)


def test_trainer_ledger_names_the_bad_samples_by_their_index_column(runs):
    folder, (model, callback), _ = runs
    expected = {step: sorted(set(rows) & set(sc.BAD)) for step, rows in model.seen.items()
                if set(rows) & set(sc.BAD)}
    assert len(expected) == 6 and sc.INJECT_AT not in expected
    entries = {e.step: e for e in read_ledgers(folder)}
    assert sorted(entries) == sorted([*expected, sc.INJECT_AT])
    for step, samples in expected.items():
        entry = entries[step]
        assert list(entry.samples()) == [IDS[r] for r in model.seen[step]]
        assert sorted(entry.culprits()) == [IDS[s] for s in samples]
        assert entry.producing_layer == "net.fc2" and entry.verdict == "float16_range"
    assert entries[sc.INJECT_AT].verdict == "transient"
    assert "any scale; finite in float32: layer `net.fc2` exceeds float16 on this sample" in callback.summary


def test_trainer_replay_leaves_the_run_bit_identical(runs):
    _, (replayed, _), (plain, _) = runs
    for a, b in zip(replayed.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
