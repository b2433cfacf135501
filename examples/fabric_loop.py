"""Lightning Fabric with loss scaling: one plugin, one monitor, a checkpoint that resumes the scale.

``Fabric(plugins=[LossScaleFabricPlugin()])`` runs fp16 autocast with the core's dynamic loss
scaling (on the CPU too): ``fabric.backward`` scales the loss, ``optimizer.step()`` unscales,
skips a step with Inf/NaN gradients and updates the scale. ``FabricLossScaleMonitor`` reads the
scaler once every ``--log-every`` steps and writes ``loss_scale/*`` to the Fabric's loggers (a
TensorBoard folder under ``runs/`` here), runs the health rules and prints a summary at the end.
Fabric does not checkpoint its precision plugin; the monitor does (it carries the scaler's state),
so saving it with the model resumes the scale where it was.

The run trains ``--steps`` steps with a simulated overflow every ``--inject-inf-every`` steps,
saves a checkpoint halfway, and then resumes a second Fabric from it to show the scale restored.
On a GPU with several devices, ``Fabric(strategy="fsdp", plugins=[LossScaleFabricFSDPPlugin()])``
is the same program.

    python examples/fabric_loop.py --steps 200
    tensorboard --logdir runs
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.lightning.fabric import FabricLossScaleMonitor, LossScaleFabricPlugin


def make_fabric(args: argparse.Namespace, version: str) -> Fabric:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plugin = LossScaleFabricPlugin("16-mixed", device=device,
                                   policy=DynamicPolicy(initial_scale=2.0**16, growth_interval=50))
    logger = TensorBoardLogger(args.out, name="fabric_loop", version=version)
    fabric = Fabric(accelerator=device, devices=1, plugins=[plugin], loggers=[logger])
    fabric.launch()
    return fabric


def train(fabric: Fabric, args: argparse.Namespace, first: int, last: int,
          checkpoint: str | None = None) -> FabricLossScaleMonitor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    monitor = FabricLossScaleMonitor(fabric, log_every=args.log_every)
    if checkpoint is not None:
        # The checkpoint's other entries come back as the remainder, on every strategy.
        remainder = fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
        monitor.load_state_dict(remainder["loss_scale"])
        first = remainder["step"]
    x = torch.randn(512, 64, device=fabric.device)
    y = x[:, :1].sin()
    for step in range(first, last):
        batch = torch.randint(0, x.shape[0], (32,), device=fabric.device)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[batch]).float(), y[batch])
        fabric.backward(loss)
        if args.inject_inf_every and step % args.inject_inf_every == args.inject_inf_every - 1:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = math.inf  # simulated overflow: skipped
        optimizer.step()
        snapshot = monitor.step()
        if snapshot is not None:
            fabric.print(f"step {snapshot.step:5d}  loss {loss.item():.4f}  scale {snapshot.scale:g}  "
                         f"skipped {snapshot.skipped_steps}")
        if step + 1 == args.steps // 2 and checkpoint is None:
            fabric.save(os.path.join(args.out, "fabric_loop.ckpt"),
                        {"model": model, "optimizer": optimizer, "loss_scale": monitor, "step": step + 1})
    monitor.finish()
    return monitor


def main(argv: list[str] | None = None) -> tuple[FabricLossScaleMonitor, FabricLossScaleMonitor]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--inject-inf-every", type=int, default=70, help="simulate an overflow this often")
    parser.add_argument("--out", default="runs", help="TensorBoard folder and checkpoint")
    args = parser.parse_args(argv)

    full = train(make_fabric(args, "full"), args, 0, args.steps)
    print("-- resumed from the checkpoint written at step", args.steps // 2)
    resumed = train(make_fabric(args, "resumed"), args, 0, args.steps,
                    checkpoint=os.path.join(args.out, "fabric_loop.ckpt"))
    return full, resumed


if __name__ == "__main__":
    main()
