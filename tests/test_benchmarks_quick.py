"""Every benchmark runs in its quick mode and prints its figures, so none goes stale unnoticed.

Each script runs as a user runs it (``python benchmarks/<script>.py --quick``, in a subprocess) and its
output must hold every figure of its table. Only the shape of the figures is checked (a number where a
number belongs, never ``nan``), not their values: timings on a shared machine are not test material.
"""

from __future__ import annotations

import argparse
import doctest
import os
import re
import subprocess
import sys

import background
import pytest
from repo_scripts import ROOT, load_script

NUM = r"\d+\.\d+"  # a finite decimal figure: nan and inf do not match

# script -> (extra arguments besides --quick, patterns its output must hold, one per figure line)
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "advisor_overhead.py": ([], [
        rf"^{shape}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$" for shape in ("launch_bound", "mlp")
    ]),
    "alignment_gemm.py": ([], [
        r"^aligned\s+64\s+64\s+128\s+none",
        r"^in-1\s+63\s+64\s+128\s+high",
        r"^tokens-1\s+64\s+64\s+127\s+low",
        # No GPU: the checker's verdicts and the sentence that timings need one. A GPU: its timing columns.
        rf"(Tensor Core timings need a CUDA GPU|^out-1 .* high\s+{NUM}\s+{NUM}\s+{NUM}$)",
    ]),
    "engine_log_read.py": (["--dir", "{tmp}"], [
        *(rf"^{engine}: \d+ lines, \d+ MiB$" for engine in ("deepspeed", "megatron")),
        rf"^  lossscale-callbacks report: {NUM} s wall, {NUM} s CPU, peak \d+ MiB$",
        rf"^  the engine-log reader alone: {NUM} s wall, {NUM} s CPU, peak \d+ MiB$",
        rf"^  reading the lines only: {NUM} s wall, peak \d+ MiB$",
        rf"^  a quarter of the lines: {NUM} s wall, peak \d+ MiB$",
        rf"^  ours / reading the lines: {NUM} \(CPU time\)$",
    ]),
    # The two Keras timing scripts time one backend each here (a process a backend, 8 to 12 s each; the
    # same code under each): JAX in one, torch in the other; keras_overhead.py runs on TensorFlow.
    "forensics_overhead.py": (["--backends", "jax"], [
        rf"^{name}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
        for name in ("torch_adamw_foreach", "torch_adamw_fused", "torch_launch_bound_foreach",
                     "torch_launch_bound_fused", "keras_fit_jax")
    ]),
    # torchao in the script's process, Keras' fit on JAX in one of its own.
    "fp8_overhead.py": (["--backends", "jax"], [
        *(rf"^{name}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
          for name in ("torchao_tensorwise", "keras_fit_jax")),
        rf"^keras_fit_jax\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$",  # the callback by its parts
    ]),
    "keras_trace_overhead.py": (["--backends", "torch"], [
        rf"^keras_fit_torch\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
    ]),
    "keras_overhead.py": ([], [
        *(rf"^{arm}\s+{NUM}\s+{NUM}\s+{NUM}$" for arm in ("keras", "ours", r"ours\+cb", r"ours\+null")),
        *(rf"^{re.escape(label)}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$" for label in (
            "ours / keras LossScaleOptimizer", "ours + LossScaleCallback(100) / ours",
            "ours + empty batch-end callback / ours", "ours + LossScaleCallback / ours + empty")),
        rf"^LossScaleCallback host work: {NUM} us per batch, \d+ us per log",
    ]),
    "ledger_overhead.py": ([], [
        *(rf"^{arm}\s+{NUM}\s+\d+$" for arm in ("off", "off2", "ledger", "replay")),
        *(rf"^{arm} / off: {NUM} \(median of \d+ rounds; min {NUM}, max {NUM}; quartiles {NUM}-{NUM}; "
          rf"wall {NUM}\)$" for arm in ("off2", "ledger", "replay")),
        *(rf"^{arm} host work: -?{NUM} us per step \(-?{NUM} of this step\)$"
          for arm in ("ledger", "replay")),
    ]),
    "report_read.py": (["--dir", "{tmp}"], [
        r"^3000 events \(30 with loss_scale/\*\)",
        rf"^lossscale-callbacks report: {NUM} s, peak \d+ MiB$",
        rf"^TensorBoard EventAccumulator \(all scalars\): {NUM} s, peak \d+ MiB$",
        rf"^ours / TensorBoard's: {NUM} \(time\)$",
    ]),
    "skip_overhead.py": ([], [
        rf"^{row}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
        for row in ("mlp_foreach", "mlp_fused", "launch_bound_foreach", "launch_bound_fused")
    ]),
    "sink_write.py": ([], [
        rf"^{re.escape(sink)}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
        for sink in ("InMemorySink", "GuardedSink(InMemorySink)", "TensorBoardSink", "WandbSink (offline)")
    ]),
    "torch_overhead.py": ([], [
        *(rf"^\| {kind} \| {NUM}M \| {NUM} \| {NUM} \| {NUM} \| \d+/\d+ \| {NUM}/{NUM} \| {NUM} \| {NUM} "
          rf"\| \d+/\d+ \| {NUM} \|$" for kind in ("sgd_foreach", "adamw_fused")),
        rf"^copy bandwidth measured: {NUM} GB/s",
        *(rf"^\| {kind} \| \d+ / \d+ \| \d+ / 1 \| {NUM} \|$" for kind in ("sgd_foreach", "adamw_fused")),
    ]),
}

