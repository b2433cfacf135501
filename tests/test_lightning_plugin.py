"""LossScalePlugin in real (tiny) Lightning runs on the CPU, in both Lightning namespaces."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from lightning_scripts import tiny  # noqa: E402

from lossscale_callbacks import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.lightning._monitor import LossScaleMonitor  # noqa: E402
from lossscale_callbacks.lightning._plugin import LossScalePlugin  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

SCRIPTS = Path(__file__).parent / "lightning_scripts"
tiny.quiet_lightning_warnings()


@pytest.fixture(params=tiny.NAMESPACES)
def pl(request):
    return pytest.importorskip(request.param)


def _fit(pl, plugin, model=None, **kwargs):
    model = model if model is not None else tiny.module_class(pl)()
    trainer = pl.Trainer(plugins=[plugin], **tiny.trainer_kwargs(**kwargs))
    trainer.fit(model, tiny.data())
    return trainer, model


def test_plugin_is_a_mixed_precision_plugin_of_both_namespaces():
    plugin = LossScalePlugin(device="cpu")
    for name in tiny.NAMESPACES:
        ns = pytest.importorskip(name)
        assert isinstance(plugin, ns.plugins.precision.MixedPrecision)


def test_fp16_autocast_on_cpu_skips_injected_steps_bit_identically(pl):
    policy = DynamicPolicy(initial_scale=2.0**12, growth_interval=3)
    plugin = LossScalePlugin("16-mixed", device="cpu", policy=policy)
    model = tiny.module_class(pl)(inject_inf_at=(2, 5))
    trainer, model = _fit(pl, plugin, model, max_steps=8)
    # Real fp16 autocast on the CPU (Trainer(precision="16-mixed") would have run bf16 here).
    assert set(model.autocast_dtypes) == {torch.float16}
    assert trainer.precision_plugin is plugin and trainer.global_step == 8
    for step, before, after in model.steps:
        assert tiny.same_bits(before, after) == (step in (2, 5)), step
    state = plugin.scaler.get_state()
    # 0,1 finite; 2 skip (back off to 2**11); 3,4 finite; 5 skip (2**10); 6,7 finite.
    assert state == (2.0**10, 2, 0, 2, 8)  # hysteresis_left refills only on growth


def test_autocast_follows_the_trainers_device_unless_one_was_given(pl):
    plugin = LossScalePlugin()
    plugin.device = "xpu"  # what the default would guess on a machine with another accelerator
    model = tiny.module_class(pl)(snapshots=False)
    _fit(pl, plugin, model, max_steps=1)
    assert plugin.device == "cpu" and model.autocast_dtypes == [torch.float16]
    given = LossScalePlugin(device="xpu")
    _fit(pl, given, tiny.module_class(pl)(snapshots=False), max_steps=1)
    assert given.device == "xpu"  # asked for explicitly: kept


def test_stock_16_mixed_on_cpu_is_bf16_which_is_why_the_plugin_exists(pl):
    model = tiny.module_class(pl)(snapshots=False)
    with pytest.warns(UserWarning, match="fp16 is not supported on CPU"):
        trainer = pl.Trainer(precision="16-mixed", **tiny.trainer_kwargs(max_steps=1))
    trainer.fit(model, tiny.data())
    assert model.autocast_dtypes == [torch.bfloat16]


def test_gradient_accumulation_skips_the_whole_window_with_an_inf(pl):
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**12, growth_interval=100))
    model = tiny.module_class(pl)(inject_inf_at=(1,))
    trainer, model = _fit(pl, plugin, model, max_steps=3, accumulate_grad_batches=2)
    assert trainer.global_step == 3
    # Six batches, an optimizer step after every second one; the Inf is in window 1 (batches 2, 3).
    assert [step for step, _, _ in model.steps] == [0, 0, 1, 1, 2, 2]
    assert [not tiny.same_bits(b, a) for _, b, a in model.steps] == [False, True, False, False, False, True]
    # One update per window, not per batch: 3 steps, 1 skipped, one back-off.
    assert plugin.scaler.get_state() == (2.0**11, 1, 0, 1, 3)


def test_bf16_keeps_the_scale_at_one_but_skips_and_counts(pl):
    plugin = LossScalePlugin("bf16-mixed", device="cpu")
    model = tiny.module_class(pl)(inject_inf_at=(1, 2))
    _, model = _fit(pl, plugin, model, max_steps=5)
    assert set(model.autocast_dtypes) == {torch.bfloat16}
    assert plugin.policy == FixedPolicy(1.0)
    state = plugin.scaler.get_state()
    assert state.scale == 1.0 and state.skipped_steps == 2 and state.steps == 5
    assert [tiny.same_bits(b, a) for _, b, a in model.steps] == [False, True, True, False, False]


def test_gradient_clipping_sees_unscaled_gradients(pl):
    """SGD with lr=1: the update equals the clipped gradient, whose norm must be the clip value."""
    clip = 1e-3
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**14))
    model = tiny.module_class(pl)(optimizer="plain_sgd", lr=1.0)
    _fit(pl, plugin, model, max_steps=2, gradient_clip_val=clip)
    for _, before, after in model.steps:
        delta = torch.cat([(b - a).flatten() for b, a in zip(before[0], after[0], strict=True)])
        # Clipping scaled gradients would give clip / 2**14 here.
        assert math.isclose(delta.norm().item(), clip, rel_tol=1e-3)


def test_clipping_is_refused_for_fused_optimizers(pl):
    plugin = LossScalePlugin(device="cpu")
    model = tiny.module_class(pl)(optimizer="adam_fused", snapshots=False)
    with pytest.raises(RuntimeError, match="fused"):
        _fit(pl, plugin, model, max_steps=1, gradient_clip_val=1.0)


def test_fused_optimizer_skips_on_the_device(pl):
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**8))
    model = tiny.module_class(pl)(optimizer="adam_fused", inject_inf_at=(3,))
    _fit(pl, plugin, model, max_steps=5)
    assert [tiny.same_bits(b, a) for _, b, a in model.steps] == [False, False, False, True, False]
    assert plugin.scaler.get_state().skipped_steps == 1
    assert plugin.scaler.last_step_skipped() is None  # the decision never came to the host


@pytest.mark.parametrize("optimizer, hold, lag",
                         [("sgd", True, 2), ("sgd", False, 0), ("adam_fused", True, 2),
                          ("adam_fused", False, 0)])
def test_lr_schedulers_are_held_on_skipped_steps_by_default(pl, optimizer, hold, lag):
    plugin = LossScalePlugin(device="cpu", hold_lr_schedulers=hold)
    model = tiny.module_class(pl)(optimizer=optimizer, inject_inf_at=(2, 4), scheduler=True, snapshots=False)
    trainer, _ = _fit(pl, plugin, model, max_steps=6)
    assert plugin.lr_scheduler_lag == lag
    # StepLR(gamma=0.9) stepped once per applied update when held, once per attempted step otherwise;
    # a fused optimizer decides on the device, and its schedule is held there (no host read).
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.9 ** (6 - lag))
    assert type(trainer.optimizers[0].param_groups[0]["lr"]) is float  # put back when fit ended
    assert LossScalePlugin(device="cpu").hold_lr_schedulers  # on by default


def _module_that_watches_its_schedulers(pl):
    """Records, at every batch, what the hold looks like from the user's side."""

    class Watching(tiny.module_class(pl)):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            self.own_scheduler = config["lr_scheduler"]["scheduler"]
            self.hook_calls, self.seen = 0, []
            return config

        def lr_scheduler_step(self, scheduler, metric):
            self.hook_calls += 1  # the user's own hook, called on every step, held or not
            super().lr_scheduler_step(scheduler, metric)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            scheduler = self.lr_schedulers()
            self.seen.append(("lr_scheduler_step" in vars(self), scheduler, "step" in vars(scheduler)))

    return Watching


