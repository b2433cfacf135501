"""A Transformers ``Trainer`` with the loss scale in the logs that its ``report_to`` integrations receive.

``LossScaleTrainerCallback(...).attach(trainer)`` adds ``loss_scale/*`` (the scale, skipped steps,
skip rate, growth counter, optimizer steps attempted) to the logs of every logging step, where the
Trainer's ``report_to`` integrations and the progress printout pick them up, and prints a summary
with a health verdict at the end. With ``policy=`` it also installs our ``LossScaler`` in the
Trainer's Accelerator, which makes ``fp16=True`` real on the CPU as well (Accelerate alone trains
float32 there); without it, on a GPU, the callback reads the ``GradScaler`` that Accelerate made.
``--diagnose`` adds overflow forensics: which layer overflowed, and why.

The model is a 2-layer GPT-2 built from a config (nothing is downloaded), trained on random tokens;
a simulated overflow hits every ``--inject-inf-every`` optimizer steps.

    python examples/transformers_trainer.py --steps 200
    tensorboard --logdir runs/transformers_trainer/runs
    lossscale-callbacks report runs/transformers_trainer/runs
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from lossscale_callbacks import DynamicPolicy
from lossscale_callbacks.transformers import LossScaleTrainerCallback


class SimulatedOverflow(TrainerCallback):
    """Makes the token embedding's gradient Inf every ``every`` optimizer steps (a stand-in for a real
    fp16 overflow), before the Trainer unscales and clips."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.overflow = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.get_input_embeddings().weight.register_hook(self._hook)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.overflow = bool(self.every) and state.global_step % self.every == self.every - 1

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.inf) if self.overflow else grad


def main(argv: list[str] | None = None) -> LossScaleTrainerCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--log-every", type=int, default=10, help="the Trainer's logging_steps")
    parser.add_argument("--inject-inf-every", type=int, default=70, help="simulate an overflow this often")
    parser.add_argument("--diagnose", action="store_true", help="overflow forensics: which layer, and why")
    parser.add_argument("--out", default=os.path.join("runs", "transformers_trainer"))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 64, (1024, 16), generator=torch.Generator().manual_seed(0))
    train = [{"input_ids": row, "labels": row} for row in tokens]
    training_args = TrainingArguments(
        output_dir=args.out, fp16=True, use_cpu=not torch.cuda.is_available(), max_steps=args.steps,
        per_device_train_batch_size=8, logging_steps=args.log_every, report_to=["tensorboard"],
        save_strategy="no", disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train,
                      callbacks=[SimulatedOverflow(args.inject_inf_every)])
    callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=2.0**16, growth_interval=50),
                                        diagnose=args.diagnose)
    callback.attach(trainer)  # before train(): it installs the scaler and goes ahead of report_to's loggers
    trainer.train()
    return callback


if __name__ == "__main__":
    main()
