"""The fp16 recipe of RL fine-tuning stacks: FSDP2 with an fp16 ``MixedPrecisionPolicy`` and ``LossScaler``.

Reinforcement-learning fine-tuning went back from bf16 to fp16 (verl, slime, OpenRLHF,
torchtitan); their FSDP2 workers need a loss scaler whose overflow decision is global. This script
runs that recipe on two processes (gloo on the CPU, NCCL on GPUs): ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``, ``LossScaler`` with the overflow
flag all-reduced across the shard group (``sync_found_inf=True``), gradient clipping on the unscaled
gradients, a checkpoint (model and optimizer shards, the scaler) and a resume from it. The logging
loop reads every rank's state at the log interval and says if the ranks ever disagree.

Side by side, the same run with torch's ``ShardedGradScaler`` (``--scaler sharded``): on the same
seed both give the same scales, the same skipped steps and the same final parameters.

    python examples/fsdp2_fp16_rl.py --steps 30 --inject 5,6 --record
    python examples/fsdp2_fp16_rl.py --scaler sharded --record
    python examples/fsdp2_fp16_rl.py --scaler both --record    # both, one after the other

Each rank writes ``<out>/<scaler>_<run>_rank<r>.json`` (runs: ``full``, and ``resumed`` from the
checkpoint at ``--checkpoint-at``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lossscale_callbacks import DynamicPolicy, LoggingLoop
from lossscale_callbacks.torch import LossScaler, ScalerReader

INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 5


def make_scaler(kind: str, device: str) -> torch.amp.GradScaler:
    if kind == "sharded":
        return ShardedGradScaler(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    # The flag reduced across the shard group: every rank skips the same steps.
    return LossScaler(policy=DynamicPolicy(initial_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
                      device=device, sync_found_inf=True)


def make_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(device)
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=fp16)
    fully_shard(model, mp_policy=fp16)
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train(args: argparse.Namespace, kind: str, rank: int, device: str, run: str) -> dict:
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = make_scaler(kind, device)
    reader = ScalerReader(scaler)
    loop = LoggingLoop(scaler.policy if isinstance(scaler, LossScaler) else None, log_every=args.log_every,
                       echo=print if rank == 0 and run == "full" and kind == "ours" else None)
    ckpt = os.path.join(args.out, f"{kind}_ckpt_rank{rank}.pt")
    start = 0
    if run == "resumed":
        saved = torch.load(ckpt, weights_only=False)  # our own file: DTensor shards and plain dicts
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        reader.load_state_dict(saved["scaler"])  # the scale, its counters and the steps and skips
        loop.baseline(reader.read())  # compares the ranks once, right after the resume
        start = saved["step"]
    scales, skipped = [], []
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), x[:, :4].sin())  # fp16 compute, fp32 loss
        scaler.scale(loss).backward()
        if step in args.inject and rank == 1:
            with torch.no_grad():  # an overflow in this rank's shard only
                _local(next(model.parameters()).grad).view(-1)[0] = math.inf
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # unscaled gradients
        scaler.step(opt)
        scaler.update()
        reader.after_optimizer_step()
        loop.maybe_observe(step + 1, reader.read)
        if args.record:  # a host read every step: for the side-by-side comparison only
            state = reader.read(gather=False)
            scales.append(state.scale)
            skipped.append(state.skipped_steps)
        if run == "full" and step + 1 == args.checkpoint_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": reader.state_dict(),
                        "step": step + 1}, ckpt)
    summary = loop.finish(reader.read())
    params = [_local(p).detach().float().flatten().tolist() for p in model.parameters()]
    return {"scales": scales, "skipped": skipped, "params": params, "summary": summary,
            "verdicts": [v.rule for v in loop.verdicts], "start": start}


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = f"cuda:{rank}" if cuda else "cpu"
    for kind in ("ours", "sharded") if args.scaler == "both" else (args.scaler,):
        for run in ("full", "resumed"):
            result = train(args, kind, rank, device, run)
            with open(os.path.join(args.out, f"{kind}_{run}_rank{rank}.json"), "w") as f:
                json.dump(result, f)
            dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's background threads can abort a normal interpreter shutdown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scaler", choices=("ours", "sharded", "both"), default="ours")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-at", type=int, default=15)
    parser.add_argument("--inject", type=lambda s: {int(v) for v in s.split(",") if v}, default={5, 6})
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", default="")
    parser.add_argument("--record", action="store_true", help="record the scale and skips at every step")
    args = parser.parse_args(argv)
    args.out = args.out or tempfile.mkdtemp(prefix="fsdp2_fp16_")
    mp.spawn(worker, args=(2, _free_port(), args), nprocs=2)
    return args.out


if __name__ == "__main__":
    print("results in", main())
