"""LossScaleMonitor: cadence, every logger, callback_metrics, health, the stock GradScaler, alignment."""

from __future__ import annotations

import csv
import math
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from lightning_scripts import tiny  # noqa: E402
from lightning_scripts.host_reads import HostReadCounter  # noqa: E402

import lossscale_callbacks  # noqa: E402
import lossscale_callbacks.lightning  # noqa: E402
import lossscale_callbacks.torch  # noqa: E402
from lossscale_callbacks import DynamicPolicy, LossScaleHealthWarning  # noqa: E402
from lossscale_callbacks._health import ConsecutiveSkips  # noqa: E402
from lossscale_callbacks._metrics import METRIC_NAMES  # noqa: E402
from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin  # noqa: E402

LIBRARY = tuple(os.path.dirname(m.__file__) for m in (lossscale_callbacks, lossscale_callbacks.lightning,
                                                        lossscale_callbacks.torch))

tiny.quiet_lightning_warnings()


@pytest.fixture(params=tiny.NAMESPACES)
def pl(request):
    return pytest.importorskip(request.param)


def capture_logger(pl):
    class Capture(pl.loggers.Logger):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[int, dict]] = []

        @property
        def name(self):
            return "capture"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.calls.append((step, dict(metrics)))

        def series(self, name):
            return [(s, m[name]) for s, m in self.calls if name in m]

    return Capture()


def _fit(pl, monitor, plugin=None, model=None, **kwargs):
    plugin = plugin if plugin is not None else LossScalePlugin(
        device="cpu", policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=3))
    model = model if model is not None else tiny.module_class(pl)(snapshots=False)
    loggers = kwargs.pop("logger", None) or [capture_logger(pl), capture_logger(pl)]
    trainer = pl.Trainer(plugins=[plugin], callbacks=[monitor],
                         **tiny.trainer_kwargs(logger=loggers, **kwargs))
    trainer.fit(model, tiny.data())
    return trainer, loggers


def test_monitor_is_a_callback_of_both_namespaces():
    for name in tiny.NAMESPACES:
        ns = pytest.importorskip(name)
        assert isinstance(LossScaleMonitor(), ns.Callback)


def test_logs_the_schema_through_every_logger_at_log_every_n_steps(pl):
    monitor = LossScaleMonitor()
    model = tiny.module_class(pl)(inject_inf_at=(1,), snapshots=False)
    trainer, loggers = _fit(pl, monitor, model=model, max_steps=8, log_every_n_steps=2)
    for logger in loggers:
        # Lightning's own logging step (as LearningRateMonitor logs): rows line up with self.log's.
        steps = [s for s, _ in logger.series("loss_scale/scale")]
        assert steps == [1, 3, 5, 7]
        last = {name: logger.series(name)[-1][1] for name in METRIC_NAMES}
        # steps 0 finite, 1 skipped (1024 -> 512), 2,3,4 finite -> growth at the 3rd (1024), 5,6,7 -> 2048
        assert last == {"loss_scale/scale": 2048.0, "loss_scale/log2_scale": 11.0,
                        "loss_scale/growth_counter": 0, "loss_scale/skipped_steps": 1,
                        "loss_scale/skipped_in_interval": 0, "loss_scale/skip_rate": 0.0,
                        "loss_scale/steps": 8}
        assert logger.series("loss_scale/skipped_in_interval")[0] == (1, 1)
    for name in METRIC_NAMES:
        assert name in trainer.callback_metrics
    assert monitor.summary.startswith("Loss scaling: 8 optimizer steps, 1 skipped (12.50%)")


def test_csv_logger_rows_of_ours_carry_the_epoch(pl, tmp_path):
    """Issue 30: the CSVLogger rows of loss_scale/* had an empty ``epoch`` (Lightning adds it to its own)."""
    logger = pl.loggers.CSVLogger(tmp_path, name="csv", version=0)
    _fit(pl, LossScaleMonitor(), logger=logger, max_epochs=2, max_steps=-1, log_every_n_steps=2)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        ours = [row for row in csv.DictReader(f) if row.get("loss_scale/scale")]
    assert ours and all(row["epoch"] != "" for row in ours)
    assert {row["epoch"] for row in ours} == {"0", "1"}