@pytest.mark.parametrize("optimizer", ["sgd", "adam_fused"])
def test_holding_patches_nothing_of_the_module_and_is_undone_when_fit_ends(pl, optimizer):
    plugin = LossScalePlugin(device="cpu")
    model = _module_that_watches_its_schedulers(pl)(optimizer=optimizer, inject_inf_at=(2, 4), scheduler=True,
                                                    snapshots=False)
    trainer, _ = _fit(pl, plugin, model, max_steps=6)
    # No method of the module was replaced at any step; the hook ran on every step, with the user's own
    # scheduler (no wrapper), whose step() was held during the run.
    assert [patched for patched, _, _ in model.seen] == [False] * 6 and model.hook_calls == 6
    assert all(scheduler is model.own_scheduler and held for _, scheduler, held in model.seen)
    # Afterwards the scheduler is the stock one again; the schedule lags the two skips.
    assert trainer.lr_scheduler_configs[0].scheduler is model.own_scheduler
    assert "step" not in vars(model.own_scheduler) and "state_dict" not in vars(model.own_scheduler)
    assert plugin.lr_scheduler_lag == 2 and model.own_scheduler.last_epoch == 4


def test_without_holding_the_schedulers_step_as_stock(pl):
    plugin = LossScalePlugin(device="cpu", hold_lr_schedulers=False)
    model = _module_that_watches_its_schedulers(pl)(scheduler=True, snapshots=False)
    _fit(pl, plugin, model, max_steps=2)
    assert [(scheduler, held) for _, scheduler, held in model.seen] == [(model.own_scheduler, False)] * 2


