"""The spike rule (:class:`~lossscale_callbacks.skips._spike.SpikeRule`) on the device, for ``LossScaler``.

Per step, all on the device, no host read:

* :meth:`SpikeWindow.note_loss` (in ``scaler.scale(loss)``): the loss added into the step's sum (one op;
  several micro-batches' losses are averaged).
* :meth:`SpikeWindow.decide` (in ``scaler.step``, once per update): the step's loss (and gradient norm)
  against the window's mean and deviation; the result is a float flag the scaler merges into the
  overflow flag it hands the optimizer (a fused kernel skips on the device; otherwise the scaler's one
  read of the skip decision covers it).
* :meth:`SpikeWindow.commit` (in ``scaler.update``): the values enter the window only when the step was
  applied.

The window is a ``(rows, window + 1)`` float64 buffer (row 0 the loss, row 1 the gradient norm): the
values of the last ``window`` applied steps and one free slot kept at 0, so plain sums over a row give
the window's sums while it fills. An applied step writes its value into the free slot and moves on,
zeroing the next slot (the oldest value leaves); a skipped one writes 0 there and stays. With the flag
merged and the outcome code counted, the rule adds 34 dispatched ops to a fused step
(``tests/test_skip_spike_bf16.py`` counts them); its cost against a step without it is in
``benchmarks/skip_overhead.py``.
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
        ...     window.commit(torch.logical_not(spike.bool()))
        >>> spikes
        [False, False, False, False, False, True, False]
    """

    def __init__(self, rule: SpikeRule, device: torch.device) -> None:
        self.rule = rule
        self.device = device
        rows = 2 if rule.grad_norm else 1
        size = rule.window + 1
        f64 = {"dtype": torch.float64, "device": device}
        self._buf = torch.zeros(rows, size, **f64)
        self._n = torch.zeros(rows, **f64)  # applied values in the window (the same in every row)
        self._pos = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self._loss = torch.zeros((), **f64)  # the step's summed micro-batch losses
        self._x = torch.zeros(rows, **f64)  # the step's values
        self._x_loss = self._x[0]  # views made once: a view made in the step is one more op
        self._x_norm = self._x[1] if rows > 1 else None
        self._spike = torch.zeros((), dtype=torch.float32, device=device)
        self._losses = 0  # micro-batch losses noted this step (host count)
        self._decided = False
        self._sigma, self._warmup, self._size = rule.sigma, float(rule.warmup), size

    @torch.no_grad()
    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's (unscaled) loss: summed on the device until the step decides."""
        if loss.numel() != 1:
            return  # not a loss: the rule judges a scalar
        value = loss if loss.dim() == 0 else loss.reshape(())
        if self._losses == 0:
            self._loss.copy_(value)
        else:
            self._loss.add_(value)
        self._losses += 1

    def decide(self, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The step's spike flag (0-d float32, 1.0 to skip), decided once per step on the device.

        ``grad_norm`` (the step's unscaled gradient norm) is needed with ``rule.grad_norm``. Without a
        noted loss the step is not judged (0)."""
        if self._decided:
            return self._spike
        self._decided = True
        if self._losses == 0:
            return self._spike.zero_()
        x = self._x
        if self._losses > 1:
            torch.div(self._loss, self._losses, out=self._x_loss)
        else:
            self._x_loss.copy_(self._loss)
        if self._x_norm is not None:
            if grad_norm is None:
                self._x_norm.zero_()
            else:
                self._x_norm.copy_(grad_norm)
        n = self._n
        mean = self._buf.sum(1).div_(n)
        # var = (sum(v^2) - n * mean^2) / (n - 1), from the sums; clamped at 0 against rounding.
        var = self._buf.square().sum(1).sub_(mean.square().mul_(n)).div_(n - 1).clamp_(min=0)
        above = (x - mean).gt_(var.sqrt_().mul_(self._sigma))
        judged = n >= self._warmup
        self._spike.copy_(above.logical_and_(judged).any())
        return self._spike

    def commit(self, applied: torch.Tensor) -> None:
        """After the step: its values enter the window when ``applied`` (a 0-d bool or 0/1 tensor: the
        scaler passes "an ordinary applied step", so no non-finite value enters either)."""
        if not self._decided:
            return
        self._buf.scatter_(1, self._pos, (self._x * applied).unsqueeze(1))
        self._pos.add_(applied).remainder_(self._size)  # a bool or integer flag adds as 0/1
        self._buf.scatter_(1, self._pos, 0.0)
        self._n.add_(applied).clamp_(max=self.rule.window)
        self._losses = 0
        self._decided = False
