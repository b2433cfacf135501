"""The optional-dependency helper: a missing package names the pip extra, other errors pass through."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from lossscale_callbacks._extras import MissingExtraError, declared_extras, install_hint, require


def test_require_returns_the_module():
    import json

    assert require("json", "torch") is json


def test_missing_package_names_the_extra_and_the_feature():
    with pytest.raises(MissingExtraError) as info:
        require("no_such_package_xyz.sub", "wandb", feature="WandbSink")
    message = str(info.value)
    assert message.startswith("WandbSink needs the 'no_such_package_xyz' package")
    assert 'pip install "lossscale-callbacks[wandb]"' in message
    assert info.value.name == "no_such_package_xyz"
    assert isinstance(info.value, ImportError)


def test_missing_dependency_of_an_installed_package_names_the_extra(monkeypatch):
    # TensorBoard installed without protobuf: `No module named 'google'` from inside the package.
    package = types.ModuleType("fake_pkg_with_missing_dep")
    package.__path__ = []  # a package, so the submodule import runs the finder
    monkeypatch.setitem(sys.modules, "fake_pkg_with_missing_dep", package)
    with pytest.raises(MissingExtraError, match=r"No module named 'fake_pkg_with_missing_dep\.writer'.*"
                                                r"lossscale-callbacks\[tensorboard\]"):
        require("fake_pkg_with_missing_dep.writer", "tensorboard")


def test_other_import_errors_pass_through(monkeypatch, tmp_path):
    (tmp_path / "broken_mod_xyz.py").write_text("raise ImportError('broken for its own reasons')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="broken for its own reasons") as info:
        require("broken_mod_xyz", "torch")
    assert not isinstance(info.value, MissingExtraError)


def test_hint_is_appended():
    with pytest.raises(MissingExtraError, match=r"\. Backends: tensorflow, jax, torch$"):
        require("no_such_package_xyz", "keras", hint="Backends: tensorflow, jax, torch")


def test_unknown_extra_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"extra must be one of \[.*'tensorboard'.*\], got 'tb'"):
        install_hint("tb")


def test_every_extra_is_declared_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert declared_extras() == set(declared)  # the installed metadata is pyproject's table
