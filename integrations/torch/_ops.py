"""The core's :class:`~lossscale_callbacks.extend.Ops` on torch tensors, so ``next_state`` runs on the device.

Every method launches at most one small kernel and never reads a value back to the host: the
update rule enqueues on the current CUDA stream like any other op. Constants are created with
``torch.full`` (a fill kernel, no host-to-device copy, hence no implicit stream sync) and cached,
so after the first step the rule costs only its elementwise ops.
"""

from __future__ import annotations

from typing import Any

import torch

COUNTER_DTYPE = torch.int64
SCALE_DTYPE = torch.float32


class TorchOps:
    """Float32 scale, int64 counters, 0-d tensors on ``device``.

    Args:
        device: where the state lives (``"cpu"``, ``"cuda:0"``, a ``torch.device``).

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
        >>> ops = TorchOps("cpu")
        >>> policy = DynamicPolicy(initial_scale=8.0)
        >>> state = next_state(policy, initial_state(policy, ops), torch.tensor(False), ops)
        >>> state.scale, state.skipped_steps
        (tensor(4.), tensor(1))
    """

    name = "torch"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._constants: dict[tuple[torch.dtype, float | int], torch.Tensor] = {}

    def _constant(self, value: float | int, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, value)
        tensor = self._constants.get(key)
        if tensor is None:
            # torch.full rounds the Python double to float32 exactly like NumPy does.
            tensor = torch.full((), value, dtype=dtype, device=self.device)
            self._constants[key] = tensor
        return tensor

    def scale(self, value: float) -> torch.Tensor:
        return self._constant(float(value), SCALE_DTYPE)

    def count(self, value: int) -> torch.Tensor:
        return self._constant(int(value), COUNTER_DTYPE)

    def as_bool(self, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value if value.dtype == torch.bool else value != 0
        return self._constant(int(bool(value)), torch.bool)

    def where(self, condition: Any, x: Any, y: Any) -> torch.Tensor:
        return torch.where(condition, x, y)

    def minimum(self, x: Any, y: Any) -> torch.Tensor:
        return torch.minimum(x, y)

    def maximum(self, x: Any, y: Any) -> torch.Tensor:
        return torch.maximum(x, y)

    def logical_and(self, x: Any, y: Any) -> torch.Tensor:
        return torch.logical_and(x, y)

    def logical_not(self, x: Any) -> torch.Tensor:
        return torch.logical_not(x)
