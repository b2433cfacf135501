"""One command for a GPU machine: install offline, run the CUDA tests and GPU benchmarks, write the figures.

    python3 dev.py gpu                       # the same as: python3 benchmarks/gpu.py
    python3 dev.py gpu --wheels ~/wheels     # carried wheels: setuptools, keras and its dependencies
    python3 dev.py gpu --dry-run             # check every command it would run; run nothing

Made for a CUDA machine with Python 3.12, torch (CUDA), Lightning, pytest, hypothesis, tensorboard,
matplotlib and JAX, and no network, TensorFlow, Keras or W&B (``docs/gpu.md`` says what to carry).
In order, each part in its own process with its own time budget, at most 9 minutes in all (one call of a
GPU machine lent by the hour's quarter may run 10; the whole run took 3 on an H100):

1. install the project without the network into ``.gpu-run/venv``, which sees the machine's packages
   (``benchmarks/_gpu_install.py``), and Keras when a wheel of it is carried;
2. describe the machine: device, peak memory bandwidth, versions (``benchmarks/_gpu_probe.py``);
3. the CUDA tests (``pytest -m cuda``: sync-free fused AdamW, Lightning and Fabric steps under
   ``torch.cuda.set_sync_debug_mode("error")``, launches per update, per step, for the forensics);
4. ``torch_overhead.py`` on a small, launch-bound model (a step of at most 5 ms) and on a large one
   (at least 300M parameters), and from their figures the unscale pass against the memory bandwidth;
5. ``alignment_gemm.py --strict``: do the checker's high-severity findings cost time;
6. ``keras_overhead.py`` on Keras' torch and JAX backends, and ``keras_trace_overhead.py`` (the forward
   trace's cost) on JAX, when Keras is there.

The figures go to one markdown file (``--out``, default ``gpu-figures.md``) that names the device,
rewritten after every part: a part that fails or runs out of time is reported there and the rest
goes on. The exit status is 0 when every part ran (or was skipped for a stated reason), else 1.

Without a CUDA device it says so, runs the dry run (every script and test file exists and parses,
every benchmark accepts the arguments it would get, the CUDA tests are collected) and exits 0 when
that passes; ``tests/test_gpu_command.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from _gpu_install import (
    InstallError,
    build_requirement,
    find_wheel,
    install,
    installed_version,
    version_tuple,
)
from _gpu_report import Meta, Result, render

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".gpu-run"
BUDGET_S = 540  # 9 minutes: the run must end within one 10-minute call of a lent GPU machine
INSTALL_BUDGET_S = 60
MIN_PART_S = 20  # a part with less time left than this is not started
ENV = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "WANDB_MODE": "offline",
       "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # JAX would take 75 % of the GPU at import


@dataclass(frozen=True)
class Part:
    """One step of the run: ``python *argv`` from the checkout, with a time budget.

    ``check`` is what the dry run does with it: ``"args"`` runs the script with ``--check-args``,
    ``"collect"`` collects the tests, ``"compile"`` compiles the script.
    """

    name: str
    title: str
    budget_s: int
    argv: tuple[str, ...]
    check: str = "args"
    env: tuple[tuple[str, str], ...] = ()
    needs_keras: bool = False

    def json_path(self, work: Path) -> Path | None:
        return work / f"{self.name}.json" if "{json}" in self.argv else None

    def command(self, python: str | Path, work: Path, extra: tuple[str, ...] = ()) -> list[str]:
        """The command line, ``{json}`` replaced by the part's JSON file, ``extra`` options appended."""
        json_path = self.json_path(work)
        return [str(python), *(str(json_path) if a == "{json}" else a for a in self.argv), *extra]


