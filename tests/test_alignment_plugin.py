"""The pytest plugin's fixture, run the way a user runs it (a separate pytest with -p)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

USER_TESTS = textwrap.dedent('''
    import torch

    def model(n_in):
        return torch.nn.Sequential(torch.nn.Linear(n_in, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))

    def test_aligned(assert_tensor_core_aligned):
        report = assert_tensor_core_aligned(model(64), torch.zeros(32, 64), dtype="float16")
        assert report.findings == []

    def test_misaligned(assert_tensor_core_aligned):
        assert_tensor_core_aligned(model(50), torch.zeros(32, 64 - 14), dtype="float16")

    def test_low_passes_unless_asked(assert_tensor_core_aligned):
        report = assert_tensor_core_aligned(model(64), torch.zeros(30, 64), dtype="float16")
        assert report.has("low")

    def test_low_fails_when_asked(assert_tensor_core_aligned):
        assert_tensor_core_aligned(model(64), torch.zeros(30, 64), dtype="float16", fail_on="low")

    def test_target_option_applies(assert_tensor_core_aligned):
        report = assert_tensor_core_aligned(model(64), torch.zeros(32, 64), dtype="float16")
        assert report.target == "h100"

    def test_a_classifier_head_passes(assert_tensor_core_aligned):
        classifier = torch.nn.Sequential(model(64), torch.nn.Linear(64, 10))  # 10 classes
        report = assert_tensor_core_aligned(classifier, torch.zeros(32, 64), dtype="float16")
        assert [(f.layer, f.value) for f in report.findings] == [("1", 10)]

    def test_without_a_dtype_the_check_refuses(assert_tensor_core_aligned):
        assert_tensor_core_aligned(model(64), torch.zeros(32, 64))
''')


def _load_plugin_args() -> list[str]:
    """What a user passes: nothing when the package is installed (pytest11 entry point), else ``-p``."""
    installed = any(ep.value == "lossscale_callbacks.alignment._pytest_plugin"
                    for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "lossscale_callbacks.alignment._pytest_plugin"]


@pytest.mark.slow
def test_fixture_fails_exactly_the_misaligned_models(tmp_path):
    (tmp_path / "test_user_model.py").write_text(USER_TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *_load_plugin_args(),
         "-p", "no:cacheprovider", "--alignment-target", "h100", "-o", "addopts=", "test_user_model.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert "4 passed" in out and "3 failed" in out, out
    assert "FAILED test_user_model.py::test_misaligned" in out
    assert "FAILED test_user_model.py::test_low_fails_when_asked" in out
    assert "FAILED test_user_model.py::test_without_a_dtype_the_check_refuses" in out
    assert "dtype is required" in out
    assert "features_in" in out and "at or above 'high'" in out
