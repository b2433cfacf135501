"""Two gloo ranks that gather their loss-scale states and then free a DDP model, many times over.

Freeing ``DistributedDataParallel`` destroys its process group, which joins gloo's worker threads while
holding the GIL; a worker still letting go of the last gather's tensors needs the GIL too, and the process
hung (torch 2.13: within 150 rounds in each of 3 runs before ``gather_states`` waited for the release; the
plain DDP example of the docs hung at exit about one run in five). Each round: a new gloo group, a DDP
model on it with one backward pass, a pause so that DDP's own collectives are done, one gather, the model
freed. Rank 0 prints ``done N`` at the end; a hang is the caller's timeout.

Usage: python gather_teardown.py ROUNDS
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from lossscale_callbacks._state import LossScaleState
from lossscale_callbacks.torch._rank_gather import gather_states


def rank_main(rank: int, world: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = LossScaleState(1024.0, 0, 1, 0, 10)
    for _ in range(rounds):
        group = dist.new_group(backend="gloo")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1), process_group=group)
        model(torch.ones(2, 4)).sum().backward()
        time.sleep(0.05)  # DDP's own broadcast and all-reduce let go of their tensors
        assert gather_states(state, group=group).world_size == world
        dist.destroy_process_group(group)
        del group, model  # the reducer destroys the group here
    if rank == 0:
        print("done", rounds, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.multiprocessing.spawn(rank_main, args=(2, int(sys.argv[1])), nprocs=2)
