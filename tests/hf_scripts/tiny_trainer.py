"""A tiny Transformers ``Trainer`` run for the tests: a 2-layer GPT-2 built from a config (no download).

``InjectOverflow`` puts an Inf into one gradient during the backward pass of the given optimizer
steps (``global_step`` before the step, so 0-based; skipped steps included), before the Trainer
unscales and clips, so the scaler sees an overflow exactly there.
"""

from __future__ import annotations

import math
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()  # the tiny config's token ids, the default loss type: not our business


class InjectOverflow(TrainerCallback):
    """Makes the gradient of the model's first parameter Inf at the given optimizer steps."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = set(steps)
        self.current = -1
        self.handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        param = next(model.parameters())
        self.handle = param.register_hook(self._hook)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.current = state.global_step

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.current in self.steps:
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.handle.remove()


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def dataset(n: int = 64, length: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(out: str, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = dict(
        output_dir=out, fp16=True, use_cpu=True, max_steps=12, per_device_train_batch_size=4,
        logging_steps=4, report_to=["tensorboard"],
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def trainer(out: str, inject_at: tuple[int, ...] = (), **overrides: Any) -> Trainer:
    return Trainer(model=model(), args=arguments(out, **overrides), train_dataset=dataset(),
                   callbacks=[InjectOverflow(inject_at)])
