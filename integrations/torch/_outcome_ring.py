"""The device ring of step outcomes: which optimizer steps were not ordinary, why, at which scale.

Written inside :class:`~lossscale_callbacks.torch.LossScaler`'s update, every step, with device-side
indexing only (no host read, and on CUDA it is part of the update's captured graph: no added launch);
read once per log interval by :meth:`LossScaler.read_outcomes`, which hands back a
:class:`~lossscale_callbacks.skips._outcomes.IntervalOutcomes` (see that module for the causes and the
codes).

Layout: ``rows`` is ``(capacity + 1, 3)`` float64, one row ``[step, code, scale]`` per non-ordinary
step. Each step writes its row ``[step, code, scale used]`` at ``written % (capacity + 1)`` and moves
``written`` on only when the code is not 0, so an ordinary step writes into the free row, which the
next non-ordinary step overwrites: the ``capacity`` newest records always stand. float64 holds the step
number and the float32 scale exactly.

Cost per step on the CPU (counted in ``tests/test_skip_outcomes.py``): 7 dispatched ops, plus 2 where
causes other than a non-finite skip can occur (the spike rule, monitoring-only): there the codes are
also counted per cause, so the counts stay exact when the ring overflows. In the default mode the
only non-ordinary code is a non-finite skip, so ``written`` is its count.
"""

from __future__ import annotations

import torch

from lossscale_callbacks.integration import CODES

DEFAULT_CAPACITY = 64


class OutcomeRing:
    """The last ``capacity`` non-ordinary steps of a run, on the device.

    Args:
        device: where the scaler's state lives.
        capacity: records kept between two reads (>= 1).
        steps: the optimizer steps already taken (a resumed scaler): the next step is ``steps + 1``.
        count_codes: also count every code (needed where more than one non-ordinary code occurs).

    Example:
        >>> ring = OutcomeRing(torch.device("cpu"), capacity=2)
        >>> for flag in [0.0, 1.0, 0.0]:
        ...     ring.record(torch.tensor(flag), torch.tensor(1024.0))
        >>> rows, written, counts, step = ring.read()
        >>> written, step, rows[0]
        (1, 3, [2.0, 1.0, 1024.0])
    """

    def __init__(self, device: torch.device, capacity: int = DEFAULT_CAPACITY, steps: int = 0,
                 count_codes: bool = False) -> None:
        self.capacity = capacity
        self.device = device
        self.count_codes = count_codes
        self._rows = torch.zeros(capacity + 1, 3, dtype=torch.float64, device=device)
        self._row = torch.zeros(3, dtype=torch.float64, device=device)
        # Views made once: a view made in the step would be one more dispatched op.
        self._step, self._code, self._scale = self._row[0], self._row[1], self._row[2]
        self._row2d = self._row.view(1, 3)
        self._written = torch.zeros(1, dtype=torch.int64, device=device)
        self._pos = torch.zeros(1, dtype=torch.int64, device=device)
        self._counts = torch.zeros(len(CODES), dtype=torch.int64, device=device)
        self._code_ids = torch.tensor(CODES, dtype=torch.float32, device=device)
        self.set_steps(steps)

    def set_steps(self, steps: int) -> None:
        """The optimizer steps taken so far (a state loaded or restored): a fill, no host read."""
        self._step.fill_(steps)

    def clear(self) -> None:
        """Forget every record (a new state was loaded: the records belong to the run it replaced)."""
        self._written.zero_()
        self._counts.zero_()

    def record(self, code: torch.Tensor, scale: torch.Tensor) -> None:
        """One step: ``code`` (0-d float32, see the codes) taken at ``scale`` (the scale before the step's
        update). Device ops only."""
        self._step.add_(1)
        self._code.copy_(code)
        self._scale.copy_(scale)
        torch.remainder(self._written, self.capacity + 1, out=self._pos)
        self._rows.index_copy_(0, self._pos, self._row2d)
        self._written.add_(code != 0)
        if self.count_codes:
            self._counts.add_(self._code_ids == code)

    def flat(self) -> torch.Tensor:
        """Everything a read needs, as one flat float64 device tensor (to copy with the state: one copy)."""
        counters = [self._written.to(torch.float64), self._counts.to(torch.float64), self._step.view(1)]
        return torch.cat([self._rows.flatten(), *counters])

    def parse(self, flat: list[float]) -> tuple[list[list[float]], int, list[int], int]:
        """``(rows, written, counts per code, step)`` from :meth:`flat`'s values on the host."""
        n = (self.capacity + 1) * 3
        rows = [flat[i:i + 3] for i in range(0, n, 3)]
        counts = [int(v) for v in flat[n + 1:n + 1 + len(CODES)]]
        return rows, int(flat[n]), counts, int(flat[-1])

    def read(self) -> tuple[list[list[float]], int, list[int], int]:
        """``(rows, written, counts per code, step)`` as host numbers: one device-to-host copy."""
        return self.parse(self.flat().cpu().tolist())


__all__ = ["DEFAULT_CAPACITY", "OutcomeRing"]
