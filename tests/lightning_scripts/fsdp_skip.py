"""FSDP on 2 CPU processes (gloo) with LossScaler: the overflow decision must be global.

With sharded gradients each rank checks only its own shard, so an Inf in rank 1's shard is
invisible to rank 0 unless the flag is all-reduced:

* ``fsdp1_auto``: FSDP (v1) flat parameters; ``sync_found_inf="auto"`` recognises them and
  all-reduces the flag, so both ranks skip;
* ``fsdp1_off``: the same with ``sync_found_inf=False``, the control: only rank 1 skips;
* ``fsdp2_off``: FSDP2 (``fully_shard``, DTensor gradients) with ``sync_found_inf=False``: torch's
  DTensor dispatch reduces the flag of the check kernel itself, so both ranks skip anyway.

Each rank writes ``<out>/<mode>_rank<r>.json``. Run by ``tests/test_torch_fsdp.py``.

Usage: python fsdp_skip.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.torch import LossScaler

STEPS, INJECT_STEP, INJECT_RANK = 5, 2, 1
MODES = ("fsdp1_auto", "fsdp1_off", "fsdp2_off")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _wrap(mode: str, model: torch.nn.Module) -> torch.nn.Module:
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))


def train(rank: int, mode: str, out: str) -> None:
    torch.manual_seed(0)
    model = _wrap(mode, torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0), device="cpu",
                        sync_found_inf="auto" if mode.endswith("auto") else False)
    skipped = []
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        scaler.scale(model(x).pow(2).mean()).backward()
        if step == INJECT_STEP and rank == INJECT_RANK:
            with torch.no_grad():
                _local(params[0].grad).view(-1)[0] = math.inf  # only in this rank's shard
        before = [_local(p).detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        if all(torch.equal(b, _local(p)) for b, p in zip(before, params, strict=True)):
            skipped.append(step)
    with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump({"state": scaler.get_state()._asdict(), "skipped": skipped,
                   "grad_type": type(params[0].grad).__name__}, f)


def worker(rank: int, world: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for mode in MODES:
        train(rank, mode, out)
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    # gloo's background threads can abort a normal interpreter shutdown; the results are written.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(2, _free_port(), sys.argv[1]), nprocs=2)
