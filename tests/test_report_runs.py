"""``lossscale-callbacks report`` lists every run below a folder: read, or why not and what to install.

Each case of issue 19: a missing reader (its run listed with the extra to install), the bare "no
reader" message, one readable run among unreadable ones, a run without loss-scale series, a
truncated event file, a symlinked run folder, a ``.wandb`` file outside an ``offline-run-*``
folder, and a file the user may not read (run as a non-root user). Text and ``--json`` alike; the
JSON has one shape for one run or many.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import wandb

from lossscale_callbacks._cli import main
from lossscale_callbacks._policy import DynamicPolicy
from lossscale_callbacks._update import initial_state, next_state
from lossscale_callbacks.loop._logging_loop import LoggingLoop
from lossscale_callbacks.report._run_readers import FoundRun, discover_runs
from lossscale_callbacks.tensorboard._sink import TensorBoardSink
from lossscale_callbacks.wandb._reader import wait_until_finished
from lossscale_callbacks.wandb._sink import WandbSink

PIP_WANDB = 'pip install "lossscale-callbacks[wandb]"'
PIP_TENSORBOARD = 'pip install "lossscale-callbacks[tensorboard]"'


def _loop_run(sinks, steps=300, p_inf=0.01, seed=0):
    policy = DynamicPolicy(initial_scale=2.0**15, growth_interval=50)
    loop = LoggingLoop(policy, sinks=sinks, health=None, echo=None)
    rng = np.random.default_rng(seed)
    state = initial_state(policy)
    for _ in range(steps):
        state = next_state(policy, state, bool(rng.random() > p_inf))
        if int(state.steps) % 25 == 0:  # the end of a log interval
            loop.observe(state)
    loop.finish(state)
    loop.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """runs/: a TensorBoard run, a W&B offline run (and W&B's latest-run link), a run without loss
    scale, a truncated copy of the TensorBoard run, a linked run folder from outside, a lone .wandb file."""
    base = tmp_path_factory.mktemp("mixed")
    root = base / "runs"
    _loop_run([TensorBoardSink(root / "tb")])
    _loop_run([WandbSink(project="t", dir=str(root), mode="offline")], seed=1)
    if wandb.run is not None:
        wandb.run.finish()
    (run_dir,) = (root / "wandb").glob("offline-run-*")
    wait_until_finished(str(run_dir))
    no_scale = TensorBoardSink(root / "no_scale")
    no_scale.write(1, {"epoch_loss": 0.5})
    no_scale.close()
    shutil.copytree(root / "tb", root / "truncated")
    (event_file,) = (root / "truncated").iterdir()
    data = event_file.read_bytes()
    event_file.write_bytes(data[: len(data) * 2 // 3])
    _loop_run([TensorBoardSink(base / "elsewhere" / "run")], seed=2)
    (root / "linked").symlink_to(base / "elsewhere" / "run")
    (root / "exported").mkdir()
    shutil.copy(next(run_dir.glob("*.wandb")), root / "exported" / "sweep-7.wandb")
    return root


def _names(root, paths):
    return [os.path.relpath(p, root) for p in paths]


def test_discovery_finds_every_run_by_name(mixed):
    runs = discover_runs(str(mixed))
    (run_dir,) = (mixed / "wandb").glob("offline-run-*")
    assert [(os.path.relpath(r.path, mixed), r.kind) for r in runs] == [
        ("exported/sweep-7.wandb", "wandb"), ("linked", "tensorboard"), ("no_scale", "tensorboard"),
        ("tb", "tensorboard"), ("truncated", "tensorboard"), (os.path.relpath(run_dir, mixed), "wandb")]
    assert (mixed / "wandb" / "latest-run").is_symlink()  # W&B's alias of the same run: listed once
    assert discover_runs(str(mixed / "exported" / "sweep-7.wandb")) == [
        FoundRun(str(mixed / "exported" / "sweep-7.wandb"), "wandb")]


def test_a_link_loop_ends(tmp_path):
    _loop_run([TensorBoardSink(tmp_path / "a")])
    (tmp_path / "a" / "up").symlink_to(tmp_path)
    (tmp_path / "a" / "self").symlink_to(tmp_path / "a")
    assert [r.path for r in discover_runs(str(tmp_path))] == [str(tmp_path / "a")]


def test_every_run_is_listed_in_text_and_json(mixed, capsys):
    assert main(["report", str(mixed)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"exported/sweep-7.wandb", "linked", "no_scale", "tb", "truncated",
                         *_names(mixed, (mixed / "wandb").glob("offline-run-*"))}
    assert "no loss-scale series: the run has no loss_scale/scale series" in rows["no_scale"]
    assert rows["linked"].split()[1] == "300" and rows["exported/sweep-7.wandb"].split()[1] == "300"
    assert 0 < int(rows["truncated"].split()[1]) < 300

    assert main(["report", str(mixed), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert set(payload) == {"root", "runs", "png", "counts", "error"}
    statuses = {os.path.relpath(r["path"], mixed): r["status"] for r in payload["runs"]}
    assert statuses.pop("no_scale") == "no_loss_scale" and set(statuses.values()) == {"read"}
    assert payload["counts"] == {"runs": 6, "read": 5, "no_loss_scale": 1, "unreadable": 0, "unhealthy": 0,
                                 "damaged": 0}
    # a run without loss-scale series is listed, but it is no failure
    assert main(["report", str(mixed), "--fail-unhealthy"]) == 0


def test_the_json_shape_does_not_change_with_the_number_of_runs(mixed, capsys):
    assert main(["report", str(mixed / "tb"), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["report", str(mixed), "--json"]) == 0
    many = json.loads(capsys.readouterr().out)
    assert set(one) == set(many) and len(one["runs"]) == 1
    assert set(one["runs"][0]) == set(next(r for r in many["runs"] if r["status"] == "read"))


def _hidden(*packages: str) -> str:
    # The import system refuses a module whose sys.modules entry is None: as if it were not installed.
    return "".join(f"sys.modules[{p!r}] = None; " for p in packages)


def _report_without(packages, *argv, cwd=None):
    code = (f"import sys; {_hidden(*packages)}"
            "from lossscale_callbacks._cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "report", *map(str, argv)], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_a_run_whose_reader_is_missing_is_listed_with_the_extra_to_install(mixed):
    done = _report_without(["wandb"], mixed)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[2:]}
    (run_dir,) = _names(mixed, (mixed / "wandb").glob("offline-run-*"))
    for name in (run_dir, "exported/sweep-7.wandb"):
        assert "not read: the W&B run reader cannot be loaded" in rows[name] and PIP_WANDB in rows[name]
    assert rows["tb"].split()[1] == "300"

    done = _report_without(["wandb"], mixed, "--json")
    runs = {os.path.relpath(r["path"], mixed): r for r in json.loads(done.stdout)["runs"]}
    assert runs[run_dir]["status"] == "unreadable" and runs[run_dir]["install"] == PIP_WANDB
    assert runs[run_dir]["reader"] == "wandb" and "wandb" in runs[run_dir]["reason"]

    done = _report_without(["wandb"], mixed, "--fail-unhealthy")
    assert done.returncode == 1 and "2 not read" in done.stderr


def test_one_readable_run_among_unreadable_ones_lists_them_all(mixed, tmp_path):
    root = tmp_path / "logs"
    shutil.copytree(mixed / "tb", root / "train")
    shutil.copytree(mixed / "wandb", root / "wandb", symlinks=True)
    shutil.copytree(mixed / "no_scale", root / "validation")
    done = _report_without(["wandb"], root)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"Run: {root / 'train'} (read as tensorboard")
    assert "Optimizer steps attempted: 300" in out
    assert "Not read (2 of the 3 runs below" in out
    assert "validation: no loss-scale series" in out and PIP_WANDB in out

    done = _report_without(["wandb"], root, "--json")
    payload = json.loads(done.stdout)
    assert [r["status"] for r in payload["runs"]] == ["read", "no_loss_scale", "unreadable"]
    assert _report_without(["wandb"], root, "--fail-unhealthy").returncode == 1


def test_no_reader_at_all_names_the_pip_commands(mixed, tmp_path):
    done = _report_without(["wandb", "tensorboard"], mixed / "tb")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "the TensorBoard run reader cannot be loaded" in line and PIP_TENSORBOARD in line

    unknown = tmp_path / "run.bin"
    unknown.write_bytes(b"\0" * 64)
    done = _report_without(["wandb", "tensorboard"], unknown)
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and "no installed reader could be loaded" in line
    assert PIP_TENSORBOARD in line and PIP_WANDB in line


def test_png_without_the_plot_extra_is_refused_before_anything_is_read(tmp_path):
    hide = _hidden("matplotlib")
    code = (f"import sys; {hide}from lossscale_callbacks._cli import main\n"
            "try:\n    main(['report', 'nowhere', '--png', 'x.png'])\n"
            "except ImportError as exc:\n    print(f'{type(exc).__name__}: {exc}')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.stdout.startswith("MissingExtraError: report --png needs the 'matplotlib' package")
    assert 'pip install "lossscale-callbacks[plot]"' in done.stdout
    code = f"import sys; {hide}from lossscale_callbacks._cli import console; sys.exit(console(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "report", "nowhere", "--png", "x.png"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith("lossscale-callbacks: error: report --png needs")


def test_a_folder_where_nothing_can_be_read_lists_every_run_and_exits_2(mixed, tmp_path, capsys):
    shutil.copytree(mixed / "no_scale", tmp_path / "a")
    shutil.copytree(mixed / "no_scale", tmp_path / "b")
    assert main(["report", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert [line.split()[0] for line in captured.out.splitlines()[2:]] == ["a", "b"]
    assert "none of its 2 runs could be read" in captured.err


def _drop_to_nobody():
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def test_a_file_the_user_may_not_read_does_not_abort_the_folder(mixed):
    """As a non-root user (root reads everything): a chmod 000 event file and folder are listed, the
    rest is read."""
    if os.geteuid() == 0 and not hasattr(os, "setuid"):
        pytest.skip("cannot drop root privileges on this platform")
    copy = Path(tempfile.mkdtemp(prefix="report_perm_"))  # outside pytest's root-only tmp folders
    try:
        os.chmod(copy, 0o755)
        shutil.copytree(mixed / "tb", copy / "readable")
        shutil.copytree(mixed / "tb", copy / "locked_file")
        shutil.copytree(mixed / "tb", copy / "locked_folder" / "run")
        for path in [copy, *copy.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        (event_file,) = (copy / "locked_file").iterdir()
        os.chmod(event_file, 0o000)
        os.chmod(copy / "locked_folder", 0o000)
        as_root = os.geteuid() == 0
        command = [sys.executable, "-m", "lossscale_callbacks._cli", "report", str(copy), "--json"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=copy,
                                  preexec_fn=_drop_to_nobody if as_root else None)
        except (PermissionError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot run as a non-root user here: {exc}")
        if as_root and "Operation not permitted" in done.stderr:
            pytest.skip("cannot drop root privileges in this container")
        assert done.returncode == 0, done.stderr
        runs = {os.path.relpath(r["path"], copy): r for r in json.loads(done.stdout)["runs"]}
        assert runs["readable"]["status"] == "read" and runs["readable"]["steps"] == 300
        assert runs["locked_file"]["status"] == "unreadable"
        assert "Permission denied" in runs["locked_file"]["reason"]
        assert runs["locked_folder"]["status"] == "unreadable"
        assert "cannot be listed (Permission denied)" in runs["locked_folder"]["reason"]
    finally:
        for locked in (copy / "locked_folder", *(copy / "locked_file").glob("*")):
            os.chmod(locked, 0o755)
        shutil.rmtree(copy, ignore_errors=True)


@pytest.mark.slow
def test_the_sweep_benchmark_runs_in_its_quick_mode(tmp_path):
    """``benchmarks/report_read.py --sweep --quick``: 3 runs x 200 intervals, every figure printed."""
    from repo_scripts import ROOT

    command = [sys.executable, str(ROOT / "benchmarks" / "report_read.py"), "--sweep", "--quick", "--dir",
               str(tmp_path / "runs")]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = r"\d+\.\d+ s, CPU \d+\.\d+ s, peak \d+ MiB$"
    for pattern in (r"^3 runs x 200 intervals, ", rf"^lossscale-callbacks report \(text\): {figures}",
                    rf"^lossscale-callbacks report --json > file \([\d.]+ MiB\): {figures}",
                    rf"^TensorBoard EventMultiplexer \(every run, all scalars\): {figures}",
                    r"^ours \(text\) / TensorBoard's: \d+\.\d+ \(wall time\)$"):
        assert re.search(pattern, done.stdout, re.MULTILINE), (pattern, done.stdout)