# The GPU command runs benchmarks rather than being one; modules named _* are the scripts' helpers.
NOT_BENCHMARKS = {"gpu.py"}


def test_every_benchmark_script_has_a_quick_run_here():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts - NOT_BENCHMARKS == set(SCRIPTS)


def _command(script: str, folder) -> list[str]:
    extra, _ = SCRIPTS[script]
    return [sys.executable, str(ROOT / "benchmarks" / script), "--quick",
            *(arg.format(tmp=folder) for arg in extra)]


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_in_background(items, tmp_path_factory) -> None:
    """The quick runs start with the session (``tests/background.py``), each in a folder of its own: only
    the shape of their figures is checked, so the tests running beside them change nothing."""
    quick = test_benchmark_quick_run_prints_its_figures.__name__
    for index, item in enumerate(items):
        if item.module.__name__ != __name__ or item.originalname != quick:
            continue
        folder, script = tmp_path_factory.mktemp("quick"), item.callspec.params["script"]
        background.submit(("quick", script), _command(script, folder), env=_env(), timeout=300,
                          cwd=str(folder), order=index)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_quick_run_prints_its_figures(script, tmp_path):
    _, patterns = SCRIPTS[script]
    if background.submitted(("quick", script)):
        done = background.wait(("quick", script))
        assert not done.timed_out, done.failure()
    else:
        done = subprocess.run(_command(script, tmp_path), cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("quick mode:") or "\nquick mode:" in done.stdout
    missing = [p for p in patterns if not re.search(p, done.stdout, re.MULTILINE)]
    assert not missing, f"figures missing from the output of {script}: {missing}\n{done.stdout}"


@pytest.mark.parametrize("script", ["forensics_overhead.py", "keras_trace_overhead.py"])
@pytest.mark.parametrize(("value", "message"), [
    ("tf", "--backends must name some of tensorflow, jax, torch, got 'tf'"),
    (",", "--backends must name some of tensorflow, jax, torch, got ','"),
])
def test_the_keras_timings_refuse_a_backend_keras_has_not(script, value, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--backends", value, "--quick"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_the_keras_timings_take_the_backends_named_in_order_once():
    module = load_script("benchmarks/forensics_overhead.py")
    parser = argparse.ArgumentParser()
    assert module.keras_backends(parser, "torch, jax,torch") == ["torch", "jax"]
    installed = module.keras_backends(parser, None)
    assert installed and set(installed) <= set(module.KERAS_ROWS)


@pytest.fixture
def quick_module():
    return load_script("benchmarks/_quick.py")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--width", type=int, default=1792)
    return parser


def test_quick_replaces_defaults_but_not_values_given(quick_module, capsys):
    args = quick_module.parse_args(_parser(), ["--quick", "--rounds", "3"], rounds=1, width=8)
    assert (args.quick, args.rounds, args.width) == (True, 3, 8)
    assert capsys.readouterr().out.startswith("quick mode:")
    args = quick_module.parse_args(_parser(), [], rounds=1, width=8)
    assert (args.quick, args.rounds, args.width) == (False, 11, 1792)
    assert capsys.readouterr().out == ""


def test_quick_refuses_a_value_for_an_option_the_script_lacks(quick_module):
    with pytest.raises(ValueError, match=r"\['steps'\]"):
        quick_module.parse_args(_parser(), ["--quick"], rounds=1, steps=2)


def test_check_args_parses_and_exits_without_running(quick_module, capsys):
    with pytest.raises(SystemExit) as stop:
        quick_module.parse_args(_parser(), ["--rounds", "5", "--check-args"], rounds=1)
    assert stop.value.code == 0
    assert "'rounds': 5" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # a bad argument is argparse's usage error, status 2
        quick_module.parse_args(_parser(), ["--rounds", "many", "--check-args"], rounds=1)
    assert stop.value.code == 2


def test_quick_docstring_example(quick_module):
    failures, attempted = doctest.testmod(quick_module)
    assert (failures, attempted) == (0, 3)
