"""Ray Train on the CPU: ``TorchTrainer(num_workers=2)`` workers with our scaler, one Ray session.

Runs (each writes ``<out>/<name>.json``: ``Result.metrics``, the run folder, and what each worker
saw at the end):

* ``full``: 40 steps of fp16 autocast with ``LossScaler``, an overflow at steps 13 and 14 (both
  workers: the flag is reduced), ``RayTrainReporter`` reporting every 10 steps, a checkpoint at
  step 20 and at the end, TensorBoard in the run's folder;
* ``resumed``: the same run stopped after the step-20 checkpoint, then started again under the
  same name: ``ray.train.get_checkpoint()`` brings the model and the scaler back;
* ``skip``: the overflow flag not reduced and an Inf on worker 1 only at step 5: only it skips,
  the run must still end (every worker reports equally), and the workers' disagreement shows; an
  offline W&B run beside TensorBoard;
* ``lightning`` / ``transformers``: Ray's own ``RayTrainReportCallback`` with our Lightning monitor
  and Trainer callback: the loss-scale metrics reach ``Result.metrics``;
* ``readme``: the README's Ray Train block, as written;
* ``skip_truth``: skip truth's known answer in each worker (an Inf at 3, 17, 42 of 100, fused AdamW,
  a LambdaLR and an EMA held through ``RayTrainReporter.hold``).

Usage: python ray_runs.py OUT_DIR [NAME ...]
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import warnings

# Ray Train's controller polls its workers every 2 s and waits a poll at each change of state (start,
# each report, the end): 7 to 11 s of every tiny run here went to waiting. A tenth of it here: the runs
# are the same, the waits shorter (the full set 160 s -> about 90 s on 2 cores).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import ray  # after the interval above: the controller reads it
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

STEPS, LOG_EVERY = 40, 10


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :2].sin()


def torch_loop(config: dict) -> None:
    from lossscale_callbacks import DynamicPolicy
    from lossscale_callbacks.ray import RayTrainReporter
    from lossscale_callbacks.torch import LossScaler

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**12, growth_interval=8),
                        sync_found_inf=config["sync"], device="cpu")
    reporter = RayTrainReporter(scaler, log_every=LOG_EVERY, tensorboard=config["tensorboard"],
                                wandb=config.get("wandb"), echo=None)
    start = 0
    checkpoint = reporter.restore()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "model.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    for step in range(start, config.get("stop", STEPS)):
        x, y = _batch(step, rank)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in config["inject"] and rank in config["inject_ranks"]:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = math.inf
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        reporter.step()
        if step + 1 in config.get("checkpoints", ()):
            with tempfile.TemporaryDirectory() as folder:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                               os.path.join(folder, "model.pt"))
                reporter.report({"step": step + 1}, checkpoint_dir=folder if rank == 0 else None)
    summary = reporter.finish()
    with open(os.path.join(config["out"], f"{config['name']}_worker{rank}.json"), "w") as f:
        json.dump({"state": scaler.get_state()._asdict(), "summary": summary,
                   "params": [p.detach().flatten().tolist() for p in model.parameters()],
                   "metrics": reporter.metrics}, f)


def run_torch(out: str, name: str, storage: str, **config) -> dict:
    config = {"sync": True, "inject": (13, 14), "inject_ranks": (0, 1), "out": out, "name": name,
              "tensorboard": os.path.join(storage, name, "tensorboard"), **config}
    trainer = TorchTrainer(torch_loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name=name, storage_path=storage))
    result = trainer.fit()
    return {"metrics": result.metrics, "path": result.path,
            "checkpoint": result.checkpoint is not None}


def lightning_loop(config: dict) -> None:
    import lightning.pytorch as pl
    from ray.train.lightning import (
        RayDDPStrategy,
        RayLightningEnvironment,
        RayTrainReportCallback,
        prepare_trainer,
    )

    from lossscale_callbacks import DynamicPolicy
    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = torch.utils.data.TensorDataset(*_batch(0, 0), )
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x[:, :2].sin())
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices="auto", strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment(), LossScalePlugin(policy=DynamicPolicy(initial_scale=1024.0),
                                                            device="cpu")],
        callbacks=[LossScaleMonitor(log_every=4), RayTrainReportCallback()],
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = prepare_trainer(trainer)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))


def transformers_loop(config: dict) -> None:
    sys.path.insert(0, config["tests"])
    from hf_scripts.tiny_trainer import trainer as tiny_trainer
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    from lossscale_callbacks import DynamicPolicy
    from lossscale_callbacks.transformers import LossScaleTrainerCallback

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    trainer = tiny_trainer(config["hf_out"], max_steps=8, logging_steps=4, save_strategy="steps",
                           save_steps=8, report_to=[])
    LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=1024.0)).attach(trainer)
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    trainer.train()


def skip_loop(config: dict) -> None:
    """Skip truth's known answer in a worker: 100 steps, an Inf at 3, 17, 42 on every worker, fused or
    foreach AdamW, a LambdaLR and an EMA held through the reporter; what the worker saw, to a file."""
    sys.path.insert(0, config["tests"])
    import skip_runs as sr

    from lossscale_callbacks import DynamicPolicy
    from lossscale_callbacks.ray import RayTrainReporter
    from lossscale_callbacks.torch import LossScaler

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(sr.make_model())
    inner = getattr(model, "module", model)
    ema = sr.AveragedModel(inner, multi_avg_fn=sr.get_ema_multi_avg_fn(0.9))
    opt = sr.make_optimizer(model, config["optimizer"])
    sched = sr.SCHEDULERS["LambdaLR"](opt)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10), device="cpu")
    reporter = RayTrainReporter(scaler, log_every=25, echo=None)
    reporter.hold(sched)
    reporter.hold(ema, optimizer=opt)
    listed, read = [], reporter.reader.read

    def reading(*args, **kwargs):
        state = read(*args, **kwargs)
        if getattr(state, "outcomes", None) is not None:
            listed.extend([o.step, o.cause] for o in state.outcomes.outcomes)
        return state

    reporter.reader.read = reading
    lrs = []
    for step in range(1, sr.STEPS + 1):
        opt.zero_grad()
        scaler.scale(model(sr.batch(step)).pow(2).mean()).backward()
        if step in sr.INJECTED:
            inner[0].weight.grad[0, 0] = math.inf
        else:
            lrs.append(float(opt.param_groups[0]["lr"]))
        scaler.step(opt)
        scaler.update()
        sched.step()
        ema.update_parameters(inner)
        reporter.step()
    reporter.finish()
    with open(os.path.join(config["out"], f"skip_truth_worker{rank}.json"), "w") as f:
        json.dump({"lrs": lrs, "last_epoch": sched.last_epoch, "n_averaged": int(ema.n_averaged),
                   "listed": listed, "metrics": reporter.metrics,
                   "verdicts": [v.rule for v in reporter.loop.verdicts]}, f)


def run_callback(loop, name: str, storage: str, **config) -> dict:
    trainer = TorchTrainer(loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name=name, storage_path=storage))
    result = trainer.fit()
    return {"metrics": result.metrics, "path": result.path}


def run_readme() -> dict:
    """The README's Ray Train block, as written."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = readme.split("## Many machines: ranks that agree, Ray Train, the fp16 RL recipe\n", 1)[1]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md", "exec"), namespace)
    return {"metrics": namespace["result"].metrics}


