"""Both Lightning namespaces at once: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

The two packages ship parallel class trees (``lightning.pytorch.Callback`` is not
``pytorch_lightning.Callback``) and each Trainer checks plugins and callbacks against its own.
Our plugin and callback inherit from the classes of every installed namespace, so either Trainer
accepts them, and the few base methods that call into a namespace's internals are dispatched by
the namespace of the Trainer actually in use (:func:`namespace_of`).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

NAMESPACES: tuple[str, ...] = ("lightning.pytorch", "pytorch_lightning")


@cache
def installed_namespaces() -> tuple[str, ...]:
    """The Lightning namespaces that import here, ``lightning.pytorch`` first."""
    found = []
    for name in NAMESPACES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        found.append(name)
    if not found:
        raise ImportError("lossscale_callbacks.lightning needs `lightning` or `pytorch_lightning`; "
                          "install one with `pip install lossscale-callbacks[lightning]`")
    return tuple(found)


def _attr(namespace: str, module: str, name: str) -> Any:
    return getattr(importlib.import_module(f"{namespace}.{module}"), name)


def bases(module: str, name: str) -> tuple[type, ...]:
    """``name`` from ``<namespace>.<module>`` of every installed namespace."""
    return tuple(_attr(ns, module, name) for ns in installed_namespaces())


def namespace_of(trainer: Any) -> str:
    """Which namespace a Trainer (or LightningModule) comes from."""
    module = type(trainer).__module__
    for name in NAMESPACES:
        if module == name or module.startswith(name + "."):
            return name
    # A user subclass of a Trainer: look at its bases.
    for klass in type(trainer).__mro__:
        for name in NAMESPACES:
            if klass.__module__.startswith(name + "."):
                return name
    return installed_namespaces()[0]


def precision_base(trainer: Any) -> type:
    """The base ``Precision`` class of the Trainer's namespace."""
    return _attr(namespace_of(trainer), "plugins.precision", "Precision")


def lightning_module_in(model: Any) -> Any:
    """The LightningModule in ``model``: itself, or the one inside a strategy's wrapper (DDP, FSDP,
    DeepSpeed); ``None`` if there is none."""
    classes = bases("core", "LightningModule")
    modules = model.modules() if callable(getattr(model, "modules", None)) else ()
    return next((m for m in modules if isinstance(m, classes)), None)