@pytest.mark.parametrize("interval, expected", [(3, [2, 5, 7]), ("epoch", [8, 10])])
def test_other_logging_intervals(interval, expected):
    import lightning.pytorch as pl

    monitor = LossScaleMonitor(log_every=interval)
    _, loggers = _fit(pl, monitor, max_steps=10 if interval == "epoch" else 7)
    # After the last step a final read is logged when it was not already (for the summary).
    assert [s for s, _ in loggers[0].series("loss_scale/scale")] == expected


def test_model_checkpoint_and_early_stopping_can_monitor_loss_scale_metrics(pl, tmp_path):
    # Stop as soon as more than one step was skipped: after epoch 0 (8 batches, 2 injected skips).
    stop = pl.callbacks.EarlyStopping(monitor="loss_scale/skipped_steps", mode="min",
                                      divergence_threshold=1.5, check_on_train_epoch_end=True)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="loss_scale/scale", mode="max",
                                        every_n_train_steps=4)
    model = tiny.module_class(pl)(inject_inf_at=(1, 3), snapshots=False)
    trainer = pl.Trainer(plugins=[LossScalePlugin(device="cpu")],
                         callbacks=[LossScaleMonitor(log_every=1), stop, ckpt],
                         **tiny.trainer_kwargs(max_epochs=3, max_steps=-1, enable_checkpointing=True))
    trainer.fit(model, tiny.data())
    assert trainer.global_step == 8 and stop.stopped_epoch == 0
    # GradScaler's default initial scale 2**16, halved by the skips at steps 1 and 3 (read at step 4).
    assert ckpt.best_model_path and float(ckpt.best_model_score) == 2.0**14


def test_health_stop_sets_should_stop(pl):
    monitor = LossScaleMonitor(health=[ConsecutiveSkips(limit=3, action="stop")])
    model = tiny.module_class(pl)(inject_inf_at=tuple(range(100)), snapshots=False)
    with pytest.warns(LossScaleHealthWarning, match="stopping training"):
        trainer, _ = _fit(pl, monitor, model=model, max_steps=20, log_every_n_steps=2)
    assert trainer.global_step == 4 and trainer.should_stop


def test_progress_bar_shows_scale(pl):
    monitor = LossScaleMonitor(prog_bar=True, log_every=1)
    trainer, _ = _fit(pl, monitor, max_steps=2)
    assert trainer.progress_bar_metrics["loss_scale/scale"] == 1024.0


def test_reads_the_stock_mixed_precision_grad_scaler(pl):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    plugin = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)
    monitor = LossScaleMonitor(log_every=1)
    model = tiny.module_class(pl)(inject_inf_at=(2, 5, 6), snapshots=False)
    trainer, loggers = _fit(pl, monitor, plugin=plugin, model=model, max_steps=9)
    assert set(model.autocast_dtypes) == {torch.float16}
    skipped = [v for _, v in loggers[0].series("loss_scale/skipped_steps")]
    # Growths (after steps 1, 4 and 8) also reset the tracker; they must not count as skips.
    assert skipped == [0, 0, 1, 1, 1, 2, 3, 3, 3]
    scales = [v for _, v in loggers[0].series("loss_scale/scale")]
    assert scales[-1] == scaler.get_scale() == 2.0**10
    assert trainer.callback_metrics["loss_scale/growth_counter"] == scaler._get_growth_tracker()


