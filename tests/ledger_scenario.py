"""The ledger's acceptance scenario, shared by the plain torch, distributed and framework tests.

512 samples; samples 37 and 301 scaled so that ``fc2``'s float16 output overflows (finite in float32);
batch size 8, shuffled with seed 0; 3 epochs (192 steps); a one-off Inf written into a gradient at
step 50, whose batch is clean. ``fc2`` is made to amplify (its weights times 20) and the bad samples are
scaled by 8,000, so that its output overflows float16 (about 1.2e5 > 65,504) while ``fc1``'s does not
(about 1.4e4), for the whole run.
"""

from __future__ import annotations

from typing import Any

import torch

BAD = (37, 301)
N, BATCH, EPOCHS, INJECT_AT = 512, 8, 3, 50
SCALE_BAD = 8000.0


class Net(torch.nn.Module):
    """fc1 -> ReLU -> fc2 (amplifying) -> ReLU -> dropout -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(64, 1)
        with torch.no_grad():
            self.fc2.weight.mul_(20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.act(self.fc2(self.act(self.fc1(x))))))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 16, generator=g), torch.randn(N, 1, generator=g)
    x[list(BAD)] *= SCALE_BAD
    return torch.utils.data.TensorDataset(x, y)


def expected_bad_steps(order_per_epoch: list[list[int]]) -> dict[int, int]:
    """step -> the bad sample in its batch, from the sampler's order of each epoch."""
    out = {}
    for epoch, order in enumerate(order_per_epoch):
        for b in range(0, len(order), BATCH):
            batch = order[b:b + BATCH]
            for sample in BAD:
                if sample in batch:
                    out[epoch * ((len(order) + BATCH - 1) // BATCH) + b // BATCH + 1] = sample
    return out


def shuffled_orders(n: int = N, seed: int = 0, epochs: int = EPOCHS) -> list[list[int]]:
    """The sample order of each epoch of ``DataLoader(..., shuffle=True, generator=seeded(seed))``: the
    loader itself iterated over the indices (it also draws its workers' base seed from the generator)."""
    loader = torch.utils.data.DataLoader(range(n), batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    return [[int(i) for batch in loader for i in batch] for _ in range(epochs)]


def loader(data: Any, seed: int = 0, wrap: Any = None) -> torch.utils.data.DataLoader:
    """``DataLoader(data, batch_size=8, shuffle=True, generator=seeded(seed))``, spelled with its sampler so
    that ``wrap`` (a skip list's sampler wrapper) can take it: the same order."""
    generator = torch.Generator().manual_seed(seed)
    sampler: Any = torch.utils.data.RandomSampler(data, generator=generator)
    if wrap is not None:
        sampler = wrap(sampler)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler, generator=generator)


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])
