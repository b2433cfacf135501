"""Overflow forensics: the cause of each skip, the layer that overflowed, the float16 headroom.

Each end-to-end test injects an Inf into one named layer's gradient (and, separately, a NaN into the
loss) at known steps, in a plain torch loop, a Lightning run and Keras ``fit``, and checks that the
summary, the sinks (read back from the TensorBoard files) and ``lossscale-callbacks report`` name that
layer and that cause, and no other. Headroom, underflow and the histogram are checked against NumPy.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop
from lossscale_callbacks.forensics._gradients import (
    FORENSICS_TAG,
    HISTOGRAM_TAG,
    ForensicsTotals,
    IntervalForensics,
    LayerHeadroom,
    check_diagnose,
)
from lossscale_callbacks.forensics._words import FP16_MAX_LOG2, findings
from lossscale_callbacks.testing import reference_headroom, reference_histogram

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INF_STEPS = (3, 7)  # an Inf in the named layer's gradient
NAN_LOSS_STEP = 5  # a NaN loss


# --------------------------------------------------------------------------------- the core


def test_sentences_name_the_layer_the_cause_and_the_headroom():
    interval = IntervalForensics(
        step=40, scale=2.0**15, causes={"grad_inf": 18, "loss_nonfinite": 7},
        layer_skips={"encoder.0": 18, "decoder.5.attn": 18}, layer_origins={"decoder.5.attn": 18},
        layer_order=("encoder.0", "decoder.5.attn", "head"),
        headroom=(LayerHeadroom("decoder.5.attn", 32752.0, 0, 100),), headroom_scale=2.0**15)
    words = interval.sentences()
    assert words[0] == ("The loss itself was non-finite (Inf/NaN) in 7 steps: loss scaling cannot fix this, "
                        "look at the forward pass.")
    assert words[1].startswith("18 skipped steps had Inf gradients with a finite loss: the scale was too")
    # the origin, not the layer flagged most often (both were flagged in all 18 steps)
    assert words[2].startswith("The overflow started in layer `decoder.5.attn` in all 18 skipped steps with "
                               "non-finite gradients")
    assert words[3] == ("Largest scaled gradient at the last headroom sample: 2^15.0 (float16's max is "
                        "2^15.99), 2.0\u00d7 below it.")
    metrics = interval.metrics()
    assert metrics["loss_scale/skips/grad_inf"] == 18 and metrics["loss_scale/skips/grad_nan"] == 0
    assert metrics["loss_scale/layer_skips/decoder.5.attn"] == 18
    assert metrics["loss_scale/layer_origins/decoder.5.attn"] == 18 and len(metrics) == 4 + 2 + 1 + 1
    assert metrics["loss_scale/min_log2_headroom"] == pytest.approx(1.0, abs=1e-3)


def test_the_origin_counts_and_the_other_layers_come_as_a_table_in_that_order():
    # The demo's case: `dense` flagged in all 13 skipped steps, `dense_1` (nearer the loss) in 3.
    interval = IntervalForensics(step=64, scale=2.0**7, causes={"grad_inf": 13},
                                 layer_skips={"dense": 13, "dense_1": 3},
                                 layer_origins={"dense": 10, "dense_1": 3}, layer_order=("dense", "dense_1"),
                                 headroom=(LayerHeadroom("dense", 2.0**16.9, 0, 8),
                                           LayerHeadroom("dense_1", 2.0**10, 0, 8)), headroom_scale=2.0**7)
    markdown = interval.to_markdown()
    cause = markdown.index("13 skipped steps had Inf gradients")
    origin = markdown.index("The overflow started in layer `dense` in 10 of the 13 skipped steps with "
                            "non-finite gradients, in `dense_1` in 3")
    table = markdown.index("| layer | overflow started here | non-finite gradients |")
    headroom = markdown.index("Largest scaled gradient at the last headroom sample: 2^16.9 (float16's max is "
                              "2^15.99), 1.9\u00d7 above it.")
    assert cause < origin < table < headroom
    assert "| `dense` | 10 of 13 | 13 of 13 |\n| `dense_1` | 3 of 13 | 3 of 13 |" in markdown
    # each layer's own headroom as a factor, never as a negative power "below"
    assert "| `dense` | 2^16.9 | 1.9\u00d7 above | 0.00% |" in markdown
    assert "| `dense_1` | 2^10.0 | 64\u00d7 below | 0.00% |" in markdown


@given(st.floats(min_value=-60.0, max_value=60.0))
def test_headroom_is_a_factor_below_or_above_never_a_negative_below(largest):
    words = findings({"grad_inf": 1}, {}, {}, largest_log2=largest).headroom
    factor, direction = re.search(r"\), ([\d.,e+]+)\u00d7 (below|above) it\.$", words).groups() \
        if "at it" not in words else ("1", "at")
    assert float(factor.replace(",", "")) >= 1.0
    assert direction == ("below" if largest < FP16_MAX_LOG2 - 0.005 else "above"
                         if largest > FP16_MAX_LOG2 + 0.005 else "at")
    assert not re.search(r"2\^-[\d.]+ below", words)


def test_totals_add_intervals_and_nothing_is_said_about_a_clean_run():
    totals = ForensicsTotals()
    assert totals.sentences() == [] and totals.findings().markdown() == ""
    totals.add(IntervalForensics(step=10, scale=1.0, causes={"grad_nan": 1}, layer_skips={"fc": 1},
                                 layer_origins={"fc": 1}))
    totals.add(IntervalForensics(step=20, scale=1.0, causes={"grad_nan": 2}, layer_skips={"fc": 2},
                                 layer_origins={"fc": 2}))
    assert totals.causes["grad_nan"] == 3
    assert totals.layer_skips == {"fc": 3} and totals.layer_origins == {"fc": 3}
    assert any("3 skipped steps had NaN gradients" in s for s in totals.sentences())


def test_a_layer_series_has_a_point_at_every_interval_from_one_before_its_first_count():
    totals = ForensicsTotals()
    steps = [(8, {}), (16, {"dense_1": 3}), (24, {}), (32, {"dense": 1})]
    written = []
    for step, counts in steps:
        interval = IntervalForensics(step=step, scale=1.0, causes={"grad_inf": sum(counts.values())},
                                     layer_skips=counts, layer_origins=counts)
        first, metrics = totals.series(interval)
        written.append((first, {k: v for k, v in metrics.items() if "layer_" in k}))
        totals.add(interval)
    assert written[0] == ({}, {})
    assert written[1] == ({"loss_scale/layer_skips/dense_1": 0, "loss_scale/layer_origins/dense_1": 0},
                          {"loss_scale/layer_skips/dense_1": 3, "loss_scale/layer_origins/dense_1": 3})
    assert written[2] == ({}, {"loss_scale/layer_skips/dense_1": 0, "loss_scale/layer_origins/dense_1": 0})
    assert written[3][0] == {"loss_scale/layer_skips/dense": 0, "loss_scale/layer_origins/dense": 0}
    assert written[3][1]["loss_scale/layer_skips/dense"] == 1
    assert written[3][1]["loss_scale/layer_skips/dense_1"] == 0


def test_tensorboard_gets_no_single_point_layer_series_and_the_report_says_the_summary_words(tmp_path):
    """Issue 23: a layer flagged in one interval only was a one-point series, an empty TensorBoard chart."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lossscale_callbacks.forensics._gradients import totals_from_series
    from lossscale_callbacks.tensorboard._reader import read_run

    loop = LoggingLoop(DynamicPolicy(initial_scale=2.0**10), tensorboard=str(tmp_path / "tb"), log_every=8,
                       echo=None, health=None)
    loop.baseline({"scale": 1024.0, "growth_counter": 0, "hysteresis_left": 1, "skipped_steps": 0,
                   "steps": 0})
    skipped = 0
    for step, counts in ((8, {}), (16, {}), (24, {"dense_1": 3, "dense": 3})):
        skipped += sum(counts.values()) // 2
        room = (LayerHeadroom("dense", 2.0**13, 0, 8),) if step == 8 else ()
        interval = IntervalForensics(step=step, scale=1024.0, causes={"grad_inf": sum(counts.values()) // 2},
                                     layer_skips=counts, layer_origins={"dense_1": 3} if counts else {},
                                     layer_order=("dense", "dense_1"), headroom=room,
                                     headroom_scale=1024.0 if room else None)
        loop.observe({"scale": 1024.0, "growth_counter": 0, "hysteresis_left": 1, "skipped_steps": skipped,
                      "steps": step}, forensics=interval)
    summary = loop.finish()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()["tensors"] + acc.Tags()["scalars"]
    layer_tags = sorted(t for t in tags if "/layer_" in t)
    assert layer_tags == ["loss_scale/layer_origins/dense_1", "loss_scale/layer_skips/dense",
                          "loss_scale/layer_skips/dense_1"]
    for tag in layer_tags:  # two points: a 0 one interval back, then the count
        points = [(e.step, e.tensor_proto.float_val[0] if e.tensor_proto.float_val else e.value)
                  for e in (acc.Tensors(tag) if tag in acc.Tags()["tensors"] else acc.Scalars(tag))]
        assert points == [(16, 0.0), (24, 3.0)], (tag, points)
    series = read_run(str(tmp_path / "tb"))
    words = totals_from_series(series).findings().markdown()
    assert words and words in summary  # the report's words are the summary's
    assert "The overflow started in layer `dense_1` in all 3 skipped steps" in words


@pytest.mark.parametrize("bad", ["yes", 1, None, "every", 1.0, 0.0, np.bool_(True), np.bool_(False)])
def test_diagnose_is_checked(bad):
    with pytest.raises(ValueError, match="diagnose must be one of"):
        check_diagnose(bad)
    with pytest.raises(ValueError, match="causes"):
        IntervalForensics(step=1, scale=1.0, causes={"overflow": 1})


def log2_headroom(room) -> float:
    """``log2(65504 / max |scaled gradient|)``: how many doublings of the scale still fit (``inf`` for
    all-zero gradients, ``nan`` for non-finite ones; negative when the largest is above float16's max)."""
    if not math.isfinite(room.max_abs_scaled):
        return math.nan
    if room.max_abs_scaled == 0:
        return math.inf
    return math.log2(65504.0 / room.max_abs_scaled)


def test_reference_headroom_and_histogram_by_hand():
    (room,) = reference_headroom({"fc": np.array([0.5, -2.0, 0.0, 2.0**-30])}, 2.0**4)
    assert room.max_abs_scaled == 32.0 and log2_headroom(room) == pytest.approx(math.log2(65504 / 32))
    assert (room.underflow, room.total) == (1, 4)  # 2^-30 * 2^4 = 2^-26 < 2^-24; zero is not counted
    counts = reference_histogram([np.array([1.0, 1.5, 2.0, 2.0**-50])], 1.0)
    edges = list(range(-40, 21))
    assert counts[edges.index(0)] == 2 and counts[edges.index(1)] == 1 and counts[0] == 1


def test_logging_loop_writes_the_report_histogram_and_verdict_words():
    memory = InMemorySink()
    loop = LoggingLoop(DynamicPolicy(initial_scale=1024.0), sinks=[memory], echo=None, health="warn")
    interval = IntervalForensics(step=10, scale=512.0, causes={"loss_nonfinite": 1}, layer_order=("fc",),
                                 histogram=(0,) * 60, headroom=(LayerHeadroom("fc", 1.0, 0, 4),),
                                 headroom_scale=512.0)
    with pytest.warns(UserWarning, match="NonFiniteLoss|loss itself"):
        loop.observe({"scale": 512.0, "growth_counter": 0, "hysteresis_left": 1, "skipped_steps": 1,
                      "steps": 10}, forensics=interval)
    assert memory.series("loss_scale/skips/loss_nonfinite") == [(10, 1.0)]
    assert [tag for tag, _ in memory.texts if tag == FORENSICS_TAG]
    assert memory.histograms[0][:2] == (10, HISTOGRAM_TAG)
    summary = loop.finish()
    assert "Forensics:\n- The loss itself was non-finite (Inf/NaN) in 1 step" in summary


# ------------------------------------------------------------------------------ plain torch


def _torch_model():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU())
            self.decoder = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                               torch.nn.Linear(32, 1))

        def forward(self, x):
            return self.decoder(self.encoder(x))

    return Net()


