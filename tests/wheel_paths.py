"""Install the package the way users get it and run the README there: a built wheel, one fresh venv per path.

Every ```python block of the README whose first line is a ``# pip install "lossscale-callbacks[...]" ...``
comment is a *path*: this script builds the wheel (and the sdist) from the working tree, creates a fresh
virtual environment for each such block, installs exactly what that line says (the wheel in place of the
package name), runs the block there with the repository out of reach, and then checks that each extra the
line does *not* name fails with an ``ImportError`` that names it, at import or construction. It is not a
pytest module (pytest collects ``test_*.py``): it runs through ``dev.py``:

    python3 dev.py wheel            # every path (several minutes; pip downloads what its cache lacks)
    python3 dev.py wheel --smoke    # what CI runs after the tests: the dist contents and the first path

Machine notes: on this project's CPU machines ``tensorflow`` is installed as ``tensorflow-cpu`` and torch is
pinned to the CPU build (an unpinned torch pulls several GB of CUDA wheels); both substitutions are printed.
"""

from __future__ import annotations

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGE = "lossscale-callbacks"

# What the README says -> what this machine installs instead, and what it pins besides.
SUBSTITUTES = {"tensorflow": "tensorflow-cpu==2.21.0"}
CONSTRAINTS = ["torch==2.13.0"]

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text()) if tomllib else None
# A probe per extra: code that must fail with an ImportError naming the extra when it is not installed.
# An integration's extra (named as its package, pyproject's one table) is probed by importing it.
_OWN_PROBES = {
    "tensorboard": "from lossscale_callbacks.tensorboard import TensorBoardSink\nTensorBoardSink('runs/p')",
    "wandb": "from lossscale_callbacks.wandb import WandbSink\nWandbSink(mode='offline')",
    "plot": "from lossscale_callbacks._cli import main\nmain(['report', '.', '--png', 'x.png'])",
    # Fp8ScaleMonitor's own check (it lives behind the torch face, which names [torch] first where torch is
    # missing too); lossscale_callbacks.fp8 is a room of the core, importable without the extra.
    "fp8": "from lossscale_callbacks._extras import require\nrequire('torchao', 'fp8')",
}
PROBES = {**{extra: f"import lossscale_callbacks.{extra}" for extra in (
    PYPROJECT["project"]["optional-dependencies"] if PYPROJECT else ())
    if f"lossscale_callbacks.{extra}" in PYPROJECT["tool"]["setuptools"]["packages"]}, **_OWN_PROBES}

PROBE_RUNNER = textwrap.dedent("""
    import sys
    code, extra = sys.argv[1], sys.argv[2]
    try:
        exec(compile(code, "<probe>", "exec"), {"__name__": "__probe__"})
    except ImportError as exc:
        wanted = f'pip install "lossscale-callbacks[{extra}]"'
        if wanted not in str(exc):
            sys.exit(f"ImportError without the pip command {wanted!r}: {exc}")
        print(f"ok: {type(exc).__name__}: {exc}")
    except SystemExit as exc:
        sys.exit(f"exited ({exc.code}) instead of an ImportError naming [{extra}]")
    else:
        sys.exit(f"no ImportError although [{extra}] is not installed")
""")


