"""The published package carries only what users install: no development extra in the wheel's metadata."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import wheel_paths  # noqa: E402


@pytest.mark.slow
def test_built_wheel_publishes_no_dev_extra(tmp_path):
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package (requirements-dev.txt) is not installed")
    wheel, sdist = wheel_paths.build(tmp_path)
    extras = wheel_paths.published_extras(wheel)
    assert {"keras", "torch", "lightning", "transformers", "all"} <= extras  # the reader sees the extras
    assert not extras & wheel_paths.DEVELOPMENT_EXTRAS, extras
    assert not [p for p in wheel_paths.check_dists(wheel, sdist) if "development extra" in p]


def test_dev_setup_installs_the_development_requirements():
    text = (ROOT / "requirements-dev.txt").read_text()
    requirements = {line.split(">=")[0]: line for line in text.split()}
    needs = ("pytest>=8", "ruff>=0.6", "build>=1.0", "sphinx>=8.1", "furo>=2024.8.6", "myst-parser>=4.0")
    for needed in needs:
        assert requirements.get(needed.split(">=")[0]) == needed
    dev = (ROOT / "dev.py").read_text()
    assert '"-r", str(DEV_REQUIREMENTS)' in dev and 'EXTRAS = "all"' in dev
