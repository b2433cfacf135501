"""The plain-PyTorch page's loop under DDP: four gloo ranks, an Inf on rank 2 after the all-reduce.

``torch_scripts/page_under_ddp.py`` runs the page's first block as written on four processes, wrapped in
``DistributedDataParallel`` (as the Many GPUs page does) with an Inf written into rank 2's gradient at step
30, after DDP's all-reduce; the page's loop reads ``scaler.read_state``, which compares the ranks at its
log interval (20 steps). About 30 s on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = os.path.join(os.path.dirname(__file__), "torch_scripts", "page_under_ddp.py")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_the_plain_pytorch_loop_names_the_rank_that_went_its_own_way(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "paths/pytorch.md", "4", "2", "30", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = [(tmp_path / f"rank{r}.txt").read_text() for r in range(4)]
    states = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    # The page's batches are random, so an early overflow may come too (on every rank alike: the gradients
    # are all-reduced); step 30 is rank 2's alone.
    skipped = [s["skipped_steps"] for s in states]
    assert skipped[2] == skipped[0] + 1 and skipped[0] == skipped[1] == skipped[3]
    # At the next log interval (step 40) rank 0 warns, naming rank 2 and its scale; and says it at the end.
    warning = re.search(r"LossScaleHealthWarning: .*different loss-scale states at step 40 \(rank\(s\) 2 "
                        r"differ from rank 0\): ranks 0, 1, 3: .*; rank 2: scale (\d+), growth counter \d+, "
                        r"(\d+) of 40 steps skipped", printed[0])
    assert warning, printed[0]
    assert float(warning.group(1)) == states[2]["scale"]  # its scale at step 40 (it did not change since)
    assert int(warning.group(2)) == skipped[2]
    assert "[ranks_disagree at step 40]" in printed[0]
    assert "disagreed 1 time(s) in 5 compared read(s), first at step 40" in printed[0]
    assert printed[1:] == ["", "", ""]  # the other ranks print nothing: rank 0 speaks for the run
