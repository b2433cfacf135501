"""The precision advisor's words end to end on torch: real tiny runs on CPU float16 autocast, read back
from the real files (TensorBoard event files, the W&B offline run, ``lossscale-callbacks report``), plain
torch, and the producer named through Lightning, Fabric, Accelerate and the Transformers Trainer. About
90 s on the shared machine (marked slow)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from advisor_models import MODELS, batches  # noqa: E402

from lossscale_callbacks import LoggingLoop  # noqa: E402
from lossscale_callbacks.health import StuckAtMinScale  # noqa: E402
from lossscale_callbacks.metrics import ACTIVATIONS_TAG, ADVICE_TAG, SUMMARY_TAG  # noqa: E402
from lossscale_callbacks.policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks.torch import LossScaler  # noqa: E402

pytestmark = pytest.mark.slow
F = torch.nn.functional
KEEP_WO = "Keep these layers in float32: `ff.wo`"


def _report(path) -> str:
    proc = subprocess.run([sys.executable, "-m", "lossscale_callbacks.cli", "report", str(path)],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _run(tmp_path, name, steps=12, nan_grads_in=None, initial_scale=4.0):
    from lossscale_callbacks.tensorboard import TensorBoardSink
    from lossscale_callbacks.wandb import WandbSink

    torch.manual_seed(0)
    model = MODELS[name]()
    if nan_grads_in is not None:  # an Inf - Inf in this layer's backward, with a finite loss
        model.get_submodule(nan_grads_in).weight.register_hook(lambda g: g * math.nan)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = LossScaler("cpu", policy=DynamicPolicy(initial_scale=initial_scale), diagnose=True).watch(model)
    sinks = [TensorBoardSink(str(tmp_path / "tb")),
             WandbSink(project="advisor", dir=str(tmp_path / "wb"), mode="offline")]
    loop = LoggingLoop(scaler.policy, sinks=sinks, log_every=4, echo=None,
                       health=[StuckAtMinScale(limit=4)])
    with pytest.warns(UserWarning) as warned:
        for step, (x, y) in enumerate(batches(name, steps), 1):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            loop.maybe_observe(step, scaler.get_state, read_forensics=scaler.read_forensics)
        summary = loop.finish(scaler.get_state())
    loop.close()
    return [str(w.message) for w in warned], summary


def _texts(tmp_path) -> tuple[dict[str, str], dict[str, list]]:
    from lossscale_callbacks.tensorboard.reader import read_texts
    from lossscale_callbacks.wandb.reader import read_tables, wait_until_finished

    tensorboard = {tag: text for tag, _, text in read_texts(str(tmp_path / "tb"))}  # the last of each
    wait_until_finished(str(tmp_path / "wb"))
    tables = {tag: rows for tag, _, _, rows in read_tables(str(tmp_path / "wb"))}
    return tensorboard, tables


def test_forward_overflow_and_collapse_words_in_every_place(tmp_path):
    """T5's ``wo`` overflows from the first step: a non-finite loss, the scale falls to its minimum."""
    warned, summary = _run(tmp_path, "t5")
    assert any("The loss itself was non-finite" in w for w in warned)
    assert any("Layer `ff.wo` produced the first non-finite activation" in w for w in warned)
    collapse = next(w for w in warned if "has been at its minimum" in w)
    assert "mostly a forward overflow (a non-finite loss)" in collapse and KEEP_WO in collapse
    assert "Precision advice:" in summary and KEEP_WO in summary
    tensorboard, tables = _texts(tmp_path)
    assert KEEP_WO in tensorboard[ADVICE_TAG] and KEEP_WO in tensorboard[SUMMARY_TAG]
    assert "| `ff.wo` |" in tensorboard[ACTIVATIONS_TAG]
    assert any(KEEP_WO in str(row) for row in tables[ADVICE_TAG])
    assert any("`ff.wo`" in str(row) for row in tables[ACTIVATIONS_TAG])
    for path in (tmp_path / "tb", tmp_path / "wb"):
        report = _report(path)
        assert "Layer `ff.wo` produced a non-finite activation from finite inputs" in report
        assert f"Advice: {KEEP_WO}" in report


def test_recurring_nan_gradients_with_a_finite_loss(tmp_path):
    warned, summary = _run(tmp_path, "fits", steps=8, nan_grads_in="inp", initial_scale=2.0**10)
    assert any("NaN gradients with a finite loss recurred" in w for w in warned)
    assert "Keep these layers in float32: `inp`" in summary
    tensorboard, tables = _texts(tmp_path)
    assert "Keep these layers in float32: `inp`" in tensorboard[ADVICE_TAG]
    assert any("`inp`" in str(row) for row in tables[ADVICE_TAG])
    assert "Advice: Keep these layers in float32: `inp`" in _report(tmp_path / "tb")


