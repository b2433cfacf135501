"""A detector for host reads (device-to-host copies and syncs), for the torch and Lightning tests.

A ``TorchFunctionMode`` sees every overridable torch call. It only sees the outermost one: while a
mode handles a call it is off, so reads made inside Python-level functions such as
``Tensor.__format__`` or ``Tensor.__array__`` are invisible, which is why those are listed
themselves.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
HOST_READS = {
    Tensor.item, Tensor.__bool__, Tensor.tolist, Tensor.cpu, Tensor.numpy, Tensor.__float__, Tensor.__int__,
    Tensor.__index__, Tensor.__complex__, Tensor.__format__, Tensor.__repr__, Tensor.__array__,
    Tensor.is_nonzero, torch.is_nonzero, torch.equal, torch.allclose,
    # Output shape depends on the values: the host waits for the device.
    Tensor.nonzero, torch.nonzero, Tensor.masked_select, torch.masked_select,
}


def _is_host(arg: Any) -> bool:
    return str(arg) == "cpu" or (isinstance(arg, torch.Tensor) and arg.device.type == "cpu")


def _caller_file() -> str:
    """The first Python file up the stack that is neither torch nor this module."""
    frame = sys._getframe(1)
    torch_dir = os.path.dirname(torch.__file__)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(torch_dir) and name != __file__:
            return name
        frame = frame.f_back
    return ""


class HostReadCounter(TorchFunctionMode):
    """Records (or refuses) every call that copies a tensor's value to the host.

    Args:
        raise_on_read: raise ``AssertionError`` at the first read.
        only_under: count only reads made by code in files under these folders (e.g. the
            library's own), and record ``(name, file)`` pairs.
    """

    def __init__(self, raise_on_read: bool = False, only_under: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.raise_on_read = raise_on_read
        self.only_under = tuple(os.path.realpath(d) + os.sep for d in only_under)
        self.reads: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            self._read(func.__name__)
        elif func is Tensor.to and args[0].device.type != "cpu" and any(
                _is_host(a) for a in list(args[1:]) + list(kwargs.values())):
            # A device-to-host copy (on a GPU machine); same-device .to() is a no-op.
            self._read("to(cpu)")
        elif func is Tensor.copy_ and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self._read("copy_ to cpu")
        return func(*args, **kwargs)

    def _read(self, name: str) -> None:
        if self.only_under:
            where = os.path.realpath(_caller_file())
            if not where.startswith(self.only_under):
                return
            self.reads.append((name, os.path.basename(where)))
        else:
            self.reads.append(name)
        if self.raise_on_read:
            raise AssertionError(f"host read during the step: Tensor.{name}")