@pytest.mark.parametrize("optimizer, per_step", [("adam_fused", []), ("sgd", [("item", "_scaler.py")])])
def test_the_library_reads_the_device_only_at_the_log_interval(optimizer, per_step):
    """Every host read the library makes in a real run: the skip decision of a non-fused optimizer
    per step, and one copy of the state per log interval (``.cpu().tolist()``: one sync)."""
    import lightning.pytorch as pl

    model = tiny.module_class(pl)(optimizer=optimizer, inject_inf_at=(3,), snapshots=False)
    with HostReadCounter(only_under=LIBRARY) as counter:
        trainer, loggers = _fit(pl, LossScaleMonitor(), model=model, max_steps=8, log_every_n_steps=4)
    assert [s for s, _ in loggers[0].series("loss_scale/scale")] == [3, 7]
    interval = [("cpu", "_update_paths.py"), ("numpy", "_update_paths.py")]  # the state, one copy
    assert counter.reads == (per_step * 4 + interval) * 2
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 1


def test_the_stock_scaler_is_read_only_at_the_log_interval():
    import lightning.pytorch as pl

    plugin = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    model = tiny.module_class(pl)(inject_inf_at=(3,), snapshots=False)
    with HostReadCounter(only_under=LIBRARY) as counter:
        _, loggers = _fit(pl, LossScaleMonitor(), plugin=plugin, model=model, max_steps=8,
                          log_every_n_steps=4)
    assert counter.reads == [("cpu", "_stock.py"), ("tolist", "_stock.py")] * 2
    assert loggers[0].series("loss_scale/skipped_steps") == [(3, 1), (7, 1)]


def two_optimizer_module(pl, inject_at: int):
    """Manual optimization, two optimizers, one backward each: two optimizer steps per batch."""

    class TwoOptimizers(tiny.module_class(pl)):
        def __init__(self):
            super().__init__(snapshots=False)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            for index, opt in enumerate(self.optimizers()):
                opt.zero_grad()
                self.manual_backward(torch.nn.functional.mse_loss(self(x).float(), y))
                if index == 0 and self.trainer.global_step == inject_at:
                    with torch.no_grad():
                        self.net[0].weight.grad[0, 0] = math.inf
                opt.step()

        def configure_optimizers(self):
            return (torch.optim.SGD(self.net[0].parameters(), lr=0.01),
                    torch.optim.SGD(self.net[2].parameters(), lr=0.01))

    return TwoOptimizers()


@pytest.mark.parametrize("stock", [False, True])
def test_several_optimizer_steps_per_batch_are_each_counted_once(stock):
    import lightning.pytorch as pl

    if stock:
        plugin = pl.plugins.precision.MixedPrecision(
            "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    else:
        plugin = LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=3))
    monitor = LossScaleMonitor(log_every=3)
    trainer, loggers = _fit(pl, monitor, plugin=plugin, model=two_optimizer_module(pl, inject_at=4),
                            max_steps=12)
    assert trainer.global_step == 12
    # Two steps per batch: every multiple of 3 crossed is logged, even the odd ones never landed on
    # (optimizer steps 4, 6, 10, 12; the loggers get Lightning's logging step, the batch index 1, 2, 4, 5;
    # the last read, at train end, comes after Lightning counted the last batch).
    assert [s for s, _ in loggers[0].series("loss_scale/scale")] == [1, 2, 4, 5]
    assert monitor.loop.last.step == 12
    # One overflow (step 4, the first optimizer of batch 2); the growths after it are not skips.
    assert loggers[0].series("loss_scale/skipped_steps")[-1] == (5, 1)
    assert monitor.summary.startswith("Loss scaling: 12 optimizer steps, 1 skipped")


def test_a_resumed_run_counts_its_first_interval_from_the_checkpoint(tmp_path):
    import lightning.pytorch as pl

    def fit(max_steps, ckpt_path=None):
        monitor = LossScaleMonitor(log_every=2)
        model = tiny.module_class(pl)(inject_inf_at=(1,), snapshots=False)
        loggers = [capture_logger(pl)]
        trainer = pl.Trainer(plugins=[LossScalePlugin(device="cpu")], callbacks=[monitor],
                             **tiny.trainer_kwargs(max_steps=max_steps, logger=loggers))
        trainer.fit(model, tiny.data(), ckpt_path=ckpt_path)
        return trainer, loggers[0]

    first, _ = fit(4)
    first.save_checkpoint(str(tmp_path / "mid.ckpt"))
    _, logger = fit(8, str(tmp_path / "mid.ckpt"))
    # Steps 5 and 6 are finite: the first interval after resuming has no skip, not the run's one.
    assert logger.series("loss_scale/skipped_in_interval")[0] == (5, 0)
    assert logger.series("loss_scale/skipped_steps")[0] == (5, 1)