@dataclass(frozen=True)
class ReadmePath:
    """One README block with its install line."""

    heading: str
    install: list[str]  # the words after `pip install`
    code: str

    @property
    def extras(self) -> set[str]:
        for word in self.install:
            match = re.fullmatch(rf"{PACKAGE}\[([a-z0-9,]+)\]", word)
            if match:
                return set(match.group(1).split(","))
        return set()

    @property
    def name(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")


def readme_paths(text: str) -> list[ReadmePath]:
    """The README's ```python blocks that start with a ``# pip install`` line, in order."""
    paths = []
    heading = ""
    for match in re.finditer(r"^(#+ [^\n]*)$|```python\n(.*?)```", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("#").strip()
            continue
        code = match.group(2)
        first = code.splitlines()[0] if code.strip() else ""
        if first.startswith("# pip install "):
            paths.append(ReadmePath(heading, shlex.split(first[len("# pip install "):]), code))
    return paths


def build(out: Path) -> tuple[Path, Path]:
    """The wheel and the sdist of the working tree (which keeps no build leftovers)."""
    leftovers = [ROOT / "lossscale_callbacks.egg-info", ROOT / "build"]
    existed = {path for path in leftovers if path.exists()}
    try:
        return _build(out)
    finally:
        # setuptools writes its egg-info into the tree; left there, it shadows the installed
        # metadata (entry points) of an editable install whenever the repository is on sys.path.
        for path in set(leftovers) - existed:
            shutil.rmtree(path, ignore_errors=True)


def _build(out: Path) -> tuple[Path, Path]:
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"[wheel] the build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return next(out.glob("*.whl")), next(out.glob("*.tar.gz"))


# Extras are published in the wheel's metadata: only what users install may be one.
DEVELOPMENT_EXTRAS = {"dev", "test", "tests", "docs", "lint"}


def published_extras(wheel: Path) -> set[str]:
    """The extras the wheel's METADATA offers (``Provides-Extra``), as a user's pip sees them."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    return {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Provides-Extra:")}


def check_dists(wheel: Path, sdist: Path) -> list[str]:
    """What the package page and a packager need: license, type marker, no half test suite, README's paths,
    no development extra."""
    problems = []
    wheel_names = zipfile.ZipFile(wheel).namelist()
    for extra in sorted(published_extras(wheel) & DEVELOPMENT_EXTRAS):
        problems.append(f"wheel publishes the development extra [{extra}] (use requirements-dev.txt)")
    for needed in ("lossscale_callbacks/py.typed", "licenses/LICENSE"):
        if not any(name.endswith(needed) for name in wheel_names):
            problems.append(f"wheel lacks {needed}")
    with tarfile.open(sdist) as tar:
        sdist_names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    if any(name.startswith("tests/") for name in sdist_names):
        problems.append("sdist ships tests/ (the suite needs a clone's setup: leave it out)")
    for needed in ("LICENSE", "README.md", "lossscale_callbacks/py.typed"):
        if needed not in sdist_names:
            problems.append(f"sdist lacks {needed}")
    # A relative link on the package page must point at a file the sdist carries.
    for target in re.findall(r"\]\((?!https?://|#)([^)\s]+)\)", README.read_text()):
        if target.split("#")[0] not in sdist_names:
            problems.append(f"README links {target}, which is not in the sdist")
    return problems


def make_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(where)
    return where / "bin" / "python"


def install(python: Path, path: ReadmePath, wheel: Path) -> None:
    words = []
    for word in path.install:
        if word.startswith(PACKAGE):
            words.append(f"{wheel}{word[len(PACKAGE):]}")
        elif word in SUBSTITUTES:
            print(f"    (installing {SUBSTITUTES[word]} for {word} on this CPU machine)", flush=True)
            words.append(SUBSTITUTES[word])
        else:
            words.append(word)
    constraints = python.parent.parent / "constraints.txt"
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-qq", "--disable-pip-version-check",
                    "-c", str(constraints), *words], check=True)


def run_path(path: ReadmePath, wheel: Path, work: Path) -> list[str]:
    """Install the block's line into a fresh venv, run the block, probe the extras it leaves out."""
    problems = []
    start = time.monotonic()
    python = make_venv(work / "venv")
    install(python, path, wheel)
    # The repository must be out of reach: run from an empty folder, with no PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "TF_CPP_MIN_LOG_LEVEL": "3",
                "HF_HUB_OFFLINE": "1", "KERAS_BACKEND": env.get("KERAS_BACKEND", "tensorflow")})
    run_dir = work / "run"
    run_dir.mkdir()
    snippet = run_dir / "snippet.py"
    snippet.write_text(path.code)
    done = subprocess.run([str(python), str(snippet)], cwd=run_dir, env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        problems.append(f"the README block failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    for extra in sorted(set(PROBES) - path.extras - implied(path.extras)):
        probe = subprocess.run([str(python), "-c", PROBE_RUNNER, PROBES[extra], extra], cwd=run_dir, env=env,
                               capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            problems.append(f"without [{extra}]: {(probe.stderr or probe.stdout).strip()[-1500:]}")
    print(f"    {time.monotonic() - start:.0f} s", flush=True)
    return problems


def implied(extras: set[str]) -> set[str]:
    """Extras that others install (lightning brings torch), which cannot be missing there: read from
    pyproject's optional-dependencies, where an extra names another as ``lossscale-callbacks[torch]``."""
    table = PYPROJECT["project"]["optional-dependencies"]
    out: set[str] = set()
    todo = list(extras)
    while todo:
        for requirement in table.get(todo.pop(), []):
            if requirement.startswith(f"{PACKAGE}["):
                for extra in requirement[len(PACKAGE) + 1:].rstrip("]").split(","):
                    if extra not in out:
                        out.add(extra)
                        todo.append(extra)
    return out - extras


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the dist checks and the first path only")
    parser.add_argument("--only", action="append", default=[],
                        help="run the paths whose heading or install line contains this (any case)")
    parser.add_argument("--readme", type=Path, default=README, help="read the blocks from another file")
    args = parser.parse_args(argv)
    paths = readme_paths(args.readme.read_text())
    if not paths:
        print("no README block starts with a '# pip install' line", file=sys.stderr)
        return 1
    if args.smoke:
        paths = paths[:1]
    if args.only:
        # Case-insensitive, against the heading and the install line: two snippets may share a heading.
        def words_of(path: ReadmePath) -> str:
            return " ".join([path.heading, *path.install]).lower()

        paths = [p for p in paths if any(word.lower() in words_of(p) for word in args.only)]
        if not paths:
            print(f"no README path matches --only {args.only}", file=sys.stderr)
            return 1
    failures = 0
    with tempfile.TemporaryDirectory(prefix="lossscale-wheel-") as tmp:
        wheel, sdist = build(Path(tmp) / "dist")
        print(f"[wheel] built {wheel.name} and {sdist.name}", flush=True)
        for problem in check_dists(wheel, sdist):
            print(f"[wheel] FAIL: {problem}", flush=True)
            failures += 1
        for i, path in enumerate(paths):
            print(f"[wheel] path '{path.heading}': pip install {' '.join(path.install)}", flush=True)
            work = Path(tmp) / f"path{i}"
            work.mkdir()
            for problem in run_path(path, wheel, work):
                print(f"[wheel] FAIL ({path.heading}): {problem}", flush=True)
                failures += 1
    print(f"[wheel] {'FAILED: ' + str(failures) + ' problem(s)' if failures else 'all paths passed'}",
          flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