def test_a_model_that_fits_says_nothing(tmp_path):
    from lossscale_callbacks.tensorboard import TensorBoardSink

    torch.manual_seed(0)
    model = MODELS["fits"]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = LossScaler("cpu", diagnose=True, headroom_every=2).watch(model)
    loop = LoggingLoop(scaler.policy, sinks=[TensorBoardSink(str(tmp_path / "tb"))], log_every=4, echo=None)
    for step, (x, y) in enumerate(batches("fits", 8), 1):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        loop.maybe_observe(step, scaler.get_state, read_forensics=scaler.read_forensics)
    summary = loop.finish(scaler.get_state())
    loop.close()
    from lossscale_callbacks.tensorboard.reader import read_run, read_texts

    assert "Precision advice" not in summary and not loop.verdicts
    assert ADVICE_TAG not in {tag for tag, _, _ in read_texts(str(tmp_path / "tb"))}
    series = read_run(str(tmp_path / "tb"))
    assert len(series["loss_scale/activation_headroom/inp"]) == 2  # a point per interval, from the files
    assert "Advice:" not in _report(tmp_path / "tb")


def test_lightning_names_the_producer(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin
    from lossscale_callbacks.tensorboard.reader import read_texts

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = MODELS["t5"]()

        def training_step(self, batch, _):
            x, y = batch
            return F.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    monitor = LossScaleMonitor(log_every=4, diagnose=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=8, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=4.0))],
                         callbacks=[monitor])
    x, y = (torch.cat(t) for t in zip(*batches("t5", 2), strict=True))
    with pytest.warns(UserWarning, match="Layer `net.ff.wo` produced"):
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    assert "Keep these layers in float32: `net.ff.wo`" in monitor.summary
    texts = {tag: text for tag, _, text in read_texts(logger.log_dir)}  # Lightning's tags: "/text_summary"
    assert "Keep these layers in float32: `net.ff.wo`" in texts[ADVICE_TAG + "/text_summary"]


def test_accelerate_names_the_producer():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from hf_scripts import tiny_accelerate

    from lossscale_callbacks import InMemorySink
    from lossscale_callbacks.accelerate import AccelerateLossScaleMonitor, install_loss_scaler

    tiny_accelerate.reset_accelerate()
    try:
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)  # our installer: real fp16 on the CPU
        torch.manual_seed(0)
        model = MODELS["t5"]()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=4.0), diagnose=True).watch(model)
        model, optimizer = accelerator.prepare(model, optimizer)
        memory = InMemorySink()
        monitor = AccelerateLossScaleMonitor(accelerator, log_every=4, sinks=[memory], trackers=False,
                                             echo=None)
        with pytest.warns(UserWarning, match="Layer `ff.wo` produced"):
            for x, y in batches("t5", 8):
                accelerator.backward(F.mse_loss(model(x).float(), y))
                optimizer.step()
                optimizer.zero_grad()
                monitor.step()
        assert KEEP_WO in monitor.finish()
        assert memory.series("loss_scale/activation_producer/ff.wo")
    finally:
        tiny_accelerate.reset_accelerate()


def test_transformers_trainer_names_the_producer(tmp_path):
    pytest.importorskip("transformers")
    from hf_scripts import tiny_accelerate
    from hf_scripts import tiny_trainer as tiny

    from lossscale_callbacks.transformers import LossScaleTrainerCallback

    tiny_accelerate.reset_accelerate()
    try:
        trainer = tiny.trainer(str(tmp_path), max_steps=8, logging_steps=4, report_to=[])
        with torch.no_grad():  # a GPT-2 MLP projection whose outputs exceed float16's range
            trainer.model.transformer.h[1].mlp.c_proj.weight.mul_(1e8)
        callback = LossScaleTrainerCallback(policy=DynamicPolicy(initial_scale=4.0), diagnose=True,
                                            echo=None).attach(trainer)
        with pytest.warns(UserWarning, match="Layer `transformer.h.1.mlp.c_proj` produced"):
            trainer.train()
        assert "Keep these layers in float32: `transformer.h.1.mlp.c_proj`" in callback.summary
    finally:
        tiny_accelerate.reset_accelerate()


def test_fabric_names_the_producer(tmp_path):
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    from lossscale_callbacks import InMemorySink
    from lossscale_callbacks.lightning.fabric import FabricLossScaleMonitor, LossScaleFabricPlugin

    torch.manual_seed(0)
    model = MODELS["t5"]()
    scaler = LossScaler("cpu", policy=DynamicPolicy(initial_scale=4.0), diagnose=True).watch(model)
    plugin = LossScaleFabricPlugin(device="cpu", scaler=scaler)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    memory = InMemorySink()
    monitor = FabricLossScaleMonitor(fabric, log_every=4, sinks=[memory])
    with pytest.warns(UserWarning, match="Layer `ff.wo` produced"):
        for x, y in batches("t5", 8):
            optimizer.zero_grad()
            fabric.backward(F.mse_loss(model(x).float(), y))
            optimizer.step()
            monitor.step()
    assert memory.series("loss_scale/activation_producer/ff.wo")