def main(out: str, names: list[str]) -> None:
    storage = os.path.join(out, "ray_storage")
    ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
             runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
                                       "HF_HUB_OFFLINE": "1"}})
    runs = {
        "full": lambda: run_torch(out, "full", storage, checkpoints=(20, STEPS)),
        "resumed": lambda: {
            "first": run_torch(out, "resumed", storage, stop=20, checkpoints=(20,)),
            "second": run_torch(out, "resumed", storage, checkpoints=(20, STEPS))},
        "skip": lambda: run_torch(out, "skip", storage, sync=False, inject=(5,), inject_ranks=(1,), stop=20,
                                  checkpoints=(20,), wandb={"mode": "offline", "project": "ray",
                                                            "dir": os.path.join(storage, "skip")}),
        "lightning": lambda: run_callback(lightning_loop, "lightning", storage),
        "transformers": lambda: run_callback(
            transformers_loop, "transformers", storage, tests=os.path.dirname(os.path.dirname(__file__)),
            hf_out=os.path.join(out, "hf")),
        "readme": run_readme,
        "skip_truth": lambda: run_callback(
            skip_loop, "skip_truth", storage, tests=os.path.dirname(os.path.dirname(__file__)), out=out,
            optimizer="fused"),
    }
    for name in names or list(runs):
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(runs[name](), f, default=str)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
