"""The spike rule (:class:`~lossscale_callbacks.skips._spike.SpikeRule`) on the device, for ``LossScaler``.

Per step, all on the device, no host read:

* :meth:`SpikeWindow.note_loss` (in ``scaler.scale(loss)``): the loss kept by reference (no op; several
  micro-batches' losses are averaged when the step decides).
* :meth:`SpikeWindow.decide` (in ``scaler.step``, once per update): the step's loss (and gradient norm)
  against the threshold the last applied step left, ``mean + sigma * std`` of the window: one
  comparison, whose float result the scaler merges into the overflow flag it hands the optimizer (a
  fused kernel skips on the device; otherwise the scaler's one read of the skip decision covers it).
* :meth:`SpikeWindow.commit` (in ``scaler.update``): the values enter the window only when the step
  was applied, and the next step's threshold is made.

The window is a ``(window + 2, 2 * rows + 2)`` float64 table: a ring of ``window + 1`` slots, each an
applied step's ``[values, values ** 2, 1, 1]`` (one ``pow`` of the values by ``[1, 2, 0, 0]``; row by
row: the loss, then the gradient norm), one free slot kept at 0, and a last constant row
``[0, ..., 0, -1]``. One sum over its first axis gives every statistic the threshold needs: the sums
of the values and of their squares, ``n`` and ``n - 1``. A step writes its values into the free slot
unconditionally, moves on when it was applied (the oldest slot becomes the free one) and zeroes the
free slot: a skipped step's values are written and zeroed again. The warm-up costs no op: slots
``1 .. warmup`` start with an infinite square, which makes the threshold infinite until the ring has
moved past them, i.e. until ``warmup`` values are in. With the flag merged and the outcome code made,
the rule adds 16 dispatched ops to a fused step (``tests/test_skip_spike_bf16.py`` counts them); its
cost against a step without it is in ``benchmarks/skip_overhead.py``.
"""

from __future__ import annotations

import torch

from lossscale_callbacks.integration import SpikeRule


class SpikeWindow:
    """The device side of a :class:`SpikeRule` (see the module docstring).

    Example:
        >>> window = SpikeWindow(SpikeRule(window=8, warmup=4), torch.device("cpu"))
        >>> spikes = []
        >>> for loss in [1.0, 1.1, 0.9, 1.0, 1.05, 10.0, 1.0]:
        ...     window.note_loss(torch.tensor(loss))
        ...     spike = window.decide()
        ...     spikes.append(bool(spike))
        ...     window.commit(spike == 0)
        >>> spikes
        [False, False, False, False, False, True, False]
    """

    def __init__(self, rule: SpikeRule, device: torch.device) -> None:
        self.rule = rule
        self.device = device
        rows = 2 if rule.grad_norm else 1
        self._size = size = rule.window + 1
        f64 = {"dtype": torch.float64, "device": device}
        self._table = torch.zeros(size + 1, 2 * rows + 2, **f64)
        self._table[size, -1] = -1.0  # the constant row: the last column sums to n - 1
        self._table[1:rule.warmup + 1, rows:2 * rows] = torch.inf  # the warm-up (the module docstring)
        self._pos = torch.zeros(1, dtype=torch.int64, device=device)
        self._exponents = torch.tensor([1.0] * rows + [2.0] * rows + [0.0, 0.0], **f64)
        self._entry = torch.empty(1, 2 * rows + 2, **f64)  # the step's [values, values ** 2, 1, 1]
        self._entry_flat = self._entry.view(-1)
        # With the gradient norm: the pow's base [loss, norm, loss, norm] (stacked), then the two ones.
        self._base = torch.ones(2 * rows + 2, **f64) if rows > 1 else None
        if self._base is not None:
            self._base_values, self._base_judged = self._base[:4], self._base[:2]
            self._no_norm = torch.zeros((), **f64)
        self._sums = torch.zeros(2 * rows + 2, **f64)
        # Views made once: a view made in the step is one more op.
        self._s, self._q = self._sums[:rows], self._sums[rows:2 * rows]
        self._n, self._n1 = self._sums[2 * rows], self._sums[2 * rows + 1]
        self._threshold = torch.full((rows,), torch.inf, **f64)
        self._threshold_loss = self._threshold[0]
        self._spike = torch.zeros((), dtype=torch.float32, device=device)
        self._above = torch.zeros(rows, dtype=torch.float32, device=device) if rows > 1 else None
        self._losses: list[torch.Tensor] = []  # the micro-batch losses noted this step
        self._value: torch.Tensor | None = None  # the step's loss (0-d), or the pow's base
        self._decided = False

    @torch.no_grad()
    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's (unscaled) loss, kept until the step decides."""
        if loss.numel() != 1:
            return  # not a loss: the rule judges a scalar
        self._losses.append(loss)

    @torch.no_grad()
    def decide(self, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The step's spike flag (0-d float32, 1.0 to skip), decided once per step on the device.

        ``grad_norm`` (the step's unscaled gradient norm) is needed with ``rule.grad_norm``. Without a
        noted loss the step is not judged (0) and its values do not enter the window."""
        if self._decided:
            return self._spike
        self._decided = True
        losses, self._losses = self._losses, []
        if not losses:
            self._value = None
            return self._spike.zero_()
        if len(losses) == 1:
            loss = losses[0] if losses[0].dim() == 0 else losses[0].reshape(())
        else:
            loss = torch.stack([v.reshape(()) for v in losses]).mean(dtype=torch.float64)
        if self._base is None:
            self._value = loss
            return torch.gt(loss, self._threshold_loss, out=self._spike)
        norm = self._no_norm if grad_norm is None else grad_norm
        torch.stack((loss, norm, loss, norm), out=self._base_values)
        self._value = self._base
        torch.gt(self._base_judged, self._threshold, out=self._above)
        return torch.amax(self._above, 0, out=self._spike)

    @torch.no_grad()
    def commit(self, applied: torch.Tensor) -> None:
        """After the step: its values enter the window when ``applied`` (a 0-d bool or 0/1 tensor: the
        scaler passes "an ordinary applied step", so no non-finite value enters either), and the next
        step's threshold is made from the window."""
        if not self._decided:
            return
        self._decided = False
        value, self._value = self._value, None
        if value is None:
            return
        torch.pow(value, self._exponents, out=self._entry_flat)
        table, pos = self._table, self._pos
        table.index_copy_(0, pos, self._entry)
        pos.add_(applied).remainder_(self._size)  # a bool or integer flag adds as 0/1
        table.index_fill_(0, pos, 0.0)
        torch.sum(table, 0, out=self._sums)
        mean = torch.div(self._s, self._n)
        # var = (sum(v^2) - mean * sum(v)) / (n - 1), from the sums; clamped at 0 against rounding.
        std = torch.addcmul(self._q, mean, self._s, value=-1.0).div_(self._n1).clamp_(min=0).sqrt_()
        torch.add(mean, std, alpha=self.rule.sigma, out=self._threshold)