def _torch_run(tmp_path, fused: bool, steps: int = 10, diagnose=True, wandb: bool = False):
    import torch

    from lossscale_callbacks.tensorboard import TensorBoardSink
    from lossscale_callbacks.torch import LossScaler
    from lossscale_callbacks.wandb import WandbSink

    model = _torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=1000), diagnose=diagnose,
                        headroom_every=4).watch(model)
    memory = InMemorySink()
    sinks = [memory, TensorBoardSink(str(tmp_path / "tb"))]
    if wandb:
        sinks.append(WandbSink(project="forensics", dir=str(tmp_path / "wb"), mode="offline"))
    loop = LoggingLoop(scaler.policy, sinks=sinks, log_every=5, echo=None, health=None)
    x = torch.randn(64, 8)
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), x[:, :1])
        if step == NAN_LOSS_STEP:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        if step in INF_STEPS:
            model.decoder[0].weight.grad[1, 2] = math.inf
        scaler.step(opt)
        scaler.update()
        loop.maybe_observe(step + 1, scaler.get_state, read_forensics=scaler.read_forensics)
    summary = loop.finish(scaler.get_state())
    loop.close()
    return scaler, memory, summary


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_torch_loop_names_the_layer_and_the_causes(tmp_path, fused):
    _, memory, summary = _torch_run(tmp_path, fused, wandb=not fused)
    causes = {c: sum(v for _, v in memory.series(f"loss_scale/skips/{c}"))
              for c in ("loss_nonfinite", "grad_inf", "grad_nan", "grad_nonfinite")}
    # Fused or not: the per-layer max-norms, NaN-propagating, tell Inf from NaN on the device.
    assert causes == {"loss_nonfinite": 1, "grad_inf": 2, "grad_nan": 0, "grad_nonfinite": 0}
    layer_series = {tag for _, metrics in memory.records for tag in metrics if "layer_skips" in tag}
    assert layer_series == {"loss_scale/layer_skips/decoder.0"}  # that layer, and no other
    assert "| `decoder.0` | 2 of 2 |" in summary  # the flagged layers' table
    assert "The loss itself was non-finite (Inf/NaN) in 1 step" in summary
    report = _report(tmp_path / "tb")
    assert "Layers with non-finite gradients in skipped steps: `decoder.0` (2)" in report
    assert "1 non-finite loss" in report
    if not fused:  # W&B: the same series, and the interval's report as a Table
        from lossscale_callbacks.wandb._reader import read_run, read_tables, wait_until_finished

        wait_until_finished(str(tmp_path / "wb"))
        series = read_run(str(tmp_path / "wb"))
        assert [k for k in series if "layer_skips" in k] == ["loss_scale/layer_skips/decoder.0"]
        assert sum(v for _, v in series["loss_scale/skips/loss_nonfinite"]) == 1
        assert sum(v for _, v in series["loss_scale/skips/grad_inf"]) == 2
        tables = {tag: rows for tag, _, _, rows in read_tables(str(tmp_path / "wb"))}
        assert any("`decoder.0`" in row[1] for row in tables[FORENSICS_TAG])


