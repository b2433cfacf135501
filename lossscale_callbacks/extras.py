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
    lossscale_callbacks.extras.MissingExtraError: TensorBoardSink needs the 'no_such_package_xyz' package, \
which is not installed (No module named 'no_such_package_xyz'). Install it with: \
pip install "lossscale-callbacks[tensorboard]"
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "install_hint", "require"]

# extra name -> what it installs (kept in step with pyproject.toml's optional-dependencies).
EXTRAS: dict[str, str] = {
    "keras": "Keras 3 (bring a backend: tensorflow, jax or torch)",
    "torch": "PyTorch",
    "lightning": "PyTorch Lightning (and PyTorch)",
    "accelerate": "Hugging Face Accelerate (and PyTorch)",
    "transformers": "Hugging Face Transformers (and Accelerate, PyTorch)",
    "tensorboard": "TensorBoard event files: the sink and the report's reader",
    "wandb": "Weights & Biases: the sink and the report's reader",
    "ray": "Ray Train (and PyTorch): TorchTrainer workers report the loss scale",
    "plot": "matplotlib, for report --png",
}


class MissingExtraError(ImportError):
    """An optional package is missing; the message says which extra installs it."""


def install_hint(extra: str) -> str:
    """The pip command that installs ``extra``."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {sorted(EXTRAS)}, got {extra!r}")
    return f'pip install "lossscale-callbacks[{extra}]"'


def require(module: str, extra: str, *, feature: str | None = None, hint: str | None = None) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` naming the extra that provides it.

    A package that is installed but fails to import because one of *its* dependencies is missing
    (TensorBoard without protobuf says ``No module named 'google'``) is reported the same way:
    installing the extra brings what is missing. Other import errors pass through unchanged.

    Args:
        module: the module to import (``"tensorboard.summary.writer.event_file_writer"``).
        extra: the pip extra of this project that installs it (a key of :data:`EXTRAS`).
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
