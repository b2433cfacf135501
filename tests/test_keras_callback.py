"""LossScaleCallback end to end: real fits of a tiny mixed_float16 model with Inf gradients at known steps."""

import csv
import glob
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from keras_scripts.toy import (  # noqa: E402
    StateRecorder,
    bit_identical,
    build_model,
    expected_states,
    make_data,
)
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402

from lossscale_callbacks import (  # noqa: E402
    METRIC_NAMES,
    DynamicPolicy,
    InMemorySink,
    LossScaleHealthWarning,
)
from lossscale_callbacks._health import ConsecutiveSkips  # noqa: E402
from lossscale_callbacks.keras import LossScaleCallback, LossScaleOptimizer  # noqa: E402

POLICY = DynamicPolicy(initial_scale=256.0, growth_interval=4, max_scale=4096.0)
BATCHES = 8
POISONED = (2, 5)


@pytest.fixture(autouse=True)
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _finite(epochs, batches=BATCHES, poisoned=POISONED):
    return [b not in poisoned for _ in range(epochs) for b in range(batches)]


def _fit(model, epochs, callbacks, initial_epoch=0, batches=BATCHES, poisoned=POISONED):
    x, y = make_data(batches, poisoned=poisoned)
    return model.fit(x, y, batch_size=8, epochs=epochs, initial_epoch=initial_epoch, shuffle=False,
                     callbacks=callbacks, verbose=0)


def _compiled(seed=0, optimizer="adam"):
    model = build_model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _scalars(log_dir):
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    scalars = {}
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        # Skip the model-config text summary.
        if events and events[0].tensor_proto.dtype != tf.string.as_datatype_enum:
            scalars[tag] = [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events]
    return scalars


def test_argument_validation():
    for kwargs, match in [({"log_every": 0}, "log_every"), ({"log_every": 2.5}, "log_every"),
                          ({"policy": "dynamic"}, "policy"), ({"tensorboard": 3}, "tensorboard"),
                          ({"wandb": "yes"}, "wandb"), ({"health": "explode"}, "health"),
                          ({"sinks": [object()]}, "sink"), ({"check_alignment": "yes"}, "check_alignment")]:
        with pytest.raises(ValueError, match=match):
            LossScaleCallback(**kwargs)


def test_custom_loop_needs_our_optimizer_on_the_model():
    model = build_model()
    model.optimizer = keras.optimizers.Adam()  # a custom loop's optimizer, never compiled
    callbacks = keras.callbacks.CallbackList([LossScaleCallback()], model=model)
    wanted = r"needs model\.optimizer to be a lossscale_callbacks\.keras\.LossScaleOptimizer .*got Adam"
    with pytest.raises(ValueError, match=wanted):
        callbacks.on_train_begin()
    model.optimizer = LossScaleOptimizer(keras.optimizers.Adam())
    callbacks = keras.callbacks.CallbackList([callback := LossScaleCallback(health=None)], model=model)
    callbacks.on_train_begin()
    assert callback.optimizer is model.optimizer


