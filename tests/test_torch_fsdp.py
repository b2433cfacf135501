"""FSDP with LossScaler on 2 CPU processes (gloo), launched as a separate script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = os.path.join(os.path.dirname(__file__), "lightning_scripts", "fsdp_skip.py")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_sharded_gradients_give_a_global_skip_decision(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {}
    for mode in ("fsdp1_auto", "fsdp1_off", "fsdp2_off"):
        for rank in (0, 1):
            with open(tmp_path / f"{mode}_rank{rank}.json") as f:
                runs[mode, rank] = json.load(f)

    # FSDP v1: "auto" recognises the flat parameters and all-reduces the flag: both ranks skip step 2.
    assert runs["fsdp1_auto", 0]["skipped"] == runs["fsdp1_auto", 1]["skipped"] == [2]
    assert runs["fsdp1_auto", 0]["state"] == runs["fsdp1_auto", 1]["state"]
    assert runs["fsdp1_auto", 0]["state"]["skipped_steps"] == 1
    # The control: without the all-reduce rank 0 never sees rank 1's Inf, steps, and the scales diverge.
    assert runs["fsdp1_off", 0]["skipped"] == [] and runs["fsdp1_off", 1]["skipped"] == [2]
    assert runs["fsdp1_off", 0]["state"]["scale"] != runs["fsdp1_off", 1]["state"]["scale"]
    # FSDP2: DTensor gradients; torch reduces the check kernel's flag itself, so the decision is global.
    assert runs["fsdp2_off", 0]["grad_type"] == "DTensor"
    assert runs["fsdp2_off", 0]["skipped"] == runs["fsdp2_off", 1]["skipped"] == [2]
    assert runs["fsdp2_off", 0]["state"] == runs["fsdp2_off", 1]["state"]
