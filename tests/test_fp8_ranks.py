"""The ranks' fp8 scales compared through the loop's rank check (acceptance 3 of the fp8 issue): two gloo
processes (``fp8_scripts/fp8_ranks.py``, a timeout on every collective) train a torchao float8 model; the
ranks that never broadcast their weights cast them with other scales, and it is said; the synced control
(DDP) says nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "fp8_scripts" / "fp8_ranks.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("torchao")
    out = tmp_path_factory.mktemp("fp8_ranks")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lambda mode: [json.loads((out / f"{mode}_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_ranks_with_unsynced_weights_cast_with_other_scales_and_it_is_said(ranks):
    runs = ranks("unsynced")
    for run in runs:  # every rank judges alike
        (verdict,) = run["verdicts"]
        assert verdict[:2] == ["ranks_disagree", 10]
        assert "rank 1 differs from rank 0" in verdict[2] and "0/weight" in verdict[2]
        assert "PR #442" in verdict[2]
    assert runs[0]["disagree"] == [[10, 1.0], [20, 1.0]] and runs[1]["disagree"] == []  # rank 0 writes
    assert "The ranks' fp8 scales disagreed 1 time(s) in 2 compared read(s)" in runs[0]["summary"]


@pytest.mark.slow
def test_the_synced_control_says_nothing(ranks):
    runs = ranks("synced")
    for run in runs:
        assert run["verdicts"] == []
        assert "compared at 2 read(s) and always agreed" in run["summary"] and "Health: OK" in run["summary"]
    assert runs[0]["disagree"] == [[10, 0.0], [20, 0.0]]
