"""The device ring of step outcomes: every optimizer step's outcome code and the scale it used.

Written inside :class:`~lossscale_callbacks.torch.LossScaler`'s update, every step, with no host read;
read once per log interval by :meth:`LossScaler.read_outcomes`, which hands back a
:class:`~lossscale_callbacks.skips._outcomes.IntervalOutcomes` (see that module for the causes and the
codes).

Layout: ``rows`` is ``(capacity, 2)`` float32, one row ``[code, scale]`` per step: step ``n`` (counted
from 1 over the run) sits in slot ``(n - 1) % capacity``. The step number is the slot and the host's
step count (the update paths count steps on the host), so it is not written. Both values are float32
0-d tensors already on the device (the overflow flag or the step's code, and the scale before the
update), so one op writes the row: ``torch.stack`` into a view of the slot made once (a view made in
the step would be one more dispatched op).

Counts per code, exact without a counting op in the step: each time the host count reaches a multiple
of ``capacity`` the ring has been written around exactly once since the last time, and its codes are
counted into ``counts`` on the device (three ops every ``capacity`` steps); a read adds the codes
written since. Code 1 (a non-finite skip) is written exactly when the step's overflow flag is set, so
its count is the skipped-step count: the update paths that kept a count op of their own
(:class:`~lossscale_callbacks.torch._update_paths.AmpPath`, ``RulePath``) take it from here.

Inside a CUDA graph (the update's own capture on CUDA, or a graph the user captures) the slot cannot
come from the host: there the ring keeps the step count on the device too and writes the same slot by
device-side indexing (4 ops, inside the graph: no added launch). ``tests/test_skip_outcomes.py``
proves the two writers leave identical rings.

Cost per step on the CPU (counted in ``tests/test_skip_outcomes.py``): 1 dispatched op, and without
hysteresis the path drops its own count op, so the default update stays at 4 ops.

When more than ``capacity`` steps pass between two reads the oldest rows are overwritten: the read
lists the newest steps, the counts stay exact (the scaler reports the rest as ``missed``), and
:meth:`OutcomeRing.grow` makes the ring long enough for the interval just read (allocated at the
read, nothing in the step).
"""

from __future__ import annotations

import numpy as np
import torch

from lossscale_callbacks.integration import CODES

DEFAULT_CAPACITY = 2048  # steps: 16 KiB of rows, a log interval of up to 2048 steps read in full
MAX_CAPACITY = 2**20  # what grow() allocates at most: 8 MiB of rows


