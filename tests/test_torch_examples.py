"""The PyTorch/Lightning examples and the overhead benchmark run as a user would run them."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(path: str, *args: str, cwd) -> str:
    # A W&B run started earlier in this pytest process leaves WANDB_* variables behind; the
    # example must start its own run, as a user's would.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, path), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
def test_torch_loop(tmp_path, fused):
    args = ["--steps", "60", "--log-every", "20", "--inject-inf-every", "25", "--tensorboard", "tb"]
    out = _run("examples/torch_loop.py", *args, *(["--fused"] if fused else []), cwd=tmp_path)
    # Steps 24 and 49 overflow (plus whatever the scale itself does): at least those two skipped.
    last = [line for line in out.splitlines() if line.startswith("step")][-1].split()
    assert last[1] == "60" and int(last[-1]) >= 2
    assert "Loss scaling: 60 optimizer steps" in out
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


@pytest.mark.slow
def test_lightning_quickstart(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run("examples/lightning_quickstart.py", "--steps", "30", "--out", "runs", cwd=tmp_path)
    (log_dir,) = glob.glob(str(tmp_path / "runs" / "quickstart" / "version_*"))
    acc = EventAccumulator(log_dir)
    acc.Reload()
    # Lightning's logging step (batch index from 0), with the optimizer steps attempted as a value.
    assert [e.step for e in acc.Scalars("loss_scale/scale")] == [9, 19, 29]
    assert [e.value for e in acc.Scalars("loss_scale/steps")] == [10, 20, 30]
    assert glob.glob(str(tmp_path / "runs" / "wandb" / "offline-run-*" / "*.wandb"))


@pytest.mark.slow
def test_overhead_benchmark_runs_and_counts_host_reads(tmp_path):
    args = ["--device", "cpu", "--width", "64", "--depth", "2", "--batch", "4", "--rounds", "3",
            "--steps", "2", "--warmup", "1", "--unscale-repeats", "3", "--update-repeats", "5",
            "--lightning", "--lightning-rounds", "3", "--lightning-steps", "3", "--lightning-width", "16",
            "--json", "out.json"]
    out = _run("benchmarks/torch_overhead.py", *args, cwd=tmp_path)
    assert "| sgd_foreach |" in out and "| adamw_fused |" in out
    with open(tmp_path / "out.json") as f:
        everything = json.load(f)
    results = everything["optimizers"]
    # Counted, not timed: our whole step dispatches no more aten ops than GradScaler's, update() at most 4.
    for result in results.values():
        ops = result["aten_ops"]
        assert ops["ours"]["step"] <= ops["torch"]["step"] and ops["ours"]["update"] <= 4
        assert ops["torch"]["update"] == 1 and result["update_s"]["ratio"] > 0
    fit = everything["lightning"]
    assert fit["ours/stock"] > 0 and fit["stock_again/stock"] > 0 and set(fit["median_step_s"]) == {
        "stock", "stock_again", "ours"}
    # The skip decision of a non-fused optimizer, like GradScaler; nothing at all with a fused one.
    assert results["sgd_foreach"]["host_reads_per_step"] == {"ours": 1, "torch": 1}
    assert results["adamw_fused"]["host_reads_per_step"] == {"ours": 0, "torch": 0}
    for result in results.values():
        assert len(result["ratios"]) == 3 and result["median_ratio"] > 0
        assert result["bandwidth"]["floor_s"] > 0 and result["unscale_over_floor"]["ours"] > 0
