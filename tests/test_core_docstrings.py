"""The examples in the core's docstrings run as written."""

import doctest
import importlib
import pkgutil

import pytest

import lossscale_callbacks

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(lossscale_callbacks.__path__, "lossscale_callbacks.")
    if "pytest_plugin" not in name
)


@pytest.mark.parametrize("name", ["lossscale_callbacks", *MODULES])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0