def test_warns_when_there_is_no_scaler(pl):
    monitor = LossScaleMonitor()
    trainer = pl.Trainer(callbacks=[monitor], **tiny.trainer_kwargs(max_steps=1))
    with pytest.warns(UserWarning, match="found no loss scaler"):
        trainer.fit(tiny.module_class(pl)(snapshots=False), tiny.data())
    assert "loss_scale/scale" not in trainer.callback_metrics


def test_alignment_report_is_written_once_on_the_first_batch(pl, monkeypatch):
    calls = []

    class Report:
        def to_markdown(self):
            return "| layer | dim |\n|---|---|\n| net.0 | 16 |"

    def check_alignment(model, sample, **kwargs):
        calls.append((type(model).__name__, sample[0].shape, kwargs))
        model(sample).sum().backward()  # a check may run backward; grads must not leak
        return Report()

    fake = types.ModuleType("lossscale_callbacks.torch._alignment")
    fake.check_alignment = check_alignment
    monkeypatch.setitem(sys.modules, "lossscale_callbacks.torch._alignment", fake)
    monitor = LossScaleMonitor(check_alignment=True, alignment_kwargs={"dtype": "float16"})
    texts = []
    monkeypatch.setattr("lossscale_callbacks.lightning._loggers.LoggerSink.write_text",
                        lambda self, tag, md: texts.append((tag, md)))
    _fit(pl, monitor, max_steps=3)
    assert calls == [("Tiny", torch.Size([8]), {"dtype": "float16"})]  # the inputs of (inputs, targets)
    tags = [tag for tag, _ in texts]
    assert tags.count("loss_scale/alignment") == 2  # one per logger
    assert monitor.alignment_report is not None


def test_real_alignment_report_reaches_tensorboard(tmp_path):
    import lightning.pytorch as pl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pytest.importorskip("lossscale_callbacks.torch._alignment")
    tb = pl.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    model = tiny.module_class(pl)(width=12, snapshots=False)
    monitor = LossScaleMonitor(check_alignment=True)
    _fit(pl, monitor, model=model, max_steps=2, logger=[tb])
    assert monitor.alignment_report.has("high")  # 12 features are not a multiple of 8 in fp16
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("loss_scale/alignment"))
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "| high | net.0 | features_out | 12 |" in text


def test_missing_alignment_module_warns(monkeypatch):
    import lightning.pytorch as pl

    monkeypatch.setitem(sys.modules, "lossscale_callbacks.torch._alignment", None)
    with pytest.warns(UserWarning, match="alignment checker could not be imported"):
        _fit(pl, LossScaleMonitor(check_alignment=True), max_steps=1)


@pytest.mark.parametrize("kwargs, match", [
    ({"log_every": 0}, "log_every"),
    ({"log_every": "batch"}, "log_every"),
    ({"log_every": True}, "log_every"),
    ({"prog_bar": "yes"}, "prog_bar"),
    ({"health": "loud"}, "health"),
    ({"check_alignment": 1}, "check_alignment"),
    ({"alignment_kwargs": [1]}, "alignment_kwargs"),
    ({"sinks": None}, "sinks must be an iterable"),
    ({"tensorboard": ""}, "tensorboard must be None or a non-empty"),
    ({"wandb": {"mode": "nonsense"}}, "mode must be one of"),
    ({"diagnose": 1.0}, "diagnose must be one of"),
])
def test_monitor_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleMonitor(**kwargs)
