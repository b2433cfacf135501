"""Hugging Face Accelerate with loss scaling: our scaler in the Accelerator, the scale on its trackers.

``install_loss_scaler(accelerator, policy=...)`` right after ``Accelerator(mixed_precision="fp16")``
puts a ``LossScaler`` where Accelerate keeps its ``GradScaler`` (on the CPU Accelerate makes none
and silently trains in float32; with the scaler installed, fp16 autocast and loss scaling are
real there too). The loop is then Accelerate's own: ``accelerator.backward`` scales,
``clip_grad_norm_`` unscales first, the prepared optimizer skips a step with Inf/NaN gradients
(and the prepared scheduler waits), ``accumulate`` steps once per ``--accumulate`` batches.
``AccelerateLossScaleMonitor`` reads the scaler once every ``--log-every`` optimizer steps and
logs ``loss_scale/*`` through ``accelerator.log`` to the trackers (TensorBoard under ``runs/``
here), runs the health rules and prints a summary at the end. Registered for checkpointing, it
resumes with ``save_state``/``load_state`` like the scaler (saved halfway here; ``--resume``
continues from that checkpoint).

A simulated overflow hits every ``--inject-inf-every`` optimizer steps; the policy's growth
interval is 50, so the scale backs off and grows back.

    python examples/accelerate_loop.py --steps 200
    python examples/accelerate_loop.py --steps 200 --resume
    tensorboard --logdir runs
    lossscale-callbacks report runs/accelerate_loop
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from accelerate import Accelerator

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.accelerate import AccelerateLossScaleMonitor, install_loss_scaler


def main(argv: list[str] | None = None) -> AccelerateLossScaleMonitor:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--inject-inf-every", type=int, default=70, help="simulate an overflow this often")
    parser.add_argument("--diagnose", action="store_true", help="overflow forensics: which layer, and why")
    parser.add_argument("--out", default="runs", help="trackers' folder and checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint saved halfway")
    args = parser.parse_args(argv)

    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=args.accumulate,
                              log_with="tensorboard", project_dir=args.out)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    # Before prepare: prepare hands the scaler to the optimizer and wraps the forward in autocast.
    scaler = install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=2.0**16, growth_interval=50),
                                 diagnose=args.diagnose)
    scaler.watch(model)  # diagnose names the layers after the model's modules
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=32)
    model, optimizer, scheduler, data = accelerator.prepare(model, optimizer, scheduler, data)
    accelerator.init_trackers("accelerate_loop")
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=args.log_every)
    # No register_for_checkpointing: save_state/load_state carry the monitor's counts in their own file.

    checkpoint, step = os.path.join(args.out, "accelerate_loop_checkpoint"), 0
    if args.resume:
        accelerator.load_state(checkpoint)
        step = args.steps // 2
        data = accelerator.skip_first_batches(data, step * args.accumulate)
    batches = iter(data)
    while step < args.steps:
        for _ in range(args.accumulate):
            inputs, targets = next(batches)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if step % args.inject_inf_every == args.inject_inf_every - 1:
                        with torch.no_grad():  # a simulated overflow: this optimizer step is skipped
                            accelerator.unwrap_model(model)[0].weight.grad[0, 0] = math.inf
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # sees unscaled gradients
                optimizer.step()
                scheduler.step()  # held on skipped steps
                optimizer.zero_grad()
                snapshot = monitor.step()  # counts optimizer steps only; reads when an interval ends
        step += 1
        if snapshot is not None:
            accelerator.log({"loss": loss.item()}, step=step)
            accelerator.print(f"step {snapshot.step:5d}  loss {loss.item():.4f}  scale {snapshot.scale:g}  "
                              f"skipped {snapshot.skipped_steps}")
        if step == args.steps // 2 and not args.resume:
            accelerator.save_state(checkpoint)
    monitor.finish()
    accelerator.end_training()
    return monitor


if __name__ == "__main__":
    main()