def cuda_test_files(root: Path) -> list[str]:
    """The test files with CUDA tests: those that use the ``cuda`` marker."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
                  if "mark.cuda" in p.read_text())


def plan(root: Path = ROOT) -> list[Part]:
    """Every part after the install, in the order they run."""
    torch_overhead = ("benchmarks/torch_overhead.py", "--device", "cuda", "--json", "{json}")
    keras = ("benchmarks/keras_overhead.py", "--rounds", "7", "--steps", "200")
    return [
        Part("environment", "The machine", 20, ("benchmarks/_gpu_probe.py", "--json", "{json}"),
             check="compile"),
        Part("cuda-tests", "CUDA tests", 120,
             ("-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider", *cuda_test_files(root)),
             check="collect"),
        Part("torch-small", "torch_overhead.py, a small model (launch-bound step)", 45,
             (*torch_overhead, "--width", "1024", "--depth", "4", "--batch", "64", "--rounds", "21",
              "--steps", "20", "--warmup", "5", "--unscale-repeats", "21")),
        Part("torch-large", "torch_overhead.py, a large model (>= 300M parameters)", 60,
             (*torch_overhead, "--width", "8192", "--depth", "5", "--batch", "16", "--rounds", "9",
              "--steps", "5", "--warmup", "3", "--unscale-repeats", "11")),
        Part("alignment", "alignment_gemm.py --strict", 40,
             ("benchmarks/alignment_gemm.py", "--strict", "--json", "{json}")),
        Part("keras-torch", "keras_overhead.py, Keras on torch", 75, keras,
             env=(("KERAS_BACKEND", "torch"),), needs_keras=True),
        Part("keras-jax", "keras_overhead.py, Keras on JAX", 45, keras,
             env=(("KERAS_BACKEND", "jax"),), needs_keras=True),
        Part("keras-trace-jax", "keras_trace_overhead.py, the forward trace in fit on JAX", 60,
             ("benchmarks/keras_trace_overhead.py", "--here", "--rounds", "11", "--steps", "200"),
             env=(("KERAS_BACKEND", "jax"),), needs_keras=True),
    ]


# ------------------------------------------------------------------------------------ the dry run


def _check_part(part: Part, python: str) -> tuple[bool | None, str]:
    """(True: ok, False: broken, None: not checkable here) and what was found."""
    script = ROOT / part.argv[0] if part.argv[0] != "-m" else None
    if script is not None:
        if not script.exists():
            return False, f"{part.argv[0]} does not exist"
        compile(script.read_text(), str(script), "exec")  # a SyntaxError is the dry run's failure
        if part.check == "compile":
            return True, f"{part.argv[0]} compiles"
    extra = ("--collect-only",) if part.check == "collect" else ("--check-args",)
    env = {**os.environ, **ENV, **dict(part.env)}
    command = part.command(python, WORK, extra)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", done.stderr)
    if done.returncode != 0 and missing and part.check != "collect":
        return None, f"not checked here: {missing.group(1)} is not installed"
    if done.returncode != 0:
        return False, f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-1500:]}"
    if part.check == "collect":
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
        count = int(found.group(1)) if found else 0
        files = [arg for arg in part.argv if arg.startswith("tests/")]
        return count > 0, f"{count} CUDA tests collected from {', '.join(files)}"
    return True, f"{part.argv[0]} accepts {shlex.join(command[2:-1])}".replace(str(ROOT) + os.sep, "")


def _check_install(wheels: Path | None) -> tuple[bool, str]:
    """Whether the install part would find a recent setuptools (here or carried) or a wheel of the project."""
    name, minimum = build_requirement(ROOT)
    here = installed_version(Path(sys.executable), name)
    carried = {p: find_wheel(wheels, p) for p in (name, "keras", "lossscale-callbacks")}
    listed = ", ".join(f"{p}: {w.name if w else 'none'}" for p, w in carried.items())
    recent = here is not None and version_tuple(here) >= minimum
    ok = recent or carried[name] is not None or carried["lossscale-callbacks"] is not None
    advice = "" if ok else "; carry a setuptools wheel (docs/gpu.md)"
    return ok, (f"the build needs {name}>={'.'.join(map(str, minimum))} (here: {here or 'none'}); carried "
                f"wheels ({wheels or 'no --wheels'}): {listed}{advice}")


def dry_run(parts: list[Part], wheels: Path | None, python: str = sys.executable) -> bool:
    """Check every part; print one line each; True when nothing is broken."""
    total = INSTALL_BUDGET_S + sum(p.budget_s for p in parts)

    def check(part: Part) -> tuple[str, bool | None, str]:
        try:
            return (part.name, *_check_part(part, python))
        except (SyntaxError, OSError, subprocess.TimeoutExpired) as exc:
            return part.name, False, f"{type(exc).__name__}: {exc}"

    # Each check starts an interpreter that imports torch or Keras: a few at a time.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        checks = [("install", *_check_install(wheels)), *pool.map(check, parts)]
    fits = total <= BUDGET_S
    checks.append(("budget", fits, f"{total} s planned in all, {'within' if fits else 'over'} {BUDGET_S} s"))
    for name, ok, message in checks:
        label = {True: "ok", False: "BROKEN", None: "unchecked"}[ok]
        print(f"  {label:<9} {name:<12} {message}", flush=True)
    broken = [name for name, ok, _ in checks if ok is False]
    verdict = f"broken: {', '.join(broken)}" if broken else "passed: every part would run"
    print(f"[gpu] dry run {verdict}", flush=True)
    return not broken


# --------------------------------------------------------------------------------- the real run


def cuda_here(python: str = sys.executable) -> tuple[bool, str]:
    """Whether torch sees a CUDA device from ``python`` (asked in a child: this process stays CUDA-free)."""
    code = "import torch; print(torch.cuda.is_available(), torch.__version__)"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "torch did not answer within 300 s"
    if done.returncode != 0:
        return False, f"torch does not import in {python}"
    available, version = done.stdout.split()[-2:]
    return available == "True", f"no CUDA device visible to torch {version}"


def run_part(part: Part, python: Path, deadline: float, work: Path) -> Result:
    """Run one part in its own process group, within its budget and the run's deadline; log in ``work``."""
    result = Result(part.name, part.title, part.command(python, work), json_path=part.json_path(work))
    left = deadline - time.monotonic()
    if left < MIN_PART_S:
        result.status = f"not run: out of time ({max(left, 0):.0f} s left)"
        return result
    timeout = min(part.budget_s, left)
    log_path = work / "logs" / f"{part.name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(result.command, cwd=ROOT, env={**os.environ, **ENV, **dict(part.env)},
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            result.ok = code == 0
            result.status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started
            proc.wait()
            result.status = f"timed out after {timeout:.0f} s"
    result.seconds = time.monotonic() - start
    result.output = log_path.read_text(errors="replace")
    return result


