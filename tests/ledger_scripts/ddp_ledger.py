"""The ledger's scenario under DDP with 2 gloo ranks, each a process: ``python ddp_ledger.py OUT``.

Each rank trains the scenario's model (DistributedSampler, shuffled with seed 0, batch 8 a rank), an Inf
written into rank 0's gradient at step 50 (``sync_found_inf=True``: every rank skips it), replay on,
and writes its own ledger ``OUT/bad_steps.rank<r>.jsonl`` and its sample order ``OUT/order_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ledger_scenario as sc

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.torch import LossScaler

WORLD = 2


def worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(sc.Net())
    data = sc.dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=sc.BATCH, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0, growth_interval=10_000),
                        sync_found_inf=True).watch(model)
    loader = scaler.track(loader, ledger=out, replay=True, loss=lambda batch: sc.loss_fn(model, batch))
    orders, step = [], 0
    for epoch in range(sc.EPOCHS):
        sampler.set_epoch(epoch)
        orders.append([int(i) for i in sampler])
        for batch in loader:
            step += 1
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sc.loss_fn(model, batch)
            scaler.scale(loss).backward()
            if step == sc.INJECT_AT and rank == 0:
                model.module.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step % 10 == 0:
                scaler.read_outcomes()  # the skip truth, read at the interval: the ledger takes its bad steps
    scaler.read_outcomes()
    scaler.ledger.close()
    with open(os.path.join(out, f"order_rank{rank}.json"), "w") as handle:
        json.dump({"orders": orders, "steps": step}, handle)
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
