"""DDP with 2 CPU processes (gloo), launched as a separate script: the skip decision is global."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_scripts", "ddp_skip.py")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_ddp_inf_on_one_rank_after_the_all_reduce_is_skipped_on_both(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--steps", "6", "--inject-step", "3"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {}
    for mode in ("synced", "unsynced"):
        for rank in (0, 1):
            with open(tmp_path / f"{mode}_rank{rank}.json") as f:
                runs[mode, rank] = json.load(f)

    # With the all-reduced overflow flag: both ranks skip step 3, same scale, same weights.
    r0, r1 = runs["synced", 0], runs["synced", 1]
    assert r0["skipped_steps"] == r1["skipped_steps"] == [3]
    assert r0["state"] == r1["state"]
    assert r0["state"]["scale"] == 512.0 and r0["state"]["skipped_steps"] == 1
    assert r0["weights"] == r1["weights"]
    # Metrics reach the loggers from rank 0 only.
    assert r0["loss_scale_log_calls"] == 6 and r1["loss_scale_log_calls"] == 0

    # Control without it: only the injected rank skips, and the ranks drift apart.
    u0, u1 = runs["unsynced", 0], runs["unsynced", 1]
    assert u0["skipped_steps"] == [] and u1["skipped_steps"] == [3]
    assert u0["state"]["scale"] != u1["state"]["scale"]
    assert u0["weights"] != u1["weights"]