@pytest.mark.slow
def test_fit_skips_poisoned_steps_and_logs_to_keras_loggers(tmp_path, capsys):
    """Acceptance 2: skipped steps bit-identical, backoff, counter reset, metrics in logs and in TB files."""
    model = _compiled()
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # Keras' auto-wrap
    sink = InMemorySink()
    recorder = StateRecorder()
    history_logs = []
    batch_logger = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: history_logs.append(
        dict(logs)))
    callbacks = [
        LossScaleCallback(log_every=2, policy=POLICY, sinks=[sink], log_metrics=True),
        batch_logger,
        keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq=1),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        recorder,
    ]
    history = _fit(model, 2, callbacks)
    assert type(model.optimizer) is LossScaleOptimizer

    finite = _finite(2)
    states = [tuple(float(x) for x in s) for s in recorder.states]
    assert states == expected_states(POLICY, finite)
    for t, ok in enumerate(finite):
        if not ok:
            assert bit_identical(recorder.weights[t - 1], recorder.weights[t])
            assert bit_identical(recorder.slots[t - 1], recorder.slots[t])
            scale_before, scale_after = states[t - 1][0], states[t][0]
            assert scale_after == scale_before / 2 and states[t][1] == 0  # backoff, counter reset
        elif t:
            assert not np.array_equal(recorder.weights[t - 1][0], recorder.weights[t][0])
    assert recorder.iterations[-1] == sum(finite)

    # logs: optimizer steps 2, 4, 6, ... (batches 1, 3, 5, ... of each epoch) carry the schema, with the
    # state after that batch.
    for t, logs in enumerate(history_logs):
        if (t + 1) % 2 == 0:
            assert logs["loss_scale/scale"] == states[t][0]
            assert logs["loss_scale/skipped_steps"] == states[t][3]
            assert logs["loss_scale/growth_counter"] == states[t][1]
        else:
            assert "loss_scale/scale" not in logs
    assert history.history["loss_scale/scale"] == [states[BATCHES - 1][0], states[-1][0]]
    # Steps 2, 4, 6, 8 (the epoch's end too), 10; batches 2 and 5 of each epoch skipped.
    assert sink.series("loss_scale/skipped_in_interval")[:5] == [(2, 0.0), (4, 1.0), (6, 1.0), (8, 0.0),
                                                                 (10, 0.0)]

    # Keras' TensorBoard callback wrote them; TensorBoard's own reader reads them back.
    scalars = _scalars(str(tmp_path / "tb" / "train"))
    logged = [states[t][0] for t in range(1, len(states), 2)]
    assert [v for _, v in scalars["batch_loss_scale/scale"]] == logged
    assert [v for _, v in scalars["epoch_loss_scale/skipped_steps"]] == [2.0, 4.0]
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(METRIC_NAMES) <= set(rows[0]) and float(rows[-1]["loss_scale/skipped_steps"]) == 4.0
    assert "Loss scaling: 16 optimizer steps, 4 skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_logs_with_steps_per_execution():
    """Keras reports only batches 1, 3, 5, 7 with steps_per_execution=2: log_every=4 logs at steps 4, 8."""
    model = build_model()
    model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    sink = InMemorySink()
    batch_logs = []
    logger = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batch_logs.append(
        (b, "loss_scale/scale" in logs)))
    _fit(model, 1, [LossScaleCallback(log_every=4, policy=POLICY, sinks=[sink]), logger])
    assert batch_logs == [(1, False), (3, True), (5, False), (7, True)]
    expected = expected_states(POLICY, _finite(1))
    assert sink.series("loss_scale/scale") == [(4, expected[3][0]), (8, expected[7][0])]
    assert sink.series("loss_scale/skipped_steps")[-1] == (8, 2.0)


@pytest.mark.slow
def test_replaces_keras_optimizer_carrying_scale_and_survives_repeated_fit():
    model = _compiled()
    _fit(model, 1, [])  # Keras' own LossScaleOptimizer backs off twice and traces train_function
    keras_lso = model.optimizer
    keras_scale = float(keras_lso.dynamic_scale.numpy())
    keras_counter = int(keras_lso.step_counter.numpy())
    assert keras_scale <= 2.0**13

    seen = {}
    probe = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.setdefault("start", model.optimizer.read_state()))
    callback = LossScaleCallback(log_every=4)
    recorder = StateRecorder(weights=False)
    _fit(model, 1, [callback, probe, recorder])
    ours = model.optimizer
    assert type(ours) is LossScaleOptimizer and ours.inner_optimizer is keras_lso.inner_optimizer
    assert float(seen["start"].scale) == keras_scale and int(seen["start"].growth_counter) == keras_counter
    assert ours.policy == DynamicPolicy(initial_scale=2.0**15, growth_interval=2000)
    # The retraced train function runs our optimizer: its state moved, Keras' did not.
    assert int(recorder.states[-1][4]) == int(seen["start"].steps) + BATCHES
    assert int(recorder.states[-1][3]) == 2
    assert float(keras_lso.dynamic_scale.numpy()) == keras_scale

    # A second fit keeps the same optimizer and its running state.
    _fit(model, 1, [callback, recorder])
    assert model.optimizer is ours
    assert int(recorder.states[-1][4]) == int(seen["start"].steps) + 2 * BATCHES
    assert int(recorder.states[-1][3]) == 4


