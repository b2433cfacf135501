"""Two CPU processes (gloo) training a torchao float8 model: do the ranks cast their weights with the same
scales, and is it said when they do not?

* ``synced``: the model wrapped in ``DistributedDataParallel`` (rank 0's weights broadcast at the start,
  the gradients averaged): every rank holds the same weights, so the same weight scales;
* ``unsynced``: each rank builds the model with its own seed and the gradients are averaged by hand, but
  the weights were never broadcast: the ranks' weights, their amaxes and their scales differ.

Each rank is a process of its own (started here, as ``torchrun`` would) that runs both modes, one after the
other in one process group (torch is imported once a rank, not once a mode; the launcher imports none), and
writes ``<out>/<mode>_rank<r>.json``. Run by ``tests/test_fp8_ranks.py``.

Usage: python fp8_ranks.py OUT_DIR [MODE...]
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import subprocess
import sys

WORLD, STEPS = 2, 20


def model(seed: int):
    import torch
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    convert_to_float8_training(net)
    return net


def run(rank: int, modes: list[str], out: str, port: int) -> None:
    import torch.distributed as dist

    faulthandler.dump_traceback_later(150, exit=True)  # a hung rank says where it hangs, then ends
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for mode in modes:
            result = train(rank, mode)
            with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as handle:
                json.dump(result, handle)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def train(rank: int, mode: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from lossscale_callbacks import InMemorySink
    from lossscale_callbacks.torch import Fp8ScaleMonitor

    if mode == "synced":
        net = torch.nn.parallel.DistributedDataParallel(model(0))
    else:
        net = model(rank)  # never broadcast: each rank starts from its own weights
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
    memory = InMemorySink()
    monitor = Fp8ScaleMonitor(net, log_every=10, count_every=5, sinks=[memory], echo=None)
    torch.manual_seed(100 + rank)  # each rank its own data
    for _ in range(STEPS):
        net(torch.randn(16, 32)).square().mean().backward()
        if mode == "unsynced":
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad /= WORLD
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    summary = monitor.finish()
    result = {"verdicts": [[v.rule, v.step, v.message] for v in monitor.loop.verdicts],
              "summary": summary, "disagree": memory.series("fp8/ranks_disagree")}
    # DDP freed before the group goes: a gloo group destroyed through DDP's reducer can hang the exit
    del net, optimizer, monitor
    gc.collect()
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(folder: str, modes: list[str]) -> None:
    """The ranks, each a process running ``modes``, and a timeout on the whole."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, folder, ",".join(modes), str(rank), str(port)])
             for rank in range(WORLD)]
    try:
        codes = [proc.wait(timeout=200) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(codes):
        sys.exit(f"{modes}: the ranks exited with {codes}")


if __name__ == "__main__":
    if len(sys.argv) == 5:  # one rank
        run(int(sys.argv[3]), sys.argv[2].split(","), sys.argv[1], int(sys.argv[4]))
    else:
        launch(sys.argv[1], sys.argv[2:] or ["synced", "unsynced"])
