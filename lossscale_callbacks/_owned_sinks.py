"""The sinks a logging loop opens itself, from ``tensorboard=`` and ``wandb=``: checked, extras required.

Every integration takes the same two arguments (the Keras callback, the Lightning and Fabric
monitors, a plain :class:`~lossscale_callbacks.LoggingLoop`); they are checked here,
once, when the object is constructed: a bad value is a ``ValueError`` naming the argument, a
missing package a :class:`~lossscale_callbacks.extend.MissingExtraError` naming the pip extra,
never an error in the middle of training. The sink classes are found through the
``lossscale_callbacks._sinks`` entry points, so the core imports no integration by name.

Example:
    >>> check_tensorboard("")
    Traceback (most recent call last):
    ...
    ValueError: tensorboard must be None or a non-empty log directory path, got ''
    >>> owned_sinks(None, None)
    []
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from lossscale_callbacks._extras import require
from lossscale_callbacks._sinks import Sink

__all__ = ["ENTRY_POINT_GROUP", "check_tensorboard", "check_wandb", "owned_sinks"]

ENTRY_POINT_GROUP = "lossscale_callbacks.sinks"
# name -> (the outside module its sink needs, the extra that installs it)
_PACKAGES = {"tensorboard": ("tensorboard.compat.proto.event_pb2", "tensorboard"),
             "wandb": ("wandb", "wandb")}


def check_tensorboard(value: Any) -> str | None:
    """``tensorboard=``: ``None`` or a non-empty log directory (``str`` or ``os.PathLike``), as a ``str``."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"tensorboard must be None or a non-empty log directory path, got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise ValueError(f"tensorboard must be a text path, got the bytes path {value!r}")
    return path


def check_wandb(value: Any) -> dict[str, Any] | None:
    """``wandb=``: ``None``/``False`` (none), ``True`` (the active or a new run), or ``wandb.init`` args."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"wandb must be None, a bool, or a dict of wandb.init arguments, got {value!r}")
    return dict(value)


def _sink_class(name: str) -> Any:
    module, extra = _PACKAGES[name]
    require(module, extra, feature=f"{name}=")
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return entry.load()
    raise ImportError(f"{name}= needs the {name!r} entry point of the {ENTRY_POINT_GROUP!r} group, which "
                      "this installation of lossscale-callbacks lacks; reinstall it (pip install "
                      f'"lossscale-callbacks[{extra}]")')


def owned_sinks(tensorboard: Any, wandb: Any) -> list[Sink]:
    """New sinks for ``tensorboard=`` and ``wandb=``, checked; they open nothing before their first write.

    Raises:
        ValueError: an argument is not what it may be (``wandb``'s ``wandb.init`` arguments and
            its ``mode`` are checked by :class:`~lossscale_callbacks.wandb.WandbSink`).
        MissingExtraError: the package a sink needs is not installed.
    """
    log_dir, init_kwargs = check_tensorboard(tensorboard), check_wandb(wandb)
    sinks: list[Sink] = []
    if log_dir is not None:
        sinks.append(_sink_class("tensorboard")(log_dir))
    if init_kwargs is not None:
        try:
            sinks.append(_sink_class("wandb")(**init_kwargs))
        except ValueError as exc:
            raise ValueError(f"wandb: {exc}") from None
    return sinks
