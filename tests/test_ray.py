"""Ray Train: ``TorchTrainer(num_workers=2)`` on a local CPU cluster, one Ray session for the module.

``ray_scripts/ray_runs.py`` runs every Ray job in one subprocess (Ray's workers are processes of
their own; about 4 to 6 minutes on 2 shared cores, most of it Ray starting workers); the tests read
back ``Result.metrics``, the run's TensorBoard folder and what each worker saw.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import background
import pytest

pytest.importorskip("ray.train")
pytest.importorskip("torch")

SCRIPT = os.path.join(os.path.dirname(__file__), "ray_scripts", "ray_runs.py")
pytestmark = pytest.mark.slow


def _command(out) -> tuple[list[str], dict, int]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", RAY_DEDUP_LOGS="1")
    return [sys.executable, SCRIPT, str(out)], env, 900


_OUT: list = []  # the folder of the run started in the background


def start_in_background(items, tmp_path_factory) -> None:
    """The Ray session starts with the session (``tests/background.py``), if a test of this module runs."""
    index = next(i for i, item in enumerate(items) if item.module.__name__ == __name__)
    out = tmp_path_factory.mktemp("ray")
    argv, env, timeout = _command(out)
    background.submit("ray", argv, env=env, timeout=timeout, order=index)
    _OUT.append(out)


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    if background.submitted("ray"):
        out, proc = _OUT[0], background.wait("ray")
    else:
        out = tmp_path_factory.mktemp("ray")
        argv, env, timeout = _command(out)
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def load(name):
        return json.loads((out / f"{name}.json").read_text())

    return load


def _tensorboard(folder):
    from lossscale_callbacks.tensorboard._reader import read_run

    return read_run(folder)


def test_metrics_reach_result_and_the_runs_tensorboard(ray_runs):
    pytest.importorskip("tensorboard")
    full = ray_runs("full")
    metrics = full["metrics"]
    assert metrics["loss_scale/steps"] == 40 and metrics["loss_scale/skipped_steps"] == 2
    assert metrics["loss_scale/scale"] == ray_runs("full_worker0")["state"]["scale"]
    assert metrics["loss_scale/ranks_disagree"] == 0 and metrics["step"] == 40  # ours and the user's
    folder = os.path.join(full["path"], "tensorboard")
    assert len(os.listdir(folder)) == 1  # one writer: rank 0
    series = _tensorboard(folder)
    assert [step for step, _ in series["loss_scale/scale"]] == [10, 20, 30, 40]
    assert series["loss_scale/scale"][-1][1] == metrics["loss_scale/scale"]


def test_a_restored_run_continues_as_the_uninterrupted_one(ray_runs):
    full, resumed = ray_runs("full"), ray_runs("resumed")
    assert resumed["first"]["metrics"]["loss_scale/steps"] == 20
    assert resumed["second"]["metrics"] == full["metrics"]
    for worker in (0, 1):
        before, after = ray_runs(f"full_worker{worker}"), ray_runs(f"resumed_worker{worker}")
        assert after["state"] == before["state"] and after["params"] == before["params"]
    pytest.importorskip("tensorboard")
    # two event files (one per start), read as one run that never went back
    series = _tensorboard(os.path.join(resumed["second"]["path"], "tensorboard"))
    uninterrupted = _tensorboard(os.path.join(full["path"], "tensorboard"))
    assert series["loss_scale/scale"] == uninterrupted["loss_scale/scale"]


def test_one_worker_skipping_a_step_does_not_hang(ray_runs):
    skip = ray_runs("skip")  # it ended: every worker reported equally
    states = [ray_runs(f"skip_worker{w}")["state"] for w in (0, 1)]
    assert states[0]["skipped_steps"] == 0 and states[1]["skipped_steps"] == 1
    assert skip["metrics"]["loss_scale/ranks_disagree"] == 1
    assert skip["metrics"]["loss_scale/skipped_steps"] == 0  # rank 0's values are the ones kept
    assert "rank(s) 1 differ from rank 0" in ray_runs("skip_worker0")["summary"]


def test_wandb_and_tensorboard_are_written_by_one_worker(ray_runs):
    pytest.importorskip("wandb")
    from lossscale_callbacks.wandb._reader import read_run, wait_until_finished

    path = ray_runs("skip")["path"]
    (run,) = glob.glob(os.path.join(path, "wandb", "offline-run-*"))  # one worker wrote
    wait_until_finished(run)
    assert read_run(run)["loss_scale/ranks_disagree"] == [(10, 1.0), (20, 1.0)]
    assert len(os.listdir(os.path.join(path, "tensorboard"))) == 1


@pytest.mark.parametrize("name", ["lightning", "transformers"])
def test_rays_report_callbacks_carry_our_metrics(ray_runs, name):
    metrics = ray_runs(name)["metrics"]
    assert metrics["loss_scale/scale"] > 0 and metrics["loss_scale/steps"] > 0, metrics
    # two DDP workers: the monitor compared their states (Lightning's and the Trainer's rank path)
    assert metrics["loss_scale/ranks_disagree"] == 0


def test_the_readme_block_runs(ray_runs):
    metrics = ray_runs("readme")["metrics"]
    assert metrics["loss_scale/steps"] == 30 and metrics["loss_scale/ranks_disagree"] == 0


def test_skip_truth_known_answer_in_every_worker(ray_runs):
    """100 steps, an Inf at 3, 17, 42 on both workers (fused AdamW under DDP): exactly those reported, the
    schedule and the EMA held on each, the applied steps in what the workers reported."""
    import skip_runs as sr
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    stock = []
    for _ in range(sr.APPLIED):
        stock.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    for rank in (0, 1):
        seen = ray_runs(f"skip_truth_worker{rank}")
        assert [tuple(o) for o in seen["listed"]] == [(s, "overflow") for s in sr.INJECTED]
        assert seen["lrs"] == stock and seen["last_epoch"] == seen["n_averaged"] == sr.APPLIED
        assert "not_held" not in seen["verdicts"]
        # what each worker's ray.train.report carried (Result.metrics comes with a checkpoint's report)
        assert seen["metrics"]["loss_scale/applied_steps"] == sr.APPLIED
        assert seen["metrics"]["loss_scale/skipped_overflow"] == 3
