"""Known-answer models for the precision advisor's torch tests and benchmark (CPU float16 autocast).

Each fails float16 in a known layer: a Linear whose output crosses 65504 when its input grows (at a
known step), a T5-style feed-forward block whose ``wo`` overflows and whose next norm turns the Inf
into NaN (the producer is ``ff.wo``, not the norm), attention scores that overflow before the softmax
(computed inline: the producer is the ``attn`` module). ``Fits`` fits.
"""

from __future__ import annotations

import torch
from torch import nn


class Crossing(nn.Module):
    """``lin``'s output is 32 * 2**(step + 3) for ``crossing_input(step)``: above 65504 from step 11."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        with torch.no_grad():
            self.inp.weight.fill_(0.25)
            self.lin.weight.fill_(0.5)
            self.inp.bias.zero_()
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(self.inp(x))))


CROSSING_STEP = 11


def crossing_input(step: int) -> torch.Tensor:
    return torch.full((2, 4), 2.0 ** (step + 3))


class T5LayerNorm(nn.Module):
    """T5's RMS norm: computed in float32, so an Inf input becomes NaN (Inf * rsqrt(Inf) = Inf * 0)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (self.weight * (x.float() * torch.rsqrt(var + self.eps))).to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.wi, self.act, self.wo = nn.Linear(d, f, bias=False), nn.ReLU(), nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class T5Block(nn.Module):
    """``ff.wo``'s weights as large as a bf16-pretrained T5's: its output reaches about 1e5."""

    def __init__(self, d: int = 8, f: int = 16) -> None:
        super().__init__()
        self.inp, self.ff = nn.Linear(8, d), FeedForward(d, f)
        self.norm, self.head = T5LayerNorm(d), nn.Linear(d, 1)
        with torch.no_grad():
            self.ff.wo.weight.mul_(100000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.norm(h + self.ff(h)))


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # no 1/sqrt(d): they overflow float16
        return self.o(torch.softmax(scores.float(), -1).to(scores.dtype) @ self.v(x))


class AttentionModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(8, d), Attention(d), nn.Linear(d, 1)
        with torch.no_grad():
            self.attn.q.weight.mul_(100.0)
            self.attn.k.weight.mul_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.inp(x)))


class Fits(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.act, self.out = nn.Linear(8, d), nn.ReLU(), nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


def data(model: str, n: int = 512, signal: float = 1.0, noise: float = 0.3,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``signal * sin(x0) + noise``: the noise sets a loss floor (far more samples than
    parameters) that both precisions reach; with no signal, a model whose head starts at zero is at that
    floor from the first step, and its mini-batch gradients keep one size from the first step to the last."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, 4, 8) if model == "attention" else (n, 8)
    x = torch.randn(*shape, generator=g) * 4
    y = signal * x[..., :1].sin() + noise * torch.randn(*shape[:-1], 1, generator=g)
    return x, y


def batches(model: str, count: int, size: int = 32, **kwargs: float
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` mini-batches, cycling through :func:`data` (``kwargs``: its ``signal`` and ``noise``)."""
    x, y = data(model, **kwargs)
    starts = [(i * size) % len(x) for i in range(count)]
    return [(x[s:s + size], y[s:s + size]) for s in starts]


MODELS = {"t5": T5Block, "attention": AttentionModel, "fits": Fits}
