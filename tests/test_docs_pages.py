"""Every code block on the documentation pages runs, so the pages cannot rot.

Each page's ``python`` blocks run in page order as one script, in a fresh process in an empty folder
(one namespace per page, as the reader would type them), with its ``bash`` blocks interleaved: a
``lossscale-callbacks ...`` line runs the installed command there, a ``pip install`` or ``pip download``
line is not run (no network here; ``tests/wheel_paths.py`` checks the install lines of the README), nor is
a ``python3 dev.py gpu`` line (the GPU command: ``tests/test_gpu_command.py`` runs it, without CUDA). A page
whose blocks import a framework that is not installed is skipped. ``text`` blocks are output shown, not
code. Where a page shows what its code prints, ``PRINTS`` holds words that the run must print (a distributed
page starts its processes itself: each run in its own processes, with the page's timeout). Every line of code
is at most 88 characters, so that it fits the site's column (a browser test measures it).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
CODE = {"python", "bash"}
NOT_CODE = {"text"}  # output shown on a page
NOT_RUN = ("pip install", "python3 -m pip download", "python3 dev.py gpu")  # see the docstring
OPTIONAL = {"torch", "keras", "tensorflow", "jax", "lightning", "accelerate", "transformers", "wandb", "ray",
            "tensorboard", "deepspeed", "matplotlib"}
# Pages that train models take seconds each: part of the slow suite.
FAST = {"differences.md", "troubleshooting.md", "adding_an_integration.md", "index.md", "changelog.md",
        "concepts.md", "gpu.md", "performance.md",
        "paths/index.md", "api/index.md"}
# Settings a page's run gets beside QUIET: Ray Train's controller polls every 0.2 s, not 2 s (it waits a
# poll at each change of state: the same run, shorter waits; see tests/ray_scripts/ray_runs.py).
PAGE_ENV = {"paths/ray.md": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}}
# A page run once per environment (Keras 3 on every backend).
VARIANTS = {"paths/keras.md": [{"KERAS_BACKEND": b} for b in ("tensorflow", "jax", "torch")]}
# page -> what its run must print (stdout and stderr: warnings go there), checked beside the exit status.
PRINTS = {
    "cli.md": ["float16 fits: no layer needs float32."],
    "troubleshooting.md": ["Keep these layers in float32: `2`.",
                           "Loss scaling: 40 optimizer steps, 1 skipped (2.50%)"],  # after keep_in_float32
    "paths/ray.md": ["The ranks' loss-scale states were compared at 3 read(s) and always agreed."],
    "paths/fabric.md": ["Keep these layers in float32: `2`.", "Layer `2` produced the first"],
    "paths/keras.md": ["Keep these layers in float32: `wide`.", "Layer `wide` produced the first"],
    "paths/lightning.md": ["Keep these layers in float32: `net.2`.", "Layer `net.2` produced the first"],
    "paths/pytorch.md": ["Keep these layers in float32: `2`.",
                         "Layer `2` produced the first non-finite activation (Inf) at step 1"],
    "paths/many-gpus.md": [
        "The ranks' loss-scale states were compared at 5 read(s) and always agreed.",  # plain DDP
        "The ranks hold different loss-scale states at step 40 (rank(s) 2 differ from rank 0)",  # the check
        "rank 2: scale 32768, growth counter 10, 1 of 40 steps skipped",
        "60 optimizer steps, 1 skipped (1.67%)",  # FSDP: the shard's overflow skipped on both ranks
        "The ranks' loss-scale states were compared at 3 read(s) and always agreed.",
    ],
}
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
         "WANDB_DISABLE_GIT": "true", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def pages() -> list[str]:
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def blocks(page: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block (MyST directives such as ``{toctree}`` left out)."""
    found = FENCE.findall((DOCS / page).read_text())
    return [(lang.strip(), code) for lang, code in found if not lang.strip().startswith("{")]


