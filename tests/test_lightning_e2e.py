"""End to end: fp16 on the CPU with injected Inf gradients, read back from TensorBoard and W&B files;
resuming from a checkpoint reproduces the uninterrupted run's loss-scale state at every step."""

from __future__ import annotations

import glob
import os

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from lightning_scripts import tiny  # noqa: E402

from lossscale_callbacks import DynamicPolicy, initial_state, next_state  # noqa: E402
from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin  # noqa: E402

tiny.quiet_lightning_warnings()

POLICY = DynamicPolicy(initial_scale=2.0**12, growth_interval=4, hysteresis=2)
INJECT = (3, 4, 9)
STEPS = 12


def _reference_states(flags):
    state, out = initial_state(POLICY), []
    for finite in flags:
        state = next_state(POLICY, state, finite)
        out.append(state)
    return out


class _Recorder(pl.Callback):
    """Reads the scaler after every step (a test may sync; the library does not)."""

    def __init__(self):
        self.states = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        params = [p.detach().clone() for p in pl_module.parameters()]
        self.states[trainer.global_step] = (scaler.get_state(), params)


@pytest.mark.slow
def test_fp16_run_with_injected_infs_read_back_from_tensorboard_and_wandb(tmp_path):
    wandb = pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lossscale_callbacks.wandb._reader import read_run, read_run_info, read_tables, wait_until_finished

    tb = pl.loggers.TensorBoardLogger(str(tmp_path / "tb"), name="run", version=0)
    wb = pl.loggers.WandbLogger(offline=True, save_dir=str(tmp_path), project="lossscale-test")
    plugin = LossScalePlugin("16-mixed", device="cpu", policy=POLICY)
    monitor = LossScaleMonitor()
    model = tiny.module_class(pl)(inject_inf_at=INJECT)
    trainer = pl.Trainer(plugins=[plugin], callbacks=[monitor],
                         **tiny.trainer_kwargs(max_steps=STEPS, logger=[tb, wb], log_every_n_steps=2))
    try:
        trainer.fit(model, tiny.data(n=96))
    finally:
        wandb.finish()

    # The run itself: fp16 autocast, injected steps skipped bit-identically, the scale backed off.
    assert set(model.autocast_dtypes) == {torch.float16}
    for step, before, after in model.steps:
        assert tiny.same_bits(before, after) == (step in INJECT), step
    reference = _reference_states([s not in INJECT for s in range(STEPS)])
    assert plugin.scaler.get_state() == tuple(x.item() for x in reference[-1])
    # hysteresis=2: the first overflow (step 3) keeps the scale, the second (step 4) halves it.
    assert float(reference[3].scale) == 2.0**12 and float(reference[4].scale) == 2.0**11
    # Logged at Lightning's own logging step (the batch index), so the rows line up with self.log's:
    # the state after optimizer step s is logged at step s - 1.
    expected = {s - 1: reference[s - 1] for s in range(2, STEPS + 1, 2)}

    # TensorBoard, with TensorBoard's own reader.
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scale = [(e.step, e.value) for e in acc.Scalars("loss_scale/scale")]
    assert scale == [(s, float(st.scale)) for s, st in expected.items()]
    skipped = [(e.step, e.value) for e in acc.Scalars("loss_scale/skipped_steps")]
    assert skipped == [(s, float(st.skipped_steps)) for s, st in expected.items()]
    assert [e.value for e in acc.Scalars("loss_scale/skipped_in_interval")] == [0, 1, 1, 0, 1, 0]
    rate = acc.Scalars("loss_scale/skip_rate")
    assert rate[1].value == pytest.approx(0.5) and rate[2].value == pytest.approx(0.5)
    summary_tag = next(t for t in acc.Tags()["tensors"] if t.startswith("loss_scale/summary"))
    text = acc.Tensors(summary_tag)[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("Loss scaling: 12 optimizer steps, 3 skipped (25.00%)")

    # W&B's offline run file.
    run_dir = glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*"))
    assert len(run_dir) == 1
    wait_until_finished(run_dir[0])  # finish() can return before W&B's writer flushed the file
    series = read_run(run_dir[0])
    assert series["loss_scale/scale"] == [(s, float(st.scale)) for s, st in expected.items()]
    assert series["loss_scale/skipped_steps"] == [(s, float(st.skipped_steps)) for s, st in expected.items()]
    # The WandbLogger run gets what a WandbSink run gets: the summary as a Table, the policy in the config.
    tables = {key: rows for key, _, _, rows in read_tables(run_dir[0])}
    assert tables["loss_scale/summary"][0][1] == text
    info = read_run_info(run_dir[0])
    assert info.config["loss_scale"]["hysteresis"] == 2
    assert info.summary["loss_scale/total_skipped_steps"] == 3


@pytest.mark.slow
def test_resume_from_a_checkpoint_gives_the_same_state_at_every_step(tmp_path):
    def fit(max_steps, ckpt_path=None):
        plugin = LossScalePlugin(device="cpu", policy=POLICY)
        recorder = _Recorder()
        model = tiny.module_class(pl)(inject_inf_at=INJECT, snapshots=False)
        trainer = pl.Trainer(plugins=[plugin], callbacks=[recorder, LossScaleMonitor(log_every=1)],
                             **tiny.trainer_kwargs(max_steps=max_steps))
        # Lightning does not resume the exact batch order mid-run; identical batches make the
        # weights comparable too (they then depend only on the restored optimizer and scaler).
        trainer.fit(model, tiny.data(n=40, same_batches=True), ckpt_path=ckpt_path)
        return trainer, recorder

    _, full = fit(STEPS)
    first, part = fit(5)
    path = str(tmp_path / "mid.ckpt")
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["LossScalePlugin"]["steps"] == 5
    _, resumed = fit(STEPS, ckpt_path=path)
    assert sorted(resumed.states) == list(range(6, STEPS + 1))
    for step in range(1, STEPS + 1):
        state, params = (part if step <= 5 else resumed).states[step]
        assert state == full.states[step][0], step
        for a, b in zip(params, full.states[step][1], strict=True):
            assert torch.equal(a, b), step
    assert full.states[STEPS][0].skipped_steps == 3
