"""Optional dependencies: a missing package becomes an ``ImportError`` that names the pip extra.

Every integration imports its outside package through :func:`require` (at import time) and every
argument that needs one (``tensorboard=``, ``wandb=``, ``check_alignment=``, ``--png``) calls
:func:`require` when the object is constructed, so a missing extra is reported once, with the
command that fixes it, and never in the middle of training.

Example:
    >>> import math
    >>> require("math", "keras") is math
    True
    >>> require("no_such_package_xyz", "tensorboard", feature="TensorBoardSink")
    Traceback (most recent call last):
    ...
    lossscale_callbacks._extras.MissingExtraError: TensorBoardSink needs the 'no_such_package_xyz' package, \
which is not installed (No module named 'no_such_package_xyz'). Install it with: \
pip install "lossscale-callbacks[tensorboard]"
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

__all__ = ["MissingExtraError", "declared_extras", "install_hint", "lazy_attributes", "require"]

_DISTRIBUTION = "lossscale-callbacks"


@functools.cache
def declared_extras() -> frozenset[str] | None:
    """The pip extras this installation declares: pyproject.toml's ``optional-dependencies``, the one
    table a new integration adds its extra to (``None`` for a source tree that is not installed)."""
    try:
        return frozenset(metadata.metadata(_DISTRIBUTION).get_all("Provides-Extra") or ())
    except metadata.PackageNotFoundError:
        return None


class MissingExtraError(ImportError):
    """An optional package is missing; the message says which extra installs it."""


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra``."""
    extras = declared_extras()
    if extras is not None and extra not in extras:
        raise ValueError(f"extra must be one of {sorted(extras)}, got {extra!r}")
    return f'pip install "lossscale-callbacks[{extra}]"'


def require(module: str, extra: str, *, feature: str | None = None, hint: str | None = None) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` naming the extra that provides it.

    A package that is installed but fails to import because one of *its* dependencies is missing
    (TensorBoard without protobuf says ``No module named 'google'``) is reported the same way:
    installing the extra brings what is missing. Other import errors pass through unchanged.

    Args:
        module: the module to import (``"tensorboard.summary.writer.event_file_writer"``).
        extra: the pip extra of this project that installs it (one of :func:`declared_extras`).
        feature: what needs it, for the message (default: the module's top-level package).
        hint: a sentence to add (Keras: which backends exist).

    Returns:
        The imported module.

    Raises:
        MissingExtraError: the module, or a module it imports, is not installed.
    """
    command = install_hint(extra)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        subject = f"{feature} needs the {top!r} package, which" if feature else f"the {top!r} package"
        message = f"{subject} is not installed ({exc}). Install it with: {command}"
        if hint:
            message += f". {hint}"
        raise MissingExtraError(message, name=exc.name) from exc


def lazy_attributes(package: str, lazy: Mapping[str, str]) -> Callable[[str], Any]:
    """A package face's ``__getattr__``: each name of ``lazy`` is imported from its module on first use.

    Args:
        package: the face's ``__name__`` (for the ``AttributeError`` of any other name).
        lazy: name -> the module that defines it.

    Example:
        >>> getattr_ = lazy_attributes("demo", {"sqrt": "math"})
        >>> getattr_("sqrt")(4.0)
        2.0
    """
    def __getattr__(attr: str) -> Any:
        if attr in lazy:
            return getattr(importlib.import_module(lazy[attr]), attr)
        raise AttributeError(f"module {package!r} has no attribute {attr!r}")

    return __getattr__