class OutcomeRing:
    """The last ``capacity`` optimizer steps' outcome codes and scales, on the device.

    Args:
        device: where the scaler's state lives.
        capacity: steps kept between two reads (>= 1).
        steps: the optimizer steps already taken (a resumed scaler): the next step is ``steps + 1``.
        device_index: write the slot by device-side indexing (what a CUDA graph needs); default: on
            CUDA only.

    Example:
        >>> ring = OutcomeRing(torch.device("cpu"), capacity=4)
        >>> for steps, flag in enumerate([0.0, 1.0, 0.0], start=1):
        ...     ring.record(torch.tensor(flag), torch.tensor(1024.0))
        ...     ring.after_step(steps)
        >>> rows, counts, step = ring.parse(ring.flat().numpy(), since=0)
        >>> rows, counts, step
        ([[2.0, 1.0, 1024.0]], [2, 1, 0, 0], 3)
    """

    def __init__(self, device: torch.device, capacity: int = DEFAULT_CAPACITY, steps: int = 0,
                 device_index: bool | None = None) -> None:
        self.device = device
        self.device_index = device.type == "cuda" if device_index is None else device_index
        # Counted: the codes other than 0 (a never-written slot reads 0); code 0 is the rest of the steps.
        self._counts = torch.zeros(len(CODES) - 1, dtype=torch.float64, device=device)
        self._code_ids = torch.tensor(CODES[1:], dtype=torch.float32, device=device).view(-1, 1)
        # The device-index writer's state: the step count, the slot, and the row it stages.
        self._device_steps = torch.zeros(1, dtype=torch.int64, device=device)
        self._pos = torch.zeros(1, dtype=torch.int64, device=device)
        self._row = torch.zeros(1, 2, dtype=torch.float32, device=device)
        self._row_flat = self._row.view(2)
        self._allocate(capacity)
        self.set_steps(steps)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows = torch.zeros(capacity, 2, dtype=torch.float32, device=self.device)
        # Views made once (one unbind): a view made in the step would be one more dispatched op.
        self._slots = self._rows.unbind(0)
        self._codes = self._rows[:, 0]

    def set_steps(self, steps: int) -> None:
        """The optimizer steps taken so far (a state loaded or restored): a fill, no host read."""
        self.steps = self._origin = steps
        self._device_steps.fill_(steps)

    def clear(self, steps: int) -> None:
        """Forget every step (a new state was loaded: the steps belong to the run it replaced); ``steps``
        taken now."""
        self._rows.zero_()
        self._counts.zero_()
        self.set_steps(steps)

    def record(self, code: torch.Tensor, scale: torch.Tensor) -> None:
        """Step ``steps + 1``: ``code`` (0-d float32, see the codes) taken at ``scale`` (0-d float32, the
        scale before the step's update). Device ops only; :meth:`after_step` follows on the host."""
        if self.device_index:
            torch.remainder(self._device_steps, self.capacity, out=self._pos)
            torch.stack((code, scale), out=self._row_flat)
            self._rows.index_copy_(0, self._pos, self._row)
            self._device_steps.add_(1)
        else:
            torch.stack((code, scale), out=self._slots[self.steps % self.capacity])

    def after_step(self, steps: int) -> None:
        """The host's part of a step (also after a CUDA graph replay): ``steps`` taken now. Once the ring
        has been written around, its codes are counted (no host read)."""
        self.steps = steps
        if steps % self.capacity == 0:
            self._count(self._codes)

    def _count(self, codes: torch.Tensor) -> None:
        self._counts.add_((codes == self._code_ids).sum(1))

    def _pending(self) -> torch.Tensor:
        """The codes written since they were last counted (slots ``0 .. steps % capacity``)."""
        return self._codes[:self.steps % self.capacity]

    def count(self, code: int) -> torch.Tensor:
        """Steps recorded with ``code`` (not 0) since the ring was made or cleared: 0-d float64 on the
        device (exact), for a read: a few ops, no host read."""
        return self._counts[CODES.index(code) - 1] + (self._pending() == code).sum()

    def nonfinite_skips(self) -> torch.Tensor:
        """:meth:`count` of code 1, the non-finite skips: the steps whose overflow flag was set."""
        return self.count(CODES[1])

    def flat(self) -> torch.Tensor:
        """Everything a read needs, as one flat float64 device tensor (to copy with the state: one copy):
        the counts, then the rows."""
        return torch.cat([self._counts, self._rows.flatten().to(torch.float64)])

    def parse(self, flat: np.ndarray, since: int) -> tuple[list[list[float]], list[int], int]:
        """From :meth:`flat`'s values on the host: ``(rows, counts, step)``, where ``rows`` are ``[step,
        code, scale]`` of the non-ordinary steps after step ``since`` still in the ring (oldest first),
        ``counts`` the steps per code since the ring was made or cleared (exact), ``step`` the steps taken.

        The ring holds steps ``step - capacity + 1 .. step``: older steps after ``since`` are not listed
        (they are counted).
        """
        n = len(CODES)
        values = np.asarray(flat, dtype=np.float64)
        rows = values[n - 1:].reshape(self.capacity, 2)
        pending = rows[:self.steps % self.capacity, 0].astype(np.int64)
        counts = np.rint(values[:n - 1]).astype(np.int64) + np.bincount(pending, minlength=n)[1:n]
        counts = [self.steps - self._origin - int(counts.sum()), *counts.tolist()]
        numbers = np.arange(max(since, self.steps - self.capacity) + 1, self.steps + 1)
        picked = rows[(numbers - 1) % self.capacity]
        keep = picked[:, 0] != 0
        listed = np.column_stack([numbers[keep], picked[keep]])
        return listed.tolist(), counts, self.steps

    def read(self, since: int = 0) -> tuple[list[list[float]], list[int], int]:
        """:meth:`parse` of the device values: one device-to-host copy."""
        return self.parse(self.flat().cpu().numpy(), since)

    def grow(self, interval: int) -> bool:
        """Make the ring hold ``interval`` steps (a power of two, at most ``MAX_CAPACITY``), at a read that
        found a longer interval than it holds. Allocates; the counts so far are kept, the rows (already
        read) are not. Returns whether it grew: the caller then hands the ring to its path again (a
        captured CUDA graph writes into the old rows)."""
        capacity = min(1 << max(interval - 1, 0).bit_length(), MAX_CAPACITY)
        if capacity <= self.capacity:
            return False
        self._count(self._pending())
        self._allocate(capacity)
        return True


__all__ = ["DEFAULT_CAPACITY", "MAX_CAPACITY", "OutcomeRing"]
