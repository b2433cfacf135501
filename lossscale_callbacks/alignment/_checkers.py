"""Find the framework capture for a model object or a model file, without importing any framework.

The core never depends on an integration: the capture is looked up at call time, first through the
``lossscale_callbacks.checkers`` entry points (name = framework), then through the integration module
of the installed package (``lossscale_callbacks.keras._alignment``,
``lossscale_callbacks.torch._alignment``).
A model's framework is read from its class hierarchy, so nothing is imported to find it.

Example:
    >>> class Fake:  # neither a keras.Model nor a torch.nn.Module
    ...     pass
    >>> framework_of(Fake())
    Traceback (most recent call last):
    ...
    ValueError: model must be a keras.Model or a torch.nn.Module, got Fake
    >>> framework_of_file("model.keras")
    'keras'
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from lossscale_callbacks.alignment._report import AlignmentReport

ENTRY_POINT_GROUP = "lossscale_callbacks.checkers"
_MODULES = {"keras": "lossscale_callbacks.keras._alignment",
            "torch": "lossscale_callbacks.torch._alignment"}
_FILE_SUFFIXES = {".keras": "keras", ".h5": "keras"}


def framework_of(model: Any) -> str:
    """``"keras"`` or ``"torch"`` from the model's class hierarchy."""
    roots = {cls.__module__.split(".")[0] for cls in type(model).__mro__}
    if "keras" in roots:
        return "keras"
    if "torch" in roots:
        return "torch"
    raise ValueError(f"model must be a keras.Model or a torch.nn.Module, got {type(model).__name__}")


def framework_of_file(path: str | Path) -> str:
    """The framework that reads a model file, from its suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in _FILE_SUFFIXES:
        raise ValueError(f"model file must end in one of {sorted(_FILE_SUFFIXES)}, got {str(path)!r}")
    return _FILE_SUFFIXES[suffix]


def load_checker(framework: str) -> ModuleType:
    """The capture module of ``framework`` (it has ``check_alignment``; Keras' also ``check_model_file``)."""
    if framework not in _MODULES:
        raise ValueError(f"framework must be one of {sorted(_MODULES)}, got {framework!r}")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == framework:
            return ep.load()
    return importlib.import_module(_MODULES[framework])


def check_alignment(model: Any, sample: Any = None, **kwargs: Any) -> AlignmentReport:
    """Check a Keras model or a torch module with its own framework's capture.

    Finds the framework from the model's class (nothing is imported for that), loads its capture
    (:func:`load_checker`) and calls its ``check_alignment``:
    :func:`lossscale_callbacks.alignment.check_alignment` (``batch_size=``, ``tf32=``, ``loss=``)
    or :func:`lossscale_callbacks.alignment.check_alignment` (``dtype=`` is required there, ``tf32=``,
    ``forward=``, ``loss_fn=``); both take ``target=``.

    Args:
        model: a built ``keras.Model`` or a ``torch.nn.Module``.
        sample: one batch of model inputs (``None``: Keras builds one from the model's input shapes,
            torch uses ``model.example_input_array``).
        **kwargs: the framework's own arguments.

    Returns:
        The :class:`~lossscale_callbacks.alignment.AlignmentReport`.

    Raises:
        ValueError: ``model`` is neither a Keras model nor a torch module, or a framework argument is
            invalid or missing (torch's ``dtype=``; ``target=`` not a known GPU), named.

    Example:
        >>> import torch
        >>> report = check_alignment(torch.nn.Linear(50, 64), torch.zeros(32, 50), dtype="float16")
        >>> [(f.dimension, f.value, f.suggested) for f in report.findings]
        [('features_in', 50, 56)]
    """
    return load_checker(framework_of(model)).check_alignment(model, sample, **kwargs)
