"""The FSDP2 fp16 recipe (``examples/fsdp2_fp16_rl.py``) side by side with torch's ``ShardedGradScaler``.

Two gloo CPU processes, one launch (about 30 s on 2 shared cores): ``fully_shard`` with an fp16
``MixedPrecisionPolicy``, an Inf in rank 1's shard at steps 5 and 6, clipping, a checkpoint at step
15 and a resume from it, once with ``LossScaler`` and once with ``ShardedGradScaler``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "fsdp2_fp16_rl.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, EXAMPLE, "--scaler", "both", "--record", "--steps", "30",
                           "--checkpoint-at", "15", "--inject", "5,6", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(kind, run, rank): json.loads((out / f"{kind}_{run}_rank{rank}.json").read_text())
            for kind in ("ours", "sharded") for run in ("full", "resumed") for rank in (0, 1)}


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_same_scales_skips_and_parameters_as_sharded_grad_scaler(runs):
    ours, stock = runs["ours", "full", 0], runs["sharded", "full", 0]
    assert ours["skipped"][4:7] == [0, 1, 2] and ours["skipped"][-1] == 2  # steps 5 and 6 skipped
    assert len(set(ours["scales"])) > 2  # backed off and grew again
    for rank in (0, 1):
        assert runs["ours", "full", rank]["scales"] == ours["scales"]
        assert runs["sharded", "full", rank]["scales"] == ours["scales"]
        assert runs["ours", "full", rank]["skipped"] == runs["sharded", "full", rank]["skipped"]
        assert runs["ours", "full", rank]["params"] == runs["sharded", "full", rank]["params"]
    assert ours["verdicts"] == [] and "compared at 3 read(s) and always agreed" in ours["summary"]
    assert stock["summary"].startswith("Loss scaling: 30 optimizer steps, 2 skipped")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("kind", ["ours", "sharded"])
def test_resume_continues_as_the_uninterrupted_run(runs, kind):
    for rank in (0, 1):
        full, resumed = runs[kind, "full", rank], runs[kind, "resumed", rank]
        assert resumed["start"] == 15
        assert resumed["scales"] == full["scales"][15:] and resumed["skipped"] == full["skipped"][15:]
        assert resumed["params"] == full["params"]
        assert resumed["verdicts"] == []
