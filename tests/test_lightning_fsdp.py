"""FSDP with 2 CPU processes (gloo), with the Trainer and with Fabric: one skip decision for all shards.

Every run is ``tests/lightning_scripts/fsdp_runs.py``, all modes in one launch of two processes
(Lightning launches rank 1 by re-running the script). Rank 1 gets an Inf in its own shard of a gradient
at global steps 1 and 3, after FSDP's reduce-scatter, where rank 0 cannot see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_scripts", "fsdp_runs.py")
MODES = ("trainer", "trainer_resumed", "trainer_unsynced", "trainer_stock", "fabric", "fabric_resumed",
         "fabric_stock")
# Steps 1 and 3 skipped, the scale halved each time (growth_interval=100: no growth in 5 steps).
SCALES = [1024.0, 512.0, 512.0, 256.0, 256.0]
SKIPPED = [0, 1, 1, 2, 2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("MASTER_PORT", None)
    # One launch for every mode, in order (the resumed modes read the checkpoints of the modes before).
    proc = subprocess.run([sys.executable, SCRIPT, str(out), *MODES], env=env, capture_output=True,
                          text=True, timeout=480)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = {}
    for mode in MODES:
        for rank in (0, 1):
            with open(out / f"{mode}_rank{rank}.json") as f:
                results[mode, rank] = json.load(f)
    results["out"] = out
    return results


def _column(states, key):
    return [s[key] for s in states]


def _scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def test_trainer_fsdp_both_ranks_skip_the_same_steps_and_end_identical(runs):
    r0, r1 = runs["trainer", 0], runs["trainer", 1]
    assert _column(r0["states"], "scale") == SCALES
    assert _column(r0["states"], "skipped_steps") == SKIPPED
    assert r0["states"] == r1["states"]
    # summon_full_params gathers every shard: the whole model is the same on both ranks
    assert r0["params"] == r1["params"]


def test_trainer_fsdp_without_the_reduced_flag_the_ranks_diverge(runs):
    # The control: the same run with sync_found_inf=False. Only rank 1 sees its Inf.
    u0, u1 = runs["trainer_unsynced", 0], runs["trainer_unsynced", 1]
    assert _column(u0["states"], "skipped_steps") == [0, 0, 0, 0, 0]
    assert _column(u1["states"], "skipped_steps")[:4] == [0, 1, 1, 2]
    assert _column(u0["states"], "scale") == [1024.0] * 5
    # Rank 0 applied the steps to its shard, rank 1 did not: the gathered model is a mix, unlike the
    # model both ranks agree on above.
    assert u0["params"] != runs["trainer", 0]["params"]


def test_trainer_fsdp_metrics_reach_the_tensorboard_logger(runs):
    log_dir = runs["out"] / "tb" / "trainer" / "version_0"
    assert _scalars(log_dir, "loss_scale/scale") == SCALES
    assert _scalars(log_dir, "loss_scale/skipped_steps") == SKIPPED


def test_trainer_fsdp_resumed_from_a_sharded_checkpoint_continues_the_same_run(runs):
    # The checkpoint was written after step 3 (after the first skip); the resumed run injects at step 3.
    full, resumed = runs["trainer", 0], runs["trainer_resumed", 0]
    assert resumed["states"] == full["states"][3:]
    assert runs["trainer_resumed", 1]["states"] == full["states"][3:]
    assert resumed["params"] == full["params"] == runs["trainer_resumed", 1]["params"]
    # The monitor counts from the checkpoint: 5 steps, 2 skipped, not 2 and 1.
    log_dir = runs["out"] / "tb" / "trainer_resumed" / "version_0"
    assert _scalars(log_dir, "loss_scale/skipped_steps") == SKIPPED[3:]
    assert _scalars(log_dir, "loss_scale/steps") == [4.0, 5.0]


def test_the_sharded_trainer_checkpoint_also_carries_what_fsdp_precision_reads(runs):
    # Lightning's own FSDPPrecision restores its ShardedGradScaler from the entry under its name.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    saved = torch.load(runs["out"] / "epoch=0.ckpt" / "meta.pt", weights_only=False)
    stock = ShardedGradScaler("cpu")
    stock.load_state_dict(saved["FSDPPrecision"])
    # After step 3 (0-2 ran; 1 skipped): what our plugin saved next to it.
    assert stock.get_scale() == SCALES[2] == saved["LossScaleFSDPPlugin"]["scale"]
    assert stock._get_growth_tracker() == 1 and stock.get_growth_interval() == 100


def test_trainer_stock_fsdp_precision_sharded_grad_scaler_is_read_by_the_monitor(runs):
    s0, s1 = runs["trainer_stock", 0], runs["trainer_stock", 1]
    assert _column(s0["states"], "scale") == SCALES == _column(s1["states"], "scale")
    assert s0["params"] == s1["params"]
    log_dir = runs["out"] / "tb" / "trainer_stock" / "version_0"
    assert _scalars(log_dir, "loss_scale/scale") == SCALES
    # ShardedGradScaler counts no skipped steps; the monitor does, on the device.
    assert _scalars(log_dir, "loss_scale/skipped_steps") == SKIPPED


def test_fabric_fsdp_skips_the_same_steps_logs_and_resumes(runs):
    f0, f1 = runs["fabric", 0], runs["fabric", 1]
    assert _column(f0["states"], "scale") == SCALES
    assert _column(f0["states"], "skipped_steps") == SKIPPED
    assert f0["states"] == f1["states"] and f0["params"] == f1["params"]
    log_dir = runs["out"] / "tb" / "fabric" / "version_0"
    assert _scalars(log_dir, "loss_scale/scale") == SCALES
    # Resumed from fabric.save's sharded checkpoint after step 3 (the monitor carried the scaler).
    resumed = runs["fabric_resumed", 0]
    assert resumed["states"] == f0["states"][3:] == runs["fabric_resumed", 1]["states"]
    assert resumed["params"] == f0["params"] == runs["fabric_resumed", 1]["params"]


def test_fabric_stock_fsdp_precision_read_by_the_fabric_monitor(runs):
    s0, s1 = runs["fabric_stock", 0], runs["fabric_stock", 1]
    assert _column(s0["states"], "scale") == SCALES
    assert _column(s0["states"], "skipped_steps") == SKIPPED
    assert s0["states"] == s1["states"] and s0["params"] == s1["params"]
    # the stock scaler and ours made the same decisions on the same run
    assert s0["params"] == runs["fabric", 0]["params"]
    log_dir = runs["out"] / "tb" / "fabric_stock" / "version_0"
    assert _scalars(log_dir, "loss_scale/skipped_steps") == SKIPPED


def test_strategy_fsdp_by_name_accepts_our_plugin_and_refuses_the_plain_one(monkeypatch):
    """``Trainer(strategy="fsdp", plugins=[...])`` as users write it; it needs CUDA, so the count is mocked
    (the Trainer is only built, nothing runs)."""
    pl = pytest.importorskip("lightning.pytorch")
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pl_cuda

    from lossscale_callbacks.lightning import LossScaleFSDPPlugin, LossScalePlugin

    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugin = LossScaleFSDPPlugin()
    trainer = pl.Trainer(accelerator="gpu", devices=2, strategy="fsdp", plugins=[plugin], logger=False)
    assert type(trainer.strategy) is pl.strategies.FSDPStrategy
    assert trainer.strategy.precision_plugin is plugin
    # The plain LossScalePlugin is what FSDPStrategy refuses (hence LossScaleFSDPPlugin).
    with pytest.raises(TypeError, match="FSDPPrecision"):
        pl.Trainer(accelerator="gpu", devices=2, strategy="fsdp", plugins=[LossScalePlugin()], logger=False)
