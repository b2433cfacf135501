"""The GEMM benchmark's checker part runs without a GPU and says that timings need one."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script

torch = pytest.importorskip("torch")



def test_benchmark_checker_part_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this test covers the no-GPU path")
    module = load_script("benchmarks/alignment_gemm.py")
    out = tmp_path / "rows.json"
    assert module.main(["--size", "256", "--json", str(out), "--strict"]) == 0
    printed = capsys.readouterr().out
    assert "Tensor Core timings need a CUDA GPU" in printed
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["agree"] is None
    worst = {r["shape"]: r["worst"] for r in data["rows"]}
    assert worst == {"aligned": "none", "in+8 (aligned)": "none", "in-1": "high", "in+4 (mult. of 4)": "high",
                     "out-1": "high", "out+2": "high", "tokens-1": "low", "in-1,out-1": "high"}
    assert all("ms" not in r for r in data["rows"])  # no invented numbers
