"""DDP on 2 CPU processes (gloo) with an Inf injected after the gradient all-reduce on rank 1 only.

Run by ``tests/test_lightning_ddp.py`` as a subprocess (Lightning re-launches this script for
rank 1). Two fits run in sequence in the same process group:

* ``synced``: ``LossScalePlugin(sync_found_inf=True)``: the overflow flag is all-reduced (MAX), so
  both ranks must skip the injected step and end with the same scale and weights;
* ``unsynced``: ``sync_found_inf=False``: the control, where only rank 1 skips and the ranks drift.

Each rank writes ``<out>/<mode>_rank<r>.json``.

Usage: python ddp_skip.py OUT_DIR [--steps 6] [--inject-step 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning_scripts import tiny  # noqa: E402

from lossscale_callbacks import DynamicPolicy  # noqa: E402
from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin  # noqa: E402


class CountingLogger(pl.loggers.Logger):
    """Not rank-zero guarded on purpose: counts what reaches it on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_scale_calls = 0

    @property
    def name(self) -> str:
        return "counting"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        if any(k.startswith("loss_scale/") for k in metrics):
            self.loss_scale_calls += 1


def run(mode: str, out: str, steps: int, inject_step: int) -> None:
    plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=100),
                             sync_found_inf=mode == "synced")
    logger = CountingLogger()
    model = tiny.module_class(pl)(inject_inf_at=(inject_step,), inject_rank=1)
    trainer = pl.Trainer(
        plugins=[plugin], callbacks=[LossScaleMonitor(log_every=1)],
        **tiny.trainer_kwargs(strategy="ddp", devices=2, max_steps=steps, logger=[logger]),
    )
    trainer.fit(model, tiny.data(n=8 * 2 * steps))
    state = plugin.scaler.get_state()
    result = {
        "rank": trainer.global_rank,
        "state": state._asdict(),
        "skipped_steps": [s for s, before, after in model.steps if tiny.same_bits(before, after)],
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        "loss_scale_log_calls": logger.loss_scale_calls,
    }
    with open(os.path.join(out, f"{mode}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--inject-step", type=int, default=3)
    args = parser.parse_args()
    for mode in ("synced", "unsynced"):
        run(mode, args.out, args.steps, args.inject_step)
    tiny.exit_cleanly()


if __name__ == "__main__":
    main()
