"""Two CPU processes under Accelerate's launcher (gloo): the same skips and scales on both ranks, one writer.

Run by ``tests/test_accelerate_ddp.py`` as
``python -m accelerate.commands.launch --multi_gpu --num_processes 2 ... accelerate_ddp.py OUT``
(``--multi_gpu`` is Accelerate's torchrun launcher; ``Accelerator(cpu=True)`` makes it gloo on the
CPU). An overflow is injected on rank 1 only, before DDP's gradient all-reduce, which carries it to
rank 0. Three runs in sequence, in the same process group:

* ``ours`` and ``stock``: the Accelerate loop of ``tiny_accelerate`` with our scaler or torch's
  ``GradScaler`` installed, the monitor writing to the TensorBoard tracker and to a
  ``TensorBoardSink``;
* ``trainer``: a Transformers ``Trainer`` with ``LossScaleTrainerCallback`` installing our scaler and
  ``report_to=["tensorboard"]``.

Each rank writes ``OUT/<run>_rank<r>.json``.

Usage: python accelerate_ddp.py OUT [--steps 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from hf_scripts import tiny_accelerate as tiny  # noqa: E402
from hf_scripts import tiny_trainer  # noqa: E402
from lightning_scripts.tiny import exit_cleanly  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks.transformers._callback import LossScaleTrainerCallback  # noqa: E402

INJECT = (2, 5)


class InjectOnRankOne(tiny_trainer.InjectOverflow):
    """Only rank 1's gradient overflows; DDP's all-reduce brings the Inf to rank 0."""

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        return super()._hook(grad) if torch.distributed.get_rank() == 1 else grad


def accelerate_run(kind: str, out: str, steps: int) -> dict:
    setup = tiny.Setup(scaler=kind, steps=steps, log_every=2, inject_at=(),
                       monitor_kwargs={"tensorboard": os.path.join(out, kind, "sink")})
    accelerator = tiny.make_accelerator(setup, log_with="tensorboard", project_dir=os.path.join(out, kind))
    accelerator.init_trackers("tracker")
    model, optimizer, scheduler, data = accelerator.prepare(*tiny.model_and_data())
    from lossscale_callbacks.accelerate._monitor import AccelerateLossScaleMonitor

    monitor = AccelerateLossScaleMonitor(accelerator, log_every=2, **setup.monitor_kwargs)
    scales, skipped = [], []
    for step, (x, y) in zip(range(steps), data, strict=False):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step in INJECT and accelerator.process_index == 1:
            loss = loss * math.inf  # before backward: the all-reduce carries it to every rank
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        monitor.step()
        scales.append(accelerator.scaler.get_scale())
        skipped.append(accelerator.optimizer_step_was_skipped)
    monitor.finish()
    for tracker in accelerator.trackers:  # not end_training(): it would end the process group too
        tracker.finish()
    return {"scales": scales, "skipped": [i for i, s in enumerate(skipped) if s],
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
            "summary": monitor.summary, "writer": monitor.loop.writer,
            "last": dataclasses.asdict(monitor.loop.last)}


def trainer_run(out: str, steps: int) -> dict:
    trainer = tiny_trainer.trainer(os.path.join(out, "trainer"), max_steps=steps, logging_steps=2)
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if not isinstance(c, tiny_trainer.InjectOverflow)]
    trainer.add_callback(InjectOnRankOne(INJECT))
    callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=1024.0, growth_interval=3))
    callback.attach(trainer)
    trainer.train()
    state = trainer.accelerator.scaler.get_state()
    return {"state": state._asdict(), "summary": callback.summary, "writer": callback.loop.writer,
            "weights": [p.detach().flatten()[:64].tolist() for p in trainer.model.parameters()][:4]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    results = {kind: accelerate_run(kind, args.out, args.steps) for kind in ("ours", "stock")}
    results["trainer"] = trainer_run(args.out, args.steps)
    rank = torch.distributed.get_rank()
    for name, result in results.items():
        with open(os.path.join(args.out, f"{name}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
    exit_cleanly()


if __name__ == "__main__":
    main()
