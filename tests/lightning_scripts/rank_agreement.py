"""Four CPU processes (gloo): do the ranks' loss-scale states agree, and is it said when they do not?

Each rank trains its own shard (a local linear layer: nothing reduces the gradients, as with a
sharded model) with ``LossScaler``; rank 2 gets an Inf in its shard's gradient at some steps.

* ``unreduced``: ``sync_found_inf=False``: only rank 2 skips, its scale backs off, and the
  logging loop (fed by ``ScalerReader.read``, which gathers every rank's state) reports it at the
  next log interval, naming rank 2;
* ``reduced``: ``sync_found_inf=True``, 500 steps with several Infs: every rank skips the same
  steps, nothing is reported;
* ``resumed``: through ``ScalerStepMonitor`` (the base of the Fabric and Accelerate monitors):
  rank 3 loads an older checkpoint than the others; reported at the resume and named;
* ``counted``: the calls made after each optimizer step, with their host reads (library code
  only) and collectives counted: none on steps that end no interval, one ``all_gather`` on those
  that do.

Each rank writes ``<out>/<mode>_rank<r>.json``. Run by ``tests/test_rank_agreement.py``.

Usage: python rank_agreement.py OUT_DIR
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
from host_reads import HostReadCounter

import lossscale_callbacks
from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop
from lossscale_callbacks.torch import LossScaler, ScalerReader
from lossscale_callbacks.torch._step_monitor import ScalerStepMonitor

WORLD, INJECT_RANK, LOG_EVERY = 4, 2, 10
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "gather", "barrier",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor")


class Monitor(ScalerStepMonitor):
    def step(self):
        return self._count_step()


class CollectiveCounter:
    """Counts the torch.distributed collectives called while active (looked up at call time)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.active = False
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                if self.active:
                    self.calls.append(_name)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)


def _train_step(rank, step, model, opt, scaler, inject_steps):
    opt.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    scaler.scale(model(x).pow(2).mean()).backward()
    if rank == INJECT_RANK and step in inject_steps:
        with torch.no_grad():
            model.weight.grad.view(-1)[0] = math.inf  # only in this rank's shard
    scaler.step(opt)
    scaler.update()


def _setup(rank, sync):
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0, growth_interval=100), device="cpu",
                        sync_found_inf=sync)
    return model, opt, scaler


def _result(loop, memory, **more):
    return {"verdicts": [[v.rule, v.step, v.message] for v in loop.verdicts],
            "disagree": memory.series("loss_scale/ranks_disagree"),
            "summary": loop.summary, "rank_reads": loop.rank_reads, **more}


def plain_loop(rank, sync, steps, inject_steps):
    model, opt, scaler = _setup(rank, sync)
    reader, memory = ScalerReader(scaler), InMemorySink()
    loop = LoggingLoop(scaler.policy, sinks=[memory], log_every=LOG_EVERY, echo=None)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(steps):
            _train_step(rank, step, model, opt, scaler, inject_steps)
            reader.after_optimizer_step()
            loop.maybe_observe(step + 1, reader.read)
        loop.finish(reader.read())
    return _result(loop, memory, state=scaler.get_state()._asdict())


def resumed(rank):
    model, opt, scaler = _setup(rank, True)
    monitor = Monitor(scaler, log_every=LOG_EVERY, echo=None)
    saved = {}
    for step in range(20):
        _train_step(rank, step, model, opt, scaler, {5})
        monitor.step()
        if step + 1 in (10, 20):
            saved[step + 1] = monitor.state_dict()
    # A fresh job: every rank resumes, rank 3 from the older checkpoint.
    model, opt, scaler = _setup(rank, True)
    memory = InMemorySink()
    monitor = Monitor(scaler, log_every=LOG_EVERY, sinks=[memory], echo=None)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        monitor.load_state_dict(saved[10 if rank == 3 else 20])
        for step in range(20, 40):
            _train_step(rank, step, model, opt, scaler, set())
            monitor.step()
        monitor.finish()
    return _result(monitor.loop, memory, state=scaler.get_state()._asdict())


def counted(rank, counter):
    model, opt, scaler = _setup(rank, False)
    monitor = Monitor(scaler, log_every=LOG_EVERY, echo=None)
    library = os.path.dirname(lossscale_callbacks.__file__)
    integrations = os.path.join(os.path.dirname(library), "integrations")
    per_step = []
    for step in range(30):
        _train_step(rank, step, model, opt, scaler, set())
        counter.calls.clear()
        counter.active = True
        with HostReadCounter(only_under=(library, integrations)) as reads:
            snapshot = monitor.step()
        counter.active = False
        per_step.append({"step": step + 1, "read": snapshot is not None, "collectives": list(counter.calls),
                         "host_reads": len(reads.reads)})
    return {"per_step": per_step}


def worker(rank: int, world: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = CollectiveCounter()
    results = {
        "unreduced": lambda: plain_loop(rank, False, 30, {7}),
        "reduced": lambda: plain_loop(rank, True, 500, {7, 150, 151, 333}),
        "resumed": lambda: resumed(rank),
        "counted": lambda: counted(rank, counter),
    }
    for mode, run in results.items():
        with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
            json.dump(run(), f)
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's background threads can abort a normal interpreter shutdown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(WORLD, _free_port(), sys.argv[1]), nprocs=WORLD)