def _report(path) -> str:
    proc = subprocess.run([sys.executable, "-m", "lossscale_callbacks._cli", "report", str(path)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_torch_headroom_and_histogram_match_numpy():
    torch = pytest.importorskip("torch")
    from lossscale_callbacks.torch import LossScaler

    model = _torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**6), diagnose="every_step").watch(model)
    x = torch.randn(16, 8)
    # a loss so small that part of its gradients underflow float16 at this scale
    scaler.scale(model(x).pow(2).mean() * 1e-8).backward()
    scaled = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    scaler.step(opt)
    scaler.update()
    forensics = scaler.read_forensics()
    by_layer: dict[str, list[np.ndarray]] = {}
    for name, grad in scaled.items():
        by_layer.setdefault(name.rsplit(".", 1)[0], []).append(grad.numpy().ravel() / 2.0**6)
    want = reference_headroom({k: np.concatenate(v) for k, v in by_layer.items()}, 2.0**6)
    got = {h.layer: h for h in forensics.headroom}
    for room in want:
        assert got[room.layer].max_abs_scaled == pytest.approx(room.max_abs_scaled, rel=1e-6)
        assert (got[room.layer].underflow, got[room.layer].total) == (room.underflow, room.total)
    assert any(h.underflow for h in want)  # the check covered real underflow
    assert forensics.histogram == reference_histogram([g.numpy() / 2.0**6 for g in scaled.values()], 2.0**6)
    assert forensics.headroom_scale == 2.0**6