@pytest.mark.slow
def test_resume_with_save_and_load_model_matches_uninterrupted(tmp_path):
    """Acceptance 3 (model.save / load_model): the same state at every step as one long run."""
    full = StateRecorder()
    model = _compiled()
    _fit(model, 4, [LossScaleCallback(log_every=1, policy=POLICY), full])

    first = StateRecorder()
    model = _compiled()
    _fit(model, 2, [LossScaleCallback(log_every=1, policy=POLICY), first])
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored.optimizer) is LossScaleOptimizer and restored.optimizer.policy == POLICY
    assert [float(x) for x in restored.optimizer.read_state()] == list(first.states[-1])
    second = StateRecorder()
    _fit(restored, 4, [LossScaleCallback(log_every=1), second], initial_epoch=2)
    assert first.states + second.states == full.states

    # save_weights/load_weights: a model compiled with our optimizer, built before loading
    # (Keras skips loading into an unbuilt optimizer, with a warning).
    weights = str(tmp_path / "ckpt.weights.h5")
    model.save_weights(weights)
    again = _compiled(seed=3, optimizer=LossScaleOptimizer(keras.optimizers.Adam(), policy=POLICY))
    again.optimizer.build(again.trainable_variables)
    again.load_weights(weights)
    assert [float(x) for x in again.optimizer.read_state()] == list(first.states[-1])
    assert int(again.optimizer.iterations.numpy()) == first.iterations[-1]
    assert expected_states(POLICY, _finite(4)) == [tuple(float(x) for x in s) for s in full.states]
    for a, b in zip(full.weights[-1], second.weights[-1], strict=False):
        np.testing.assert_array_equal(a, b)


