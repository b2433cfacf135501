"""The Hugging Face examples run as written (their ``main`` with command-line arguments, in this process),
and ``report`` reads what they wrote."""

from __future__ import annotations

import glob

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_scripts import tiny_accelerate
from repo_scripts import load_script
from report_json import the_read_run

from lossscale_callbacks._cli import main as cli_main


@pytest.fixture(autouse=True)
def in_a_fresh_folder(tmp_path, monkeypatch):
    """Each example starts where a user would: an empty folder, and no Accelerator made yet."""
    monkeypatch.chdir(tmp_path)
    tiny_accelerate.reset_accelerate()
    yield
    tiny_accelerate.reset_accelerate()


def _report(path, capsys) -> dict:
    capsys.readouterr()
    assert cli_main(["report", str(path), "--json"]) == 0
    return the_read_run(capsys.readouterr().out)


def _step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step")]


@pytest.mark.slow
def test_accelerate_loop_and_its_resume(tmp_path, capsys):
    example = load_script("examples/accelerate_loop.py")
    args = ["--steps", "20", "--log-every", "5", "--inject-inf-every", "8", "--out", "runs"]
    monitor = example.main(args)
    full = capsys.readouterr().out
    steps = _step_lines(full)
    # Steps 8 and 16 overflow: the scale halves twice from 2**16.
    assert [line.split()[1] for line in steps] == ["5", "10", "15", "20"]
    assert steps[-1].split()[-3:] == ["16384", "skipped", "2"]
    assert monitor.summary.startswith("Loss scaling: 20 optimizer steps, 2 skipped (10.00%)")
    assert monitor.summary in full
    payload = _report(tmp_path / "runs" / "accelerate_loop", capsys)
    assert (payload["steps"], payload["skipped_steps"], payload["final_scale"]) == (20, 2, 16384.0)
    # Resumed from the checkpoint saved at step 10: the same steps, bit for bit the same losses.
    tiny_accelerate.reset_accelerate()
    resumed = example.main([*args, "--resume"])
    assert _step_lines(capsys.readouterr().out) == steps[2:]
    assert resumed.summary == monitor.summary


@pytest.mark.slow
def test_transformers_trainer(tmp_path, capsys):
    example = load_script("examples/transformers_trainer.py")
    callback = example.main(["--steps", "12", "--log-every", "4", "--inject-inf-every", "5", "--diagnose",
                             "--out", "runs"])
    out = capsys.readouterr().out
    assert callback.summary.startswith("Loss scaling: 12 optimizer steps, 2 skipped (16.67%)")
    assert callback.summary in out
    assert "The overflow started in layer `transformer.wte` in all 2 skipped steps" in callback.summary
    (run,) = glob.glob(str(tmp_path / "runs" / "runs" / "*"))
    payload = _report(run, capsys)
    assert (payload["steps"], payload["skipped_steps"], payload["final_scale"]) == (12, 2, 16384.0)
    assert payload["series"]["train/loss_scale/scale"] == [[4, 65536.0], [8, 32768.0], [12, 16384.0]]
