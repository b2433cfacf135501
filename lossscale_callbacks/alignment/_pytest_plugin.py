"""pytest plugin: assert in your own tests that a model has no Tensor Core alignment problem.

An installed package loads it by itself (``pytest11`` entry point); from a source tree that is not
installed, load it with ``-p lossscale_callbacks.alignment._pytest_plugin``. Use the
``assert_tensor_core_aligned`` fixture; it works for Keras models and torch modules alike::

    def test_my_model_is_tensor_core_friendly(assert_tensor_core_aligned):
        model = build_model()
        report = assert_tensor_core_aligned(model, sample_batch, dtype="float16")  # torch
        # Keras: assert_tensor_core_aligned(keras_model, batch_size=64)

The check fails the test, listing the findings, when anything is at least as severe as ``fail_on``
(``"high"`` by default; ``"medium"``/``"low"`` are stricter, the ``alignment_fail_on`` ini option changes
the default). ``--alignment-target=a100`` (or the ``alignment_target`` ini option) applies a GPU's
recommendations to every check. Mixed-precision audit results count like findings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lossscale_callbacks.alignment._checkers import check_alignment
from lossscale_callbacks.alignment._report import SEVERITIES, AlignmentReport
from lossscale_callbacks.alignment._targets import TARGETS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lossscale-callbacks")
    group.addoption("--alignment-target", default=None, choices=sorted(TARGETS),
                    help="GPU whose recommendations the assert_tensor_core_aligned fixture applies.")
    parser.addini("alignment_target", default="", help="default GPU target of assert_tensor_core_aligned")
    parser.addini("alignment_fail_on", default="high",
                  help="lowest severity that fails assert_tensor_core_aligned (high, medium or low)")


@pytest.fixture
def assert_tensor_core_aligned(request: pytest.FixtureRequest) -> Callable[..., AlignmentReport]:
    """``check(model, sample=None, *, fail_on=None, **kwargs) -> AlignmentReport``: fail the test on findings.

    ``kwargs`` go to the framework's ``check_alignment`` (``dtype=``, ``batch_size=``, ``target=``, ...).
    """
    config = request.config
    default_target = config.getoption("--alignment-target") or config.getini("alignment_target") or None
    default_fail_on = config.getini("alignment_fail_on") or "high"

    def check(model: Any, sample: Any = None, *, fail_on: str | None = None,
              **kwargs: Any) -> AlignmentReport:
        level = fail_on or default_fail_on
        if level not in SEVERITIES[:3]:
            raise ValueError(f"fail_on must be one of {SEVERITIES[:3]}, got {level!r}")
        kwargs.setdefault("target", default_target)
        report = check_alignment(model, sample, **kwargs)
        bad = report.at_least(level)
        if bad:
            pytest.fail(f"{len(bad)} Tensor Core alignment/precision problem(s) at or above {level!r}:\n"
                        f"{report}", pytrace=False)
        return report

    return check
