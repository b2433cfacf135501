"""Reading Lightning's stock ``MixedPrecision`` plugin, whose scaler is a ``torch.amp.GradScaler``.

``GradScaler`` keeps only a scale and a growth tracker and does not count skipped steps. A skipped
step is recognised on the device after each optimizer step: ``update()`` resets the tracker to 0
on an overflow and lowers the scale, while a growth also resets the tracker but raises the scale.
So "tracker is 0 and the scale did not grow" is an overflow, counted into a device tensor with
no host sync; the counts are read only at the log interval.
"""

from __future__ import annotations

from typing import Any

import torch


class StockScalerReader:
    """Tracks a ``torch.amp.GradScaler`` in the core's state shape.

    Call :meth:`after_optimizer_step` after every optimizer step (after ``scaler.update()``, before
    the next one): a few tiny device ops, no host sync. :meth:`read` is the one host read of an
    interval.

    Args:
        scaler: the ``GradScaler`` to read.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> reader = StockScalerReader(scaler)
        >>> reader.read()["scale"], reader.read()["steps"]
        (1024.0, 0)
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.steps = 0
        self._skipped: torch.Tensor | None = None
        self._prev_scale: torch.Tensor | None = None
        self._restored_skipped = 0

    def after_optimizer_step(self, steps: int = 1) -> None:
        """Count ``steps`` optimizer steps and whether the last one overflowed, on the device. No host sync.

        ``GradScaler`` keeps no history: when ``steps > 1`` went by since the last call, only the
        last one's overflow can be seen, so call this after every step.
        """
        scale = self.scaler._get_scale_async()
        tracker = getattr(self.scaler, "_growth_tracker", None)
        if scale is None or tracker is None:
            return
        if self._skipped is None:
            self._skipped = torch.zeros((), dtype=torch.int64, device=scale.device)
            # The scale before the first update is the configured (or restored) initial scale.
            self._prev_scale = torch.full((), float(self.scaler._init_scale), dtype=torch.float32,
                                          device=scale.device)
        assert self._prev_scale is not None
        overflow = torch.logical_and(tracker == 0, torch.logical_not(scale > self._prev_scale))
        self._skipped.add_(overflow.to(torch.int64))
        self._prev_scale.copy_(scale)
        self.steps += steps

    def read(self) -> dict[str, Any]:
        """Scale, growth tracker and skipped steps as host numbers: one host sync."""
        scale = self.scaler._get_scale_async()
        if scale is None:
            # Not stepped yet: the configured or checkpoint-restored values GradScaler will start from.
            tracker = int(getattr(self.scaler, "_init_growth_tracker", 0))
            return {"scale": float(self.scaler._init_scale), "growth_counter": tracker, "hysteresis_left": 1,
                    "skipped_steps": self._restored_skipped, "steps": self.steps}
        skipped = self._skipped if self._skipped is not None else torch.zeros((), device=scale.device)
        values = torch.stack([scale.double(), self.scaler._growth_tracker.double(),
                              skipped.double()]).cpu().tolist()
        return {"scale": values[0], "growth_counter": int(values[1]), "hysteresis_left": 1,
                "skipped_steps": self._restored_skipped + int(values[2]), "steps": self.steps}

    def state_dict(self) -> dict[str, int]:
        """The counts kept beside the scaler (``GradScaler`` checkpoints neither). One host read."""
        return {"steps": self.steps, "skipped_steps": int(self.read()["skipped_steps"])}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` is a :meth:`state_dict` this reader can load."""
        steps = state.get("steps") if isinstance(state, dict) else None
        skipped = state.get("skipped_steps") if isinstance(state, dict) else None
        if not (type(steps) is int and type(skipped) is int and 0 <= skipped <= steps):
            raise ValueError("state: expected {'steps': int, 'skipped_steps': int} with "
                             f"0 <= skipped_steps <= steps, got {state!r}")

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue counting from a :meth:`state_dict`; load the scaler's own state first."""
        self.check_state(state)
        steps, skipped = state["steps"], state["skipped_steps"]
        self.steps = steps
        self._skipped = None  # the device count restarts at the restored scale; the host offset adds the rest
        self._prev_scale = None
        self._restored_skipped = skipped
