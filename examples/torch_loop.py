"""Plain PyTorch training with ``LossScaler``: fp16 autocast, dynamic loss scaling, the scale on a dashboard.

The loop is the ``torch.amp.GradScaler`` recipe with ``LossScaler`` in its place. The scaler's
state stays on the device; every ``--log-every`` steps the core's ``LoggingLoop`` reads it once
(``scaler.read_state()``, one host sync) and turns it into metrics, TensorBoard scalars under
``runs/``, health rules and, at the end, a summary.

A simulated overflow hits every ``--inject-inf-every`` steps. It is longer than the policy's
growth interval (50), so the run shows both sides: the scale backs off on an overflow and grows
back after 50 clean steps (hysteresis 2: every second overflow in a row backs off).

    python examples/torch_loop.py --steps 300
    tensorboard --logdir runs
    lossscale-callbacks report runs/torch_loop
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop
from lossscale_callbacks.torch import LossScaler


def main(argv: list[str] | None = None) -> InMemorySink:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fused", action="store_true", help="fused AdamW: no host sync at all per step")
    parser.add_argument("--tensorboard", default=os.path.join("runs", "torch_loop"),
                        help="TensorBoard folder ('' for none)")
    parser.add_argument("--inject-inf-every", type=int, default=70, help="simulate an overflow this often")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.fused)
    policy = DynamicPolicy(initial_scale=2.0**16, growth_interval=50, hysteresis=2)
    scaler = LossScaler(policy=policy)

    memory = InMemorySink()
    sinks = [memory]
    if args.tensorboard:
        from lossscale_callbacks.tensorboard import TensorBoardSink  # only when asked for

        sinks.append(TensorBoardSink(args.tensorboard))
    loop = LoggingLoop(policy, sinks=sinks, log_every=args.log_every)

    x = torch.randn(512, 64, device=device)
    y = x[:, :1].sin()
    for step in range(args.steps):
        batch = torch.randint(0, x.shape[0], (32,), device=device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[batch]).float(), y[batch])
        scaler.scale(loss).backward()
        if args.inject_inf_every and step % args.inject_inf_every == args.inject_inf_every - 1:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = math.inf  # a simulated overflow: this step is skipped
        if not args.fused:  # fused optimizers unscale inside their kernel
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clipping sees unscaled gradients
        scaler.step(opt)
        scaler.update()
        # The host read (scaler.read_state) happens only when an interval ends.
        snapshot = loop.maybe_observe(step + 1, scaler.read_state)
        if snapshot is not None:
            print(f"step {snapshot.step:5d}  loss {loss.item():.4f}  scale {snapshot.scale:g}  "
                  f"skipped {snapshot.skipped_steps}")
    loop.finish(scaler.read_state())
    loop.close()
    return memory


if __name__ == "__main__":
    main()
