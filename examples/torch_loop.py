"""Plain PyTorch training with ``LossScaler``: fp16 autocast, dynamic loss scaling, metrics to a sink.

The loop is the ``torch.amp.GradScaler`` recipe with ``LossScaler`` in its place. The scaler's
state stays on the device; the loop reads it once every ``--log-every`` steps
(``scaler.get_state()``, one host sync), turns it into the metric schema with the core's
``MetricsTracker`` and writes it to a sink (in memory, or TensorBoard with ``--tensorboard DIR``).

    python examples/torch_loop.py --steps 300 --tensorboard runs/torch_loop
"""

from __future__ import annotations

import argparse
import math

import torch

from lossscale_callbacks import (
    DynamicPolicy,
    HealthMonitor,
    InMemorySink,
    MetricsTracker,
    SinkGroup,
    summarize,
)
from lossscale_callbacks.torch import LossScaler


def main(argv: list[str] | None = None) -> InMemorySink:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fused", action="store_true", help="fused AdamW: no host sync at all per step")
    parser.add_argument("--tensorboard", default=None, help="also write TensorBoard event files here")
    parser.add_argument("--inject-inf-every", type=int, default=50, help="simulate an overflow this often")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.fused)
    policy = DynamicPolicy(initial_scale=2.0**16, growth_interval=50, hysteresis=2)
    scaler = LossScaler(policy=policy, device=device)

    memory = InMemorySink()
    sinks = [memory]
    if args.tensorboard:
        from lossscale_callbacks.tensorboard import TensorBoardSink  # only when asked for

        sinks.append(TensorBoardSink(args.tensorboard, min_scale=policy.min_scale,
                                     max_scale=policy.max_scale))
    group = SinkGroup(sinks)
    tracker = MetricsTracker(policy.min_scale)
    health = HealthMonitor.from_spec("warn")

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
        if (step + 1) % args.log_every == 0:
            snapshot = tracker.observe(scaler.get_state())  # the one host read of this interval
            group.write(snapshot.step, snapshot.metrics())
            health.apply(health.observe(snapshot))
            print(f"step {snapshot.step:5d}  loss {loss.item():.4f}  scale {snapshot.scale:g}  "
                  f"skipped {snapshot.skipped_steps}")
    text = summarize(tracker.last, policy.min_scale)
    group.write_text("loss_scale/summary", text)
    group.close()
    print(text)
    return memory


if __name__ == "__main__":
    main()
