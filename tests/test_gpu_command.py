"""``python3 dev.py gpu``: a dry run without CUDA; on a GPU, parts that fail or overrun do not stop the run.

Nothing here needs a GPU: the real run's machinery is exercised with stand-in parts, the markdown file
with the JSON the benchmarks write on this machine, the offline install into a fresh environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import background
import pytest
from repo_scripts import ROOT, load_script

NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
DRY_RUN = "test_without_cuda_dev_py_gpu_says_so_and_exits_0_after_a_dry_run"


def _dry_run(folder: Path) -> list[str]:
    return [sys.executable, str(ROOT / "dev.py"), "gpu", "--out", str(folder / "figures.md"),
            "--work", str(folder / "work")]


_DRY_RUN_FOLDER: list[Path] = []  # where the dry run started in the background runs


def start_in_background(items, tmp_path_factory) -> None:
    """The dry run (every part's command started once: 20 s of imports) beside the other tests
    (``tests/background.py``)."""
    index = next((i for i, item in enumerate(items)
                  if item.module.__name__ == __name__ and item.originalname == DRY_RUN), None)
    if index is not None:
        folder = tmp_path_factory.mktemp("dry_run")
        background.submit("gpu dry run", _dry_run(folder), env=NO_CUDA, timeout=600, cwd=str(folder),
                          order=index)
        _DRY_RUN_FOLDER.append(folder)


@pytest.fixture(scope="module")
def gpu():
    return load_script("benchmarks/gpu.py")


def _python_part(gpu, name: str, code: str, budget_s: int = 60, **kwargs):
    return gpu.Part(name, name.title(), budget_s, ("-c", code), **kwargs)


@pytest.mark.slow
def test_without_cuda_dev_py_gpu_says_so_and_exits_0_after_a_dry_run(tmp_path):
    folder = _DRY_RUN_FOLDER[0] if background.submitted("gpu dry run") else tmp_path
    done = background.result("gpu dry run", _dry_run(folder), env=NO_CUDA, timeout=600, cwd=str(folder))
    assert not done.timed_out, done.failure()
    out, work = folder / "figures.md", folder / "work"
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "this is not a CUDA machine, so only the dry run runs" in lines[0]
    for name in ("install", "environment", "cuda-tests", "torch-small", "torch-large", "alignment",
                 "keras-torch", "keras-jax", "keras-trace-jax", "budget"):
        assert any(line.split()[:2] == ["ok", name] for line in lines), (name, done.stdout)
    assert lines[-1] == "[gpu] dry run passed: every part would run"
    assert not out.exists() and not work.exists()  # nothing installed, nothing measured


def test_every_part_fits_one_ten_minute_device_call(gpu):
    parts = gpu.plan()
    assert gpu.INSTALL_BUDGET_S + sum(p.budget_s for p in parts) <= gpu.BUDGET_S < 10 * 60
    assert [p.name for p in parts] == ["environment", "cuda-tests", "torch-small", "torch-large", "alignment",
                                       "keras-torch", "keras-jax", "keras-trace-jax"]
    tests = next(p for p in parts if p.name == "cuda-tests")
    assert {"tests/test_cuda.py", "tests/test_torch_scaler.py"} <= set(tests.argv)


@pytest.mark.slow
def test_the_dry_run_names_a_part_that_would_not_run(gpu, capsys):
    small = next(p for p in gpu.plan() if p.name == "torch-small")
    stale = gpu.Part("stale", "Stale", 10, (*small.argv, "--no-such-option"))
    missing = gpu.Part("missing", "Missing", 10, ("benchmarks/no_such_script.py",))
    assert gpu.dry_run([stale, missing], None) is False
    printed = capsys.readouterr().out
    assert "BROKEN    stale" in printed and "unrecognized arguments: --no-such-option" in printed
    assert "BROKEN    missing      benchmarks/no_such_script.py does not exist" in printed
    assert printed.rstrip().endswith("[gpu] dry run broken: stale, missing")


def test_a_part_that_overruns_is_killed_with_what_it_started(gpu, tmp_path):
    (tmp_path / "logs").mkdir()
    marker = tmp_path / "grandchild-survived"
    # The part starts a grandchild that would write the marker after 8 s: killing the part's process group
    # (at 4 s: time enough to start Python and print on a busy machine) must end it too.
    grandchild = f"import time; time.sleep(8); open({str(marker)!r}, 'w')"
    code = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
            "print('started', flush=True)\ntime.sleep(60)")
    part = _python_part(gpu, "slow", code, budget_s=4)
    start = time.monotonic()
    result = gpu.run_part(part, Path(sys.executable), time.monotonic() + 100, tmp_path)
    assert time.monotonic() - start < 30
    assert (result.status, result.ok) == ("timed out after 4 s", False)
    assert "started" in result.output
    time.sleep(max(0.0, start + 9.5 - time.monotonic()))  # past the grandchild's 8 s
    assert not marker.exists()


def test_failures_and_overruns_are_reported_and_the_rest_goes_on(gpu, tmp_path, monkeypatch):
    ok = gpu.Result("install", "Install (offline)", ["pip ..."], status="ok", ok=True)
    monkeypatch.setattr(gpu, "_install_result", lambda wheels, venv_dir: (ok, Path(sys.executable), False))
    parts = [
        _python_part(gpu, "boom", "import sys; print('half a figure'); sys.exit(3)"),
        _python_part(gpu, "slow", "import time; time.sleep(60)", budget_s=1),
        _python_part(gpu, "fine", "print('| figure | 1.0 |')"),
        _python_part(gpu, "keras-part", "print('never')", needs_keras=True),
    ]
    out = tmp_path / "figures.md"
    args = argparse.Namespace(out=out, work=tmp_path / "work", budget=300, wheels=None, no_venv=False,
                              argv=["--out", str(out)])
    assert gpu.full_run(parts, args) == 1
    text = out.read_text()
    for line in ("| Boom | failed (exit 3) |", "| Slow | timed out after 1 s |", "| Fine | ok |",
                 "| Keras-Part | skipped: no Keras (carry a keras wheel: docs/gpu.md) |",
                 "<details><summary>boom: failed (exit 3)</summary>", "half a figure"):
        assert line in text, line


def test_parts_without_time_left_are_not_started(gpu, tmp_path, monkeypatch):
    ok = gpu.Result("install", "Install (offline)", ["pip ..."], status="ok", ok=True)
    monkeypatch.setattr(gpu, "_install_result", lambda wheels, venv_dir: (ok, Path(sys.executable), True))
    out = tmp_path / "figures.md"
    args = argparse.Namespace(out=out, work=tmp_path / "work", budget=gpu.MIN_PART_S - 5, wheels=None,
                              no_venv=False, argv=[])
    assert gpu.full_run([_python_part(gpu, "late", "print(1)")], args) == 1
    assert "| Late | not run: out of time (" in out.read_text()


def test_a_failed_install_is_reported_and_nothing_else_runs(gpu, tmp_path, monkeypatch):
    failed = gpu.Result("install", "Install (offline)", ["pip ..."], status="failed: no setuptools")
    monkeypatch.setattr(gpu, "_install_result", lambda wheels, venv_dir: (failed, None, False))
    out = tmp_path / "figures.md"
    args = argparse.Namespace(out=out, work=tmp_path / "work", budget=300, wheels=None, no_venv=False,
                              argv=[])
    assert gpu.full_run([_python_part(gpu, "tests", "print(1)")], args) == 1
    text = out.read_text()
    assert "| Install (offline) | failed: no setuptools |" in text
    assert "| Tests | not run: the install failed |" in text


# --------------------------------------------------------------------------- the markdown file

H100 = {"device": {"cuda": True, "name": "NVIDIA H100 80GB HBM3", "count": 1, "capability": "9.0", "sms": 132,
                   "memory_gib": 79.1, "peak_bandwidth_gbs": 3352.3, "torch_cuda": "12.8", "cudnn": 91000,
                   "driver": "570.1"},
        "versions": {"python": "3.12.3", "torch": "2.11.0", "keras": None},
        "jax_backend": "gpu (1 device(s))", "platform": "Linux"}


def _benchmark_json(tmp_path: Path, script: str, *args: str) -> tuple[Path, str]:
    path = tmp_path / f"{Path(script).stem}.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", str(path),
                           *args], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=NO_CUDA)
    assert done.returncode == 0, done.stderr
    return path, done.stdout


@pytest.mark.slow
def test_the_figures_file_reads_what_the_benchmarks_write(gpu, tmp_path):
    report = load_script("benchmarks/_gpu_report.py")
    env_json = tmp_path / "environment.json"
    env_json.write_text(json.dumps(H100))
    torch_json, torch_out = _benchmark_json(tmp_path, "torch_overhead.py", "--device", "cpu")
    align_json, align_out = _benchmark_json(tmp_path, "alignment_gemm.py")
    tests_out = ("....s\nCUDA tests: run on NVIDIA H100 80GB HBM3: 24 tests marked cuda\n"
                 "23 passed, 1 skipped in 9.12s\n")
    results = [
        report.Result("environment", "The machine", ["probe"], "ok", True, 1.0, "", env_json),
        report.Result("cuda-tests", "CUDA tests", ["pytest"], "ok", True, 9.0, tests_out),
        report.Result("torch-small", "small", ["torch_overhead.py"], "ok", True, 5.0, torch_out, torch_json),
        report.Result("torch-large", "large", ["torch_overhead.py"], "ok", True, 5.0, torch_out, torch_json),
        report.Result("alignment", "GEMM", ["alignment_gemm.py"], "failed (exit 1)", False, 2.0, align_out,
                      align_json),
        report.Result("keras-jax", "Keras on JAX", ["keras_overhead.py"], "failed (exit 1)", False, 2.0,
                      "Traceback: no figures\n"),
    ]
    meta = report.Meta("2026-12-01 10:00 UTC", "`abc1234 bench`", 1140, "python3 dev.py gpu")
    text = report.render(meta, results)
    assert text.startswith("# GPU figures: NVIDIA H100 80GB HBM3\n")
    assert "| peak memory bandwidth | 3352 GB/s" in text
    assert "pytest: **23 passed, 1 skipped in 9.12s**" in text
    assert "| sgd_foreach |" in text and "Size: sgd_foreach: GradScaler's step" in text
    assert "below 300M" in text  # the quick model is no large model, and the file says so
    assert "## Unscale pass against the memory-bandwidth floor" in text
    data = json.loads(torch_json.read_text())["optimizers"]["adamw_fused"]
    achieved = 2 * data["bandwidth"]["grad_bytes"] / data["unscale_s"]["ours"] / 1e9
    assert f"| torch-large | adamw_fused | 0 | {data['unscale_s']['ours'] * 1e3:.3f} |" in text
    assert f"| {achieved:.0f} | {data['bandwidth']['copy_bandwidth_gbs']:.0f} | 3352 |" in text
    assert "| in-1 | 63 | 64 | 128 | high | n/a | n/a | n/a |" in text and "no timings" in text
    assert "## Keras on JAX" in text and "No figures (see the log below)." in text


def test_a_part_whose_figures_cannot_be_read_says_so(tmp_path):
    report = load_script("benchmarks/_gpu_report.py")
    broken = tmp_path / "torch.json"
    broken.write_text(json.dumps({"optimizers": {"sgd_foreach": {"renamed": 1}}}))
    result = report.Result("torch-small", "small", ["torch_overhead.py"], "ok", True, 1.0, "| table |",
                           broken)
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"device": {"cuda": True}, "versions": {}}))
    env = report.Result("environment", "The machine", ["probe"], "ok", True, 1.0, "probe output", machine)
    text = report.render(report.Meta("now", "x", 10, "gpu"), [env, result])
    assert "The figures could not be read (KeyError: 'median_step_s'); see the log below." in text
    assert "The figures could not be read (KeyError: 'name'); see the log below." in text
    assert text.startswith("# GPU figures: unknown device\n")
    assert "## Unscale pass against the memory-bandwidth floor\n\nThe figures could not be read" in text


# ------------------------------------------------------------------------------ the offline install


@pytest.mark.slow
def test_offline_install_into_a_fresh_environment_that_sees_this_ones_packages(tmp_path):
    install = load_script("benchmarks/_gpu_install.py")
    steps: list[str] = []
    done = install.install(ROOT, tmp_path / "venv", None, steps.append)
    code = "import lossscale_callbacks.torch, lossscale_callbacks, torch; print(lossscale_callbacks.__file__)"
    imported = subprocess.run([str(done.python), "-c", code], capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).is_relative_to(ROOT)
    assert done.python.is_relative_to(tmp_path) and done.keras is not None  # keras is installed here
    assert any(step.startswith("lossscale-callbacks installed editable") for step in steps), steps


def _bare_python312() -> str | None:
    """A Python 3.12 that runs and has no setuptools (what the GPU machine's Python starts as)."""
    code = ("import sys, importlib.util\n"
            "print(sys.version_info[:2] == (3, 12), importlib.util.find_spec('setuptools'))")
    pyenv = sorted(Path("/root/.pyenv/versions").glob("3.12*/bin/python3.12"))
    for candidate in (shutil.which("python3.12"), *map(str, pyenv)):
        if candidate:
            probe = subprocess.run([candidate, "-c", code], capture_output=True, text=True, timeout=60)
            if probe.returncode == 0 and probe.stdout.split() == ["True", "None"]:
                return candidate
    return None


@pytest.mark.slow
def test_a_bare_python_312_without_carried_setuptools_is_told_what_to_carry(tmp_path):
    python = _bare_python312()
    if python is None:
        pytest.skip("no Python 3.12 without setuptools on this machine")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\nfrom pathlib import Path\n"
            "import _gpu_install as g\n"
            "try: g.install(Path(sys.argv[2]), Path(sys.argv[3]), None, print)\n"
            "except g.InstallError as exc: print('InstallError:', exc); sys.exit(7)")
    done = subprocess.run([python, "-c", code, str(ROOT / "benchmarks"), str(ROOT), str(tmp_path / "venv")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 7, done.stdout + done.stderr
    assert "setuptools is missing; the build needs >= 77 and no setuptools wheel was carried" in done.stdout
    assert "InstallError: cannot install the project" in done.stdout and "docs/gpu.md" in done.stdout


def test_wheel_names_and_versions(tmp_path):
    install = load_script("benchmarks/_gpu_install.py")
    for name in ("setuptools-80.9.0-py3-none-any.whl", "keras-3.12.0-py3-none-any.whl",
                 "lossscale_callbacks-0.1.0-py3-none-any.whl", "keras_hub-0.1-py3-none-any.whl"):
        (tmp_path / name).write_text("")
    assert install.find_wheel(tmp_path, "keras").name == "keras-3.12.0-py3-none-any.whl"
    assert install.find_wheel(tmp_path, "lossscale-callbacks").name.startswith("lossscale_callbacks-0.1.0")
    assert install.find_wheel(tmp_path, "numpy") is None and install.find_wheel(None, "keras") is None
    assert install.version_tuple("80.9.0") == (80, 9, 0) and install.version_tuple("77.0rc1") == (77, 0)
    assert install.build_requirement(ROOT) == ("setuptools", (77,))


def test_every_test_that_needs_cuda_carries_the_marker_the_gpu_command_selects():
    """A CUDA test skipped by its own ``skipif`` would be left out of ``pytest -m cuda`` on the GPU."""
    pattern = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    unmarked = [f"{path.name}:{text[:match.start()].count(chr(10)) + 1}"
                for path in sorted((ROOT / "tests").glob("test_*.py"))
                for text in [path.read_text()] for match in pattern.finditer(text)]
    assert not unmarked, f"use @pytest.mark.cuda (tests/conftest.py skips it without CUDA) at {unmarked}"


@pytest.mark.slow
def test_cuda_tests_are_skipped_without_cuda_and_the_summary_line_says_so():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    done = subprocess.run(command, cwd=ROOT, env=NO_CUDA, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    count = sum(1 for line in lines if "needs a CUDA device (CUDA_VISIBLE_DEVICES='' hides the GPUs)" in line)
    assert count >= 1 and " passed" not in done.stdout
    assert "CUDA tests: skipped (CUDA_VISIBLE_DEVICES='' hides the GPUs): " in done.stdout
    assert any(line.endswith("tests marked cuda") for line in lines)
