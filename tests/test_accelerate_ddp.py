"""Two CPU processes under Accelerate's launcher (gloo), launched as a separate script: the skip decision
is global, and only the main process writes."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "hf_scripts", "accelerate_ddp.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_two_processes_skip_the_same_steps_and_one_writes(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    for var in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "fp16", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    proc = subprocess.run([*launch, SCRIPT, str(tmp_path), "--steps", "8"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {(name, rank): json.load(open(tmp_path / f"{name}_rank{rank}.json"))
            for name in ("ours", "stock", "trainer") for rank in (0, 1)}

    for name in ("ours", "stock"):
        r0, r1 = runs[name, 0], runs[name, 1]
        # Injected on rank 1 only, before the all-reduce: both ranks skip steps 2 and 5, scale alike.
        assert r0["skipped"] == r1["skipped"] == [2, 5]
        assert r0["scales"] == r1["scales"] == [1024, 1024, 512, 512, 512, 256, 256, 256]
        assert r0["weights"] == r1["weights"] and r0["last"] == r1["last"]
        assert (r0["writer"], r1["writer"]) == (True, False)
        # One writer: one event file in the tracker's folder and one in the sink's.
        for folder in ("tracker", "sink"):
            assert len(glob.glob(str(tmp_path / name / folder / "events.out.tfevents.*"))) == 1
    assert runs["ours", 0]["scales"] == runs["stock", 0]["scales"]

    t0, t1 = runs["trainer", 0], runs["trainer", 1]
    assert t0["state"] == t1["state"] and t0["state"]["skipped_steps"] == 2 and t0["state"]["steps"] == 8
    assert t0["weights"] == t1["weights"] and (t0["writer"], t1["writer"]) == (True, False)
    assert len(glob.glob(str(tmp_path / "trainer" / "runs" / "*" / "events.out.tfevents.*"))) == 1
    # The summary is printed once per run (by the main process), though every rank computed it.
    assert proc.stdout.count("Loss scaling: 8 optimizer steps, 2 skipped") == 3