def test_torch_diagnose_adds_no_host_read_per_step():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, os.path.dirname(__file__))
    from lightning_scripts.host_reads import HostReadCounter

    from lossscale_callbacks.torch import LossScaler

    model = _torch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = LossScaler(device="cpu", diagnose=True, headroom_every=2).watch(model)
    x = torch.randn(8, 8)
    with HostReadCounter(raise_on_read=True):
        for step in range(6):  # sampled steps included
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if step == 3:
                with torch.no_grad():
                    model.decoder[2].bias.grad.fill_(math.inf)
            scaler.step(opt)
            scaler.update()
    assert scaler.read_forensics().layer_skips == {"decoder.2": 1}


def test_torch_scaler_diagnose_arguments_are_checked():
    pytest.importorskip("torch")
    from lossscale_callbacks.torch import LossScaler

    with pytest.raises(ValueError, match="diagnose"):
        LossScaler(diagnose="yes")
    with pytest.raises(ValueError, match="headroom_every"):
        LossScaler(diagnose=True, headroom_every=0)
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        LossScaler().watch("model")
    assert LossScaler().read_forensics() is None
    # watch() before the forensics are on (as the Lightning plugin does): the names apply once they are.
    model = _torch_model()
    scaler = LossScaler(device="cpu").watch(model)
    scaler.set_diagnose(True)
    assert set(scaler.forensics._names.values()) == {n for n, _ in model.named_parameters()}
    # A model's own parameters belong to the model (named by its class), not to a layer called "weight".
    import torch

    bare = LossScaler(device="cpu", diagnose=True).watch(torch.nn.Linear(2, 2))
    assert set(bare.forensics._names.values()) == {"Linear.weight", "Linear.bias"}


