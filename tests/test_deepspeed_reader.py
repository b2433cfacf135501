"""Reading DeepSpeed's own fp16 loss scaler (``DeepSpeedScalerReader``) and logging it from Lightning.

DeepSpeed does not run fp16 on this CPU (Lightning's DeepSpeedStrategy requires CUDA, and DeepSpeed's
CPU accelerator has no fp16 without oneDNN fp16), so the reader is tested against a recording of
DeepSpeed 0.19.8's ``DynamicLossScaler``; where deepspeed is installed, the recording is checked
against the real class first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.torch._deepspeed_reader import DeepSpeedScalerReader  # noqa: E402

# DynamicLossScaler(init_scale=1024, scale_window=3, min_scale=1, delayed_shift=2,
# consecutive_hysteresis=False) after update_scale(overflow) for each overflow below, recorded from
# DeepSpeed 0.19.8: (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis).
OVERFLOWS = [False, True, True, False, False, False, False, True, False]
RECORDED = [(1024, 1, -1, 2), (1024, 2, 1, 1), (512.0, 3, 2, 1), (512.0, 4, 2, 1), (512.0, 5, 2, 1),
            (512.0, 6, 2, 1), (1024.0, 7, 2, 2), (1024.0, 8, 7, 1), (1024.0, 9, 7, 1)]
SETTINGS = {"scale_window": 3, "scale_factor": 2.0, "min_scale": 1, "delayed_shift": 2, "dynamic": True,
            "consecutive_hysteresis": False, "raise_error_at_min_scale": True}
# Hysteresis 2: the first overflow (step 1) only spends it, the second (step 2) halves the scale.
# Growth: DeepSpeed grows after scale_window + 1 good steps following an overflow (steps 3-6).
SKIPPED = [0, 1, 2, 2, 2, 2, 2, 3, 3]
GROWTH_COUNTER = [0, 0, 0, 0, 1, 2, 0, 0, 0]


def _recorded_scaler(step: int) -> SimpleNamespace:
    scale, cur_iter, last_overflow, hysteresis = RECORDED[step]
    return SimpleNamespace(cur_scale=scale, cur_iter=cur_iter, last_overflow_iter=last_overflow,
                           cur_hysteresis=hysteresis, **SETTINGS)


def test_the_recording_is_what_the_installed_deepspeed_does(monkeypatch):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    # update_scale asks the rank only to decide who prints the overflow message.
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)
    scaler = loss_scaler.DynamicLossScaler(init_scale=1024, scale_window=3, min_scale=1, delayed_shift=2,
                                           consecutive_hysteresis=False)
    reader = DeepSpeedScalerReader(scaler)
    for step, overflow in enumerate(OVERFLOWS):
        scaler.update_scale(overflow)
        reader.after_optimizer_step()
        assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis) \
            == RECORDED[step]
        assert {k: getattr(scaler, k) for k in SETTINGS} == SETTINGS
        assert reader.read()["skipped_steps"] == SKIPPED[step]


def test_reader_follows_a_bare_loss_scaler_step_by_step():
    holder = SimpleNamespace(loss_scaler=_recorded_scaler(0))
    reader = DeepSpeedScalerReader(holder)  # an optimizer: no engine counts, the reader counts skips
    states = []
    for step in range(len(OVERFLOWS)):
        holder.loss_scaler = _recorded_scaler(step)
        reader.after_optimizer_step()
        states.append(reader.read())
    assert [s["scale"] for s in states] == [float(r[0]) for r in RECORDED]
    assert [s["hysteresis_left"] for s in states] == [r[3] for r in RECORDED]
    assert [s["skipped_steps"] for s in states] == SKIPPED
    assert [s["steps"] for s in states] == list(range(1, 10))
    assert [s["growth_counter"] for s in states] == GROWTH_COUNTER
    # the scale grows on the good step after the counter reached scale_window - 1
    grew = [i for i in range(1, 9) if states[i]["scale"] > states[i - 1]["scale"]]
    assert grew == [6] and states[5]["growth_counter"] == SETTINGS["scale_window"] - 1


def test_reader_uses_the_engine_counts_and_follows_a_replaced_scaler():
    engine = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=_recorded_scaler(2)), skipped_steps=2,
                             global_steps=3)
    reader = DeepSpeedScalerReader(engine)
    assert reader.read() == {"scale": 512.0, "growth_counter": 0, "hysteresis_left": 1, "skipped_steps": 2,
                             "steps": 3}
    # DeepSpeed swaps optimizer.loss_scaler when it loads a checkpoint: the reader looks it up each time.
    engine.optimizer.loss_scaler = _recorded_scaler(8)
    engine.skipped_steps, engine.global_steps = 3, 9
    assert reader.read()["scale"] == 1024.0 and reader.read()["skipped_steps"] == 3


def test_policy_reflects_the_deepspeed_settings():
    policy = DeepSpeedScalerReader(_recorded_scaler(2)).policy()
    assert isinstance(policy, DynamicPolicy)
    settings = (policy.growth_interval, policy.hysteresis, policy.min_scale, policy.growth_factor)
    assert settings == (3, 2, 1.0, 2.0)
    static = SimpleNamespace(cur_scale=128.0, dynamic=False, cur_iter=0, last_overflow_iter=None)
    assert DeepSpeedScalerReader(static).policy() == FixedPolicy(128.0)
    assert DeepSpeedScalerReader(static).read()["growth_counter"] == 0


def test_reader_refuses_what_has_no_loss_scaler():
    with pytest.raises(ValueError, match="source"):
        DeepSpeedScalerReader(SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1)))


@pytest.mark.slow
def test_lightning_monitor_logs_a_deepspeed_engines_scaler(tmp_path):
    """LossScaleMonitor with a DeepSpeed-shaped strategy: the engine's scaler replays the recording."""
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lossscale_callbacks.lightning import LossScaleMonitor

    engine = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=_recorded_scaler(0)), skipped_steps=0,
                             global_steps=0)

    class Fp16Label(pl.plugins.precision.Precision):
        precision = "16-mixed"  # what DeepSpeedStrategy sees when the user asks for fp16

    class DeepSpeedShaped(pl.strategies.SingleDeviceStrategy):
        """Where Lightning's DeepSpeedStrategy keeps its engine (it needs CUDA to run for real)."""

        @property
        def deepspeed_engine(self):
            return engine

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
            step = engine.global_steps  # what DeepSpeed's engine.step() does to its own state
            engine.optimizer.loss_scaler = _recorded_scaler(step)
            engine.skipped_steps += OVERFLOWS[step]
            engine.global_steps += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    strategy = DeepSpeedShaped(device=torch.device("cpu"), precision_plugin=Fp16Label())
    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="ds", version=0)
    trainer = pl.Trainer(strategy=strategy, max_steps=len(OVERFLOWS), logger=logger,
                         callbacks=[LossScaleMonitor(log_every=1, health=None)],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=2)
    trainer.fit(Module(), data)

    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss_scale/scale")] == [float(r[0]) for r in RECORDED]
    assert [e.value for e in acc.Scalars("loss_scale/skipped_steps")] == SKIPPED
    assert [e.value for e in acc.Scalars("loss_scale/growth_counter")] == GROWTH_COUNTER
    assert trainer.callback_metrics["loss_scale/skipped_steps"].item() == 3
