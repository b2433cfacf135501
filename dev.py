#!/usr/bin/env python3
"""Set up the project's virtual environment and run the demo or the tests.

The README's quick start is these two commands, on a machine with nothing but Python:

    python3 dev.py demo    # set everything up, then train a small fp16 Keras model, logs under ./runs
    python3 dev.py test    # set everything up, then lint (ruff), run the test suite (pytest) and
                           # install the built wheel into a fresh venv and run the README there (smoke)
    python3 dev.py docs    # build the documentation site into docs/_build/html (warnings are errors)
    python3 dev.py wheel   # the README's every install path, each in a fresh venv from the built wheel
    python3 dev.py gpu     # on a CUDA machine without network: the CUDA tests and GPU benchmarks, one
                           # markdown file of figures (docs/gpu.md); elsewhere a dry run that exits 0

The first three create ``.venv/`` inside the repository on first use and reuse it afterwards: the
install is redone only when ``pyproject.toml`` or the pins below change. Extra arguments
after ``test`` go to pytest (``python3 dev.py test -k policy``). ``gpu`` uses the Python that runs
it and the packages already on the machine, installs offline (``benchmarks/gpu.py``), and passes
its arguments on (``python3 dev.py gpu --wheels DIR``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".lossscale-installed"

# What a CPU-only machine needs. torch 2.13.0 resolves to the CPU wheel in pip's
# find-links; an unpinned torch would pull several GB of CUDA packages.
PINS = ["torch==2.13.0", "tensorflow-cpu==2.21.0"]
# tf_keras, for running tf.keras' own LossScaleOptimizer tests against ours: its dependency on the
# full `tensorflow` wheel would install a second TensorFlow beside tensorflow-cpu, so it is
# installed without dependencies (tensorflow-cpu provides the `tensorflow` it imports).
NO_DEPS_PINS = ["tf_keras==2.21.0"]
EXTRAS = "all"
# Development dependencies live beside the package, not in its published extras.
DEV_REQUIREMENTS = ROOT / "requirements-dev.txt"

QUIET_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "PYTHONUNBUFFERED": "1",
}


def _python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _stamp() -> str:
    digest = hashlib.sha256()
    digest.update((ROOT / "pyproject.toml").read_bytes())
    digest.update(DEV_REQUIREMENTS.read_bytes())
    digest.update(" ".join([*PINS, *NO_DEPS_PINS, EXTRAS, sys.version]).encode())
    return digest.hexdigest()


def setup() -> Path:
    """Create ``.venv`` and install the project with its extras; a no-op when up to date."""
    if not _python().exists():
        print(f"[dev] creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    wanted = _stamp()
    if STAMP.exists() and STAMP.read_text() == wanted:
        print("[dev] environment is up to date", flush=True)
        return _python()
    print("[dev] installing lossscale-callbacks with its extras (about a minute)", flush=True)
    cmd = [str(_python()), "-m", "pip", "install", "--disable-pip-version-check", "-qq",
           *PINS, "-e", f"{ROOT}[{EXTRAS}]", "-r", str(DEV_REQUIREMENTS)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    subprocess.run([str(_python()), "-m", "pip", "install", "--disable-pip-version-check", "-qq", "--no-deps",
                    *NO_DEPS_PINS], check=True, cwd=ROOT)
    STAMP.write_text(wanted)
    return _python()


def ensure_browser() -> None:
    """Chromium for the dashboard browser test: Debian's package (Playwright's own download does not work
    on every machine). Installed with apt-get when missing and this runs as root; otherwise a note."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("apt-get"):
        print("[dev] note: no Chromium found; the browser test will be skipped "
              "(install Debian's `chromium` package to run it)", flush=True)
        return
    print("[dev] installing Chromium for the dashboard browser test (apt-get install chromium)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]
    quiet = {"env": env, "stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL}
    if subprocess.run(install, **quiet).returncode != 0:
        # A fresh machine may have no package lists yet.
        subprocess.run(["apt-get", "update", "-qq"], **quiet)
        if subprocess.run(install, **quiet).returncode != 0:
            print("[dev] note: Chromium could not be installed; the browser test will be skipped "
                  "(and fail on CI)", flush=True)


def _run(args: list[str]) -> int:
    env = {**os.environ, **QUIET_ENV}
    return subprocess.run(args, cwd=ROOT, env=env).returncode


def demo(python: Path, extra: list[str]) -> int:
    return _run([str(python), "examples/keras_quickstart.py", *extra])


def test(python: Path, extra: list[str]) -> int:
    ensure_browser()
    print("[dev] ruff check", flush=True)
    rc = _run([str(python), "-m", "ruff", "check", "."])
    if rc != 0:
        return rc
    print("[dev] pytest", flush=True)
    rc = _run([str(python), "-m", "pytest", *extra])
    if rc != 0 or extra:  # a selection of tests (`dev.py test -k x`) skips the packaging check
        return rc
    rc = docs(python, [])
    if rc != 0:
        return rc
    print("[dev] wheel smoke test: the built wheel in a fresh venv, as users install it", flush=True)
    return wheel(python, ["--smoke"])


def docs(python: Path, extra: list[str]) -> int:
    """The site, with warnings as errors (``-W --keep-going``) and every reference checked (``-n``)."""
    print("[dev] docs: sphinx-build into docs/_build/html", flush=True)
    return _run([str(python), "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                 "docs", "docs/_build/html", *extra])


def wheel(python: Path, extra: list[str]) -> int:
    return _run([str(python), "tests/wheel_paths.py", *extra])


def gpu(extra: list[str]) -> int:
    """The GPU command, with this interpreter: no ``.venv`` and no network (it installs what it needs)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *extra]).returncode


def main(argv: list[str]) -> int:
    commands = {"demo": demo, "test": test, "docs": docs, "wheel": wheel}
    if not argv or argv[0] not in (*commands, "gpu"):
        print(f"usage: python3 dev.py {{{'|'.join([*commands, 'gpu'])}}} [args...]", file=sys.stderr)
        return 2
    if argv[0] == "gpu":
        return gpu(argv[1:])
    python = setup()
    return commands[argv[0]](python, argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