# -------------------------------------------------------------------------------- Lightning


@pytest.mark.slow
def test_lightning_run_names_the_layer_and_the_causes(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _torch_model()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), x[:, :1])
            return loss * math.nan if self.global_step == NAN_LOSS_STEP else loss

        def on_after_backward(self):
            if self.global_step in INF_STEPS:
                self.net.decoder[0].weight.grad[0, 0] = math.inf

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    monitor = LossScaleMonitor(log_every=5, health=None, diagnose=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=10, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10))],
                         callbacks=[monitor])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 8)), batch_size=8)
    trainer.fit(Module(), data)
    assert "| `net.decoder.0` | 2 of 2 |" in monitor.summary  # the flagged layers' table
    assert "The loss itself was non-finite (Inf/NaN) in 1 step" in monitor.summary
    report = _report(logger.log_dir)
    assert "Skip causes (overflow forensics): 1 non-finite loss, 2 Inf gradients" in report
    assert "Layers with non-finite gradients in skipped steps: `net.decoder.0` (2)" in report
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    layer_tags = [t for t in acc.Tags()["scalars"] if "layer_skips" in t]
    assert layer_tags == ["loss_scale/layer_skips/net.decoder.0"]
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(FORENSICS_TAG + "/text_summary")]
    assert any("`net.decoder.0`" in t for t in texts)


# ------------------------------------------------------------------------------------ Keras


def _keras_script(tmp_path, code: str) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


KERAS_FIT = f"""
import math, numpy as np, keras, tensorflow as tf
from lossscale_callbacks.keras import LossScaleCallback
keras.mixed_precision.set_global_policy("mixed_float16")
keras.utils.set_random_seed(0)
poison = tf.Variable(False, trainable=False)

@tf.custom_gradient
def poisoned(kernel):
    def grad(upstream):
        return tf.where(poison, tf.cast(math.inf, upstream.dtype), upstream)
    return tf.identity(kernel), grad

class PoisonableDense(keras.layers.Dense):
    def call(self, inputs):
        kernel = keras.ops.cast(poisoned(self.kernel), inputs.dtype)
        return keras.ops.matmul(inputs, kernel) + keras.ops.cast(self.bias, inputs.dtype)

class Inject(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        poison.assign(batch in {INF_STEPS})

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                          PoisonableDense(32, activation="relu"), keras.layers.Dense(1, dtype="float32")])
model.compile(optimizer="adam", loss="mse")
x = np.random.default_rng(0).normal(size=(80, 8)).astype("float32")
x[{NAN_LOSS_STEP} * 8 + 3, 0] = np.nan  # the loss of that batch is NaN
callback = LossScaleCallback(log_every=5, tensorboard="tb", diagnose=True, health=None)
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[callback, Inject()])
print("SUMMARY", callback.summary.replace(chr(10), " | "))
"""


@pytest.mark.slow
def test_keras_fit_names_the_layer_and_the_causes(tmp_path):
    pytest.importorskip("tensorflow")
    out = _keras_script(tmp_path, KERAS_FIT)
    summary = next(line for line in out.splitlines() if line.startswith("SUMMARY"))
    # Keras' own default layer names, told apart by identity: the poisoned one is "poisonable_dense"
    assert "The overflow started in layer `poisonable_dense` in all 2 skipped steps" in summary
    assert "| `poisonable_dense` | 2 of 2 | 2 of 2 |" in summary  # the only flagged layer
    assert "The loss itself was non-finite (Inf/NaN) in 1 step" in summary
    assert "2 skipped steps had Inf gradients" in summary
    report = _report(tmp_path / "tb")
    assert "Skip causes (overflow forensics): 1 non-finite loss, 2 Inf gradients" in report
    assert "Layers with non-finite gradients in skipped steps: `poisonable_dense` (2)" in report
    assert "The overflow started in layer `poisonable_dense` in all 2 skipped steps" in report