class _Crash(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("simulated crash")


@pytest.mark.slow
@pytest.mark.parametrize("backup_first", [False, True], ids=["callback_first", "backup_first"])
def test_resume_with_backup_and_restore_after_crash_matches_uninterrupted(tmp_path, backup_first):
    """Acceptance 3 (BackupAndRestore): a crash mid-epoch, a fresh process-like restart, identical states."""
    full = StateRecorder(weights=False)
    _fit(_compiled(), 4, [LossScaleCallback(log_every=3, policy=POLICY), full])

    def callbacks(*more):
        ours, backup = LossScaleCallback(log_every=3, policy=POLICY), keras.callbacks.BackupAndRestore(
            str(tmp_path / "backup"))
        return [backup, ours, *more] if backup_first else [ours, backup, *more]

    crashed = StateRecorder(weights=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(_compiled(), 4, callbacks(crashed, _Crash(2, 4)))
    assert crashed.states == full.states[:2 * BATCHES + 5]

    resumed = StateRecorder(weights=False)
    fresh = _compiled(seed=7)  # a new process would build and compile the model again
    _fit(fresh, 4, callbacks(resumed))
    assert resumed.states == full.states[2 * BATCHES:]


@pytest.mark.slow
def test_keras_callbacks_monitor_loss_scale_metrics(tmp_path):
    model = _compiled(optimizer=keras.optimizers.Adam(0.01))
    checkpoint = str(tmp_path / "best.weights.h5")
    callbacks = [
        LossScaleCallback(log_every=100, policy=POLICY, log_metrics=True),  # epoch logs, on request
        keras.callbacks.ReduceLROnPlateau(monitor="loss_scale/skipped_steps", mode="min", factor=0.5,
                                          patience=0, min_delta=0.0),
        keras.callbacks.ModelCheckpoint(checkpoint, monitor="loss_scale/scale", mode="max",
                                        save_best_only=True, save_weights_only=True),
        keras.callbacks.EarlyStopping(monitor="loss_scale/skipped_steps", mode="min", patience=2),
    ]
    history = _fit(model, 10, callbacks)
    assert len(history.history["loss"]) == 3  # skipped_steps never improves after the first epoch
    assert float(model.optimizer.inner_optimizer.learning_rate.numpy()) == pytest.approx(0.01 / 4)
    assert os.path.exists(checkpoint)


@pytest.mark.slow
def test_health_stop_sets_stop_training():
    recorder = StateRecorder(weights=False)
    rules = [ConsecutiveSkips(limit=4, action="stop")]
    callback = LossScaleCallback(log_every=2, policy=POLICY, health=rules)
    with pytest.warns(LossScaleHealthWarning, match="stopping training"):
        _fit(_compiled(), 3, [callback, recorder], poisoned=range(BATCHES))
    assert len(recorder.states) == 4  # read after steps 2, 4: four in a row skipped >= 4
    assert "4 skipped (100.00%)" in callback.summary


@pytest.mark.slow
def test_tensorboard_and_wandb_sinks(tmp_path, monkeypatch):
    wandb_reader = pytest.importorskip("lossscale_callbacks.wandb._reader")
    monkeypatch.setenv("WANDB_MODE", "offline")
    log_dir = tmp_path / "tb_sink"
    wandb_kwargs = {"dir": str(tmp_path), "project": "lossscale-tests", "mode": "offline"}
    callback = LossScaleCallback(log_every=2, policy=POLICY, tensorboard=str(log_dir), wandb=wandb_kwargs)
    recorder = StateRecorder(weights=False)
    _fit(_compiled(), 1, [callback, recorder])
    files = glob.glob(str(log_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert files
    found = {}
    for path in files:
        acc = event_accumulator.EventAccumulator(os.path.dirname(path),
                                                 size_guidance={event_accumulator.TENSORS: 0,
                                                                event_accumulator.SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags().get("tensors", []):
            found[tag] = [e.step for e in acc.Tensors(tag)]
        for tag in acc.Tags().get("scalars", []):
            found[tag] = [e.step for e in acc.Scalars(tag)]
    assert found.get("loss_scale/scale") == [2, 4, 6, 8]
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    wandb_reader.wait_until_finished(runs[0])
    series = wandb_reader.read_run(runs[0])
    scales = [recorder.states[t][0] for t in (1, 3, 5, 7)]
    assert series["loss_scale/scale"] == list(zip([2, 4, 6, 8], scales, strict=True))
    assert series["loss_scale/skipped_steps"][-1] == (8, 2.0)


@pytest.mark.slow
def test_check_alignment_report_goes_to_sinks_and_stdout(capsys):
    pytest.importorskip("lossscale_callbacks.keras._alignment")
    sink = InMemorySink()
    callback = LossScaleCallback(log_every=4, policy=POLICY, sinks=[sink], check_alignment=True)
    _fit(_compiled(), 1, [callback])
    tags = [tag for tag, _ in sink.texts]
    assert tags == ["loss_scale/alignment", "loss_scale/policy", "loss_scale/summary"]  # policy: once
    markdown = sink.texts[0][1]
    assert markdown == callback.alignment_report.to_markdown() and markdown.strip()
    out = capsys.readouterr().out
    assert markdown.strip() in out and "Loss scaling: 8 optimizer steps, 2 skipped" in out


@pytest.mark.slow
def test_wandb_metrics_logger_after_the_callback_logs_the_metrics(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    keras_integration = pytest.importorskip("wandb.integration.keras")
    reader = pytest.importorskip("lossscale_callbacks.wandb._reader")
    monkeypatch.setenv("WANDB_MODE", "offline")
    recorder = StateRecorder(weights=False)
    run = wandb.init(project="lossscale-tests", dir=str(tmp_path), mode="offline")
    try:
        # W&B's logger logs at batch indexes within the epoch (0, 2, ...), our reads count optimizer steps:
        # a read at every step puts the metrics in the logs of every batch it logs.
        _fit(_compiled(), 1, [LossScaleCallback(log_every=1, policy=POLICY, log_metrics=True), recorder,
                              keras_integration.WandbMetricsLogger(log_freq=2)])
    finally:
        run.finish()
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    reader.wait_until_finished(run_dir)  # finish() can return before W&B's writer flushed the file
    series = reader.read_run(run_dir)
    logged = [value for _, value in series["batch/loss_scale/scale"]]
    assert logged == [recorder.states[t][0] for t in range(0, BATCHES, 2)]
    assert [v for _, v in series["epoch/loss_scale/skipped_steps"]] == [2.0]