def script(page: str) -> str:
    """The page as one Python program: python blocks as written, shell lines as subprocess calls."""
    parts = []
    for lang, code in blocks(page):
        if lang == "python":
            parts.append(code)
        elif lang == "bash":
            for line in code.replace("\\\n", " ").splitlines():  # a line continued with \ is one command
                command = line.split("#", 1)[0].strip()
                if command and not command.startswith(NOT_RUN):
                    assert command.startswith("lossscale-callbacks "), f"{page}: cannot run {line!r}"
                    command_line = shlex.split(command)[1:]
                    args = [str(Path(sys.executable).parent / "lossscale-callbacks"), *command_line]
                    parts.append(f"print(__import__('subprocess').run({args!r}, check=True))\n")
    return "\n".join(parts)


def _needs(source: str) -> set[str]:
    """The optional packages the script imports unconditionally (an import under ``if`` is the page's own
    guard, e.g. a CUDA-only block)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names & OPTIONAL


def test_every_block_is_runnable_code_or_output():
    for page in pages():
        for lang, _ in blocks(page):
            assert lang in CODE | NOT_CODE, f"{page}: a ```{lang} block is neither run nor marked as output"


# The widest line of code that fits the site's column (90 characters at 1400 px and below, measured).
WIDTH = 88


def test_every_line_of_code_fits_the_column():
    wide = [f"{page}: {len(line)} characters: {line.strip()[:60]!r}"
            for page in pages()
            for lang, code in blocks(page) if lang in CODE
            for line in code.splitlines() if len(line) > WIDTH]
    assert not wide, wide


def _cases() -> list:
    cases = []
    for page in pages():
        if not any(lang in CODE for lang, _ in blocks(page)):
            continue
        marks = [] if page in FAST else [pytest.mark.slow]
        for env in VARIANTS.get(page, [{}]):
            label = "-".join([page, *env.values()])
            cases.append(pytest.param(page, env, marks=marks, id=label))
    return cases


def _missing(page: str, env: dict, source: str) -> list[str]:
    return sorted(n for n in _needs(source) | set(env.values()) & OPTIONAL
                  if importlib.util.find_spec(n) is None)


def _command(page: str, env: dict, source: str, folder: Path) -> tuple[list[str], dict, int]:
    """The page's script written to ``folder/page.py``, and how to run it there."""
    (folder / "page.py").write_text(source)
    return [sys.executable, "page.py"], {**os.environ, **QUIET, **PAGE_ENV.get(page, {}), **env}, 400


def start_in_background(items, tmp_path_factory) -> None:
    """The pages' scripts start with the session (``tests/background.py``), each in a folder of its own."""
    for index, item in enumerate(items):
        if item.module.__name__ != __name__ or item.originalname != "test_page_blocks_run":
            continue
        page, env = item.callspec.params["page"], item.callspec.params["env"]
        source = script(page)
        if not _missing(page, env, source):
            folder = tmp_path_factory.mktemp("page")
            argv, run_env, timeout = _command(page, env, source, folder)
            background.submit(("page", item.name), argv, env=run_env, timeout=timeout, cwd=str(folder),
                              order=index)


@pytest.mark.parametrize(("page", "env"), _cases())
def test_page_blocks_run(page, env, tmp_path, request):
    source = script(page)
    missing = _missing(page, env, source)
    if missing:
        pytest.skip(f"{page} needs {', '.join(missing)}")
    if background.submitted(("page", request.node.name)):
        result = background.wait(("page", request.node.name))
        assert not result.timed_out, f"{page} timed out:\n{result.failure()}"
    else:
        argv, run_env, timeout = _command(page, env, source, tmp_path)
        result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                                env=run_env)
    assert result.returncode == 0, f"{page} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    printed = result.stdout + result.stderr
    missing = [words for words in PRINTS.get(page, []) if words not in printed]
    assert not missing, f"{page} did not print {missing}:\n{printed[-5000:]}"