def _install_result(wheels: Path | None, venv_dir: Path | None) -> tuple[Result, Path | None, bool]:
    result = Result("install", "Install (offline)",
                    ["pip install --no-index ... (benchmarks/_gpu_install.py)"])
    start = time.monotonic()
    lines: list[str] = []
    python, keras = None, False

    def log(line: str) -> None:
        lines.append(line)
        print(f"  {line}", flush=True)

    try:
        done = install(ROOT, venv_dir, wheels, log)
        python, keras, result.ok, result.status = done.python, done.keras is not None, True, "ok"
    except (InstallError, OSError, subprocess.SubprocessError) as exc:
        lines.append(str(exc))
        result.status = "failed: " + str(exc).splitlines()[0]
    result.seconds = time.monotonic() - start
    result.output = "\n".join(lines)
    return result, python, keras


def _checkout() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown (no git)"
    return (f"`{head[:60]}`" + (" with local changes" if dirty else "")) if head else "unknown (no git)"


def full_run(parts: list[Part], args: argparse.Namespace) -> int:
    """Install, run every part, rewrite the markdown file after each; 0 when every part ran."""
    deadline = time.monotonic() + args.budget
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    meta = Meta(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), _checkout(), args.budget,
                "python3 dev.py gpu " + shlex.join(args.argv))
    print("[gpu] install (offline)", flush=True)
    installed, python, keras = _install_result(args.wheels, None if args.no_venv else args.work / "venv")
    results = [installed]
    for part in parts:
        args.out.write_text(render(meta, results))
        if python is None:
            result = Result(part.name, part.title, status="not run: the install failed")
        elif part.needs_keras and not keras:
            result = Result(part.name, part.title, ok=True,
                            status="skipped: no Keras (carry a keras wheel: docs/gpu.md)")
        else:
            print(f"[gpu] {part.name}: {part.title} (budget {part.budget_s} s)", flush=True)
            result = run_part(part, python, deadline, args.work)
        print(f"[gpu] {part.name}: {result.status}", flush=True)
        results.append(result)
    args.out.write_text(render(meta, results))
    failed = [r.name for r in results if not r.ok]
    print(f"[gpu] figures written to {args.out}" + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=None,
                        help="folder of carried wheels (setuptools, keras and its dependencies, or this "
                             "project's own wheel): see docs/gpu.md")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-figures.md",
                        help="the markdown file of figures (default: gpu-figures.md in the checkout)")
    parser.add_argument("--budget", type=int, default=BUDGET_S,
                        help=f"seconds for the whole run (default {BUDGET_S})")
    parser.add_argument("--dry-run", action="store_true", help="check what would run, even with a GPU")
    parser.add_argument("--no-venv", action="store_true",
                        help="install into this interpreter instead of a virtual environment in --work")
    parser.add_argument("--work", type=Path, default=WORK,
                        help="folder for the virtual environment, logs and JSON files (default: .gpu-run)")
    args = parser.parse_args(argv)
    # The parts run from the checkout: paths given relative to where the command was typed are resolved now.
    args.out, args.work = args.out.resolve(), args.work.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    parts = plan()
    cuda, why = cuda_here()
    if args.dry_run or not cuda:
        why = "dry run (--dry-run)" if cuda else (f"{why}: this is not a CUDA machine, so only the dry run "
                                                  "runs; nothing is installed or measured")
        print(f"[gpu] {why}", flush=True)
        return 0 if dry_run(parts, args.wheels) else 1
    return full_run(parts, args)


if __name__ == "__main__":
    sys.exit(main())