def test_the_summary_says_how_far_the_held_schedule_lags(pl):
    plugin = LossScalePlugin(device="cpu", hold_lr_schedulers=True)
    monitor = LossScaleMonitor(health=None)
    model = tiny.module_class(pl)(inject_inf_at=(1, 3), scheduler=True, snapshots=False)
    _fit(pl, plugin, model, max_steps=5, callbacks=[monitor])
    assert "the schedule is 2 scheduler step(s) behind the optimizer steps attempted" in monitor.summary


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_sync_found_inf_is_settled_at_setup_under_model_parallel(tmp_path):
    """ModelParallelStrategy (one process, gloo, run apart): the all-reduce is on from the first step."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "model_parallel_sync.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    # Decided when the Trainer set the run up, before any optimizer step; put back when fit ended.
    assert seen == {"train_start": True, "steps": [True, True, True], "after_fit": "auto"}


def test_held_schedulers_still_checkpoint_and_the_lag_is_restored(tmp_path):
    import lightning.pytorch as pl

    plugin = LossScalePlugin(device="cpu", hold_lr_schedulers=True)
    model = tiny.module_class(pl)(inject_inf_at=(1,), scheduler=True, snapshots=False)
    trainer, model = _fit(pl, plugin, model, max_steps=3)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    # Nothing of the hold may leak into the scheduler's state (it is its __dict__): it must pickle.
    assert all(not callable(v) for v in scheduler.state_dict().values())
    assert "lr_scheduler_step" not in vars(model)  # the hold is gone once its step was swallowed
    path = str(tmp_path / "held.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["LossScalePlugin"]["lr_scheduler_lag"] == 1 == plugin.lr_scheduler_lag
    resumed = LossScalePlugin(device="cpu", hold_lr_schedulers=True)
    resumed.load_state_dict(saved["LossScalePlugin"])
    assert resumed.lr_scheduler_lag == 1 and resumed.scaler.get_state() == plugin.scaler.get_state()


def test_mid_run_checkpoints_and_the_lr_monitor_see_the_held_schedule(pl, tmp_path):
    plugin = LossScalePlugin(device="cpu", hold_lr_schedulers=True)
    model = tiny.module_class(pl)(inject_inf_at=(1, 3), scheduler=True, snapshots=False)
    every_step = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    logger = pl.loggers.CSVLogger(tmp_path, name="csv", version=0)
    _fit(pl, plugin, model, max_steps=5, callbacks=[every_step, pl.callbacks.LearningRateMonitor()],
         enable_checkpointing=True, logger=logger, log_every_n_steps=1)
    for step in range(1, 6):
        saved = torch.load(tmp_path / "ckpt" / f"epoch=0-step={step}.ckpt", weights_only=False)
        # The user's scheduler state (its own keys only) and the lag add up to the steps attempted.
        assert saved["lr_schedulers"][0]["last_epoch"] + saved["LossScalePlugin"]["lr_scheduler_lag"] == step
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        lrs = [float(row["lr-SGD"]) for row in csv.DictReader(f) if row["lr-SGD"]]
    assert lrs == pytest.approx([0.05, 0.05 * 0.9, 0.05 * 0.9, 0.05 * 0.9**2, 0.05 * 0.9**2])


def test_resumes_a_checkpoint_of_lightnings_own_mixed_precision_plugin(pl, tmp_path):
    stock = pl.plugins.precision.MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    trainer, _ = _fit(pl, stock, tiny.module_class(pl)(inject_inf_at=(0,), snapshots=False), max_steps=4)
    path = str(tmp_path / "stock.ckpt")
    trainer.save_checkpoint(path)
    # 0 skipped (512), 1, 2 finite: growth (1024), 3 finite: tracker 1.
    assert stock.scaler.get_scale() == 2.0**10 and stock.scaler._get_growth_tracker() == 1
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(hysteresis=2))
    model = tiny.module_class(pl)(snapshots=False)
    resumed = pl.Trainer(plugins=[plugin], **tiny.trainer_kwargs(max_steps=4))
    resumed.fit(model, tiny.data(), ckpt_path=path)  # nothing left to train: only the restore
    assert plugin.scaler.get_state() == (2.0**10, 1, 2, 0, 0)
    assert plugin.policy == DynamicPolicy(growth_interval=2, hysteresis=2)


def test_plugin_mirrors_mixed_precision_signature_and_uses_a_given_scaler(pl):
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**8, growth_interval=2))
    plugin = LossScalePlugin("16-mixed", "cpu", scaler)
    assert plugin.scaler is scaler and plugin.policy is scaler.policy
    assert isinstance(plugin.scaler, torch.amp.GradScaler)  # what code written for MixedPrecision checks
    model = tiny.module_class(pl)(inject_inf_at=(1,), snapshots=False)
    trainer = pl.Trainer(plugins=[plugin], **tiny.trainer_kwargs(max_steps=4))
    trainer.fit(model, tiny.data())
    assert scaler.get_state().skipped_steps == 1 and scaler.get_state().steps == 4


def test_plugin_state_dict_round_trip():
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=3.0e4, hysteresis=2))
    other = LossScalePlugin(device="cpu")
    other.load_state_dict(plugin.state_dict())
    assert other.policy == plugin.policy and other.scaler.get_state() == plugin.scaler.get_state()
    # A bf16 run cannot resume a checkpoint whose policy scales: refused before anything changes.
    bf16 = LossScalePlugin("bf16-mixed", device="cpu")
    for saved in (plugin.state_dict(), torch.amp.GradScaler("cpu").state_dict()):
        with pytest.raises(ValueError, match="bf16-mixed"):
            bf16.load_state_dict(saved)
    assert bf16.policy == FixedPolicy(1.0)
    bf16.load_state_dict(LossScalePlugin("bf16-mixed", device="cpu").state_dict())


@pytest.mark.parametrize("kwargs, match", [
    ({"precision": "16"}, "precision"),
    ({"precision": "bf16-mixed", "policy": DynamicPolicy()}, "policy"),
    ({"device": torch.device("cpu")}, "device"),
    ({"device": "gpu"}, "device"),
    ({"sync_found_inf": "sometimes"}, "sync_found_inf"),
    ({"hold_lr_schedulers": "yes"}, "hold_lr_schedulers"),
    ({"scaler": torch.amp.GradScaler("cpu")}, "for a stock torch.amp.GradScaler use Lightning's own"),
    ({"scaler": LossScaler(), "policy": DynamicPolicy()}, "pass either scaler or policy"),
    ({"precision": "bf16-mixed", "scaler": LossScaler()}, "bf16-mixed"),
    ({"scaler": DynamicPolicy()}, r"third argument is the scaler.*LossScalePlugin\(policy=DynamicPolicy"),
])
def test_plugin_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScalePlugin(**kwargs)
