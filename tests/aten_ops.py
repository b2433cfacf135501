"""Counting what a piece of torch code dispatches: every aten op, as a GPU would launch it.

A ``TorchDispatchMode`` sees each op at the dispatcher, after Python-level decompositions, so view
ops count too (they launch nothing on a GPU, so the counts are an upper bound there). Ops that a
kernel runs internally (a ``_foreach`` op's per-tensor fallback on the CPU) are one op: on CUDA they
are one fused launch.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """``with AtenOps() as ops: ...`` then ``ops.names`` lists the aten ops in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.names)
