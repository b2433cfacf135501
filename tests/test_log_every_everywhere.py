"""``log_every=N`` means N optimizer steps on every integration, and the old spellings still work, warning.

Each integration trains a tiny model for 10 optimizer steps with ``log_every=4`` and writes to an
``InMemorySink``; the optimizer steps of the reads it wrote (``loss_scale/steps``) are the same
everywhere: 4 and 8, and the last step (the end-of-training read). Keras runs two epochs of 5 batches:
the count goes on across epochs (it used to be the batch index within each epoch). The Trainer logs at
its own ``logging_steps=3`` too, which carry no read when ``log_every`` is given. All in this process,
each a second or two on the CPU (Keras on its default backend). Ray Train's reporter is the same
``ScalerStepMonitor`` as Fabric's and Accelerate's, and is left out (a Ray cluster costs ~20 s).
"""

from __future__ import annotations

import math
import warnings

import pytest

from lossscale_callbacks import DynamicPolicy, InMemorySink, LoggingLoop
from lossscale_callbacks import _metrics as m

torch = pytest.importorskip("torch")

STEPS, LOG_EVERY = 10, 4
EXPECTED = [4, 8, 10]
POLICY = DynamicPolicy(initial_scale=2.0**10, growth_interval=3)
INJECT = {2, 3, 7}  # optimizer steps (from 0) whose gradients overflow: skipped steps count too


def written_steps(memory: InMemorySink) -> list[int]:
    return [int(value) for _, value in memory.series(m.STEPS)]


def _overflow(step: int, parameter: torch.Tensor) -> None:
    if step in INJECT:
        with torch.no_grad():
            parameter.grad.view(-1)[0] = math.inf


def run_plain_torch() -> list[int]:
    from lossscale_callbacks.torch import LossScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler, memory = LossScaler(policy=POLICY, device="cpu"), InMemorySink()
    loop = LoggingLoop(POLICY, log_every=LOG_EVERY, sinks=[memory], echo=None)
    x = torch.randn(16, 8)
    for step in range(STEPS):
        optimizer.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        _overflow(step, model.weight)
        scaler.step(optimizer)
        scaler.update()
        loop.maybe_observe(step + 1, scaler.get_state)
    loop.finish(scaler.get_state())
    return written_steps(memory)


def run_lightning(**monitor_kwargs) -> list[int]:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_scripts import tiny

    from lossscale_callbacks.lightning import LossScaleMonitor, LossScalePlugin

    tiny.quiet_lightning_warnings()
    memory = InMemorySink()
    monitor = LossScaleMonitor(sinks=[memory], echo=None, **({"log_every": LOG_EVERY} | monitor_kwargs))
    model = tiny.module_class(pl)(inject_inf_at=tuple(INJECT), snapshots=False)
    trainer = pl.Trainer(plugins=[LossScalePlugin(device="cpu", policy=POLICY)], callbacks=[monitor],
                         **tiny.trainer_kwargs(max_steps=STEPS))
    trainer.fit(model, tiny.data(n=48, batch_size=8))  # 6 batches an epoch: two epochs
    return written_steps(memory)


def run_fabric() -> list[int]:
    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric

    from lossscale_callbacks.lightning.fabric import FabricLossScaleMonitor, LossScaleFabricPlugin

    plugin = LossScaleFabricPlugin(device="cpu", policy=POLICY)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    memory = InMemorySink()
    monitor = FabricLossScaleMonitor(fabric, log_every=LOG_EVERY, sinks=[memory], echo=None)
    x = torch.randn(16, 8)
    for step in range(STEPS):
        optimizer.zero_grad()
        fabric.backward(model(x).float().pow(2).mean())
        _overflow(step, model.weight)
        optimizer.step()
        monitor.step()
    monitor.finish()
    return written_steps(memory)


def run_accelerate() -> list[int]:
    pytest.importorskip("accelerate")
    from hf_scripts import tiny_accelerate

    memory = InMemorySink()
    setup = tiny_accelerate.Setup(steps=STEPS, log_every=LOG_EVERY, inject_at=tuple(INJECT),
                                  monitor_kwargs={"sinks": [memory]})
    tiny_accelerate.reset_accelerate()
    tiny_accelerate.run(tiny_accelerate.make_accelerator(setup), setup)
    tiny_accelerate.reset_accelerate()
    return written_steps(memory)


def run_trainer(tmp_path, **callback_kwargs) -> list[int]:
    pytest.importorskip("transformers")
    from hf_scripts import tiny_accelerate, tiny_trainer

    from lossscale_callbacks.transformers import LossScaleTrainerCallback

    memory = InMemorySink()
    tiny_accelerate.reset_accelerate()
    trainer = tiny_trainer.trainer(str(tmp_path), inject_at=tuple(INJECT), max_steps=STEPS, logging_steps=3,
                                   report_to=[])
    LossScaleTrainerCallback(policy=POLICY, sinks=[memory], echo=None,
                             **({"log_every": LOG_EVERY} | callback_kwargs)).attach(trainer)
    trainer.train()
    tiny_accelerate.reset_accelerate()
    return written_steps(memory)


def run_keras(**callback_kwargs) -> list[int]:
    keras = pytest.importorskip("keras")
    import numpy as np

    from lossscale_callbacks.keras import LossScaleCallback

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    memory = InMemorySink()
    callback = LossScaleCallback(policy=POLICY, sinks=[memory], echo=None,
                                 **({"log_every": LOG_EVERY} | callback_kwargs))
    x = np.random.default_rng(0).normal(size=(20, 8)).astype("float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[callback])  # 2 epochs of 5 steps
    return written_steps(memory)


def test_log_every_counts_optimizer_steps_on_every_integration(tmp_path):
    written = {"plain torch": run_plain_torch(), "Lightning": run_lightning(), "Fabric": run_fabric(),
               "Accelerate": run_accelerate(), "Trainer": run_trainer(tmp_path), "Keras": run_keras()}
    assert written == dict.fromkeys(written, EXPECTED)


def test_the_old_lightning_spellings_warn_naming_the_new_one_and_still_work():
    from lossscale_callbacks.lightning import LossScaleMonitor

    for old, new in (("epoch", "epoch"), ("step", "trainer")):
        with pytest.warns(FutureWarning, match=rf"LossScaleMonitor\(every='{new}'\)") as caught:
            monitor = LossScaleMonitor(log_every=old)
        assert monitor.every == new and monitor.log_every is None
        assert caught[0].filename == __file__  # it points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing given: the trainer's interval, and no warning
        assert LossScaleMonitor().every == "trainer"
    with pytest.warns(FutureWarning):
        old_epochs = run_lightning(log_every="epoch")
    assert old_epochs == run_lightning(log_every=None, every="epoch") == [6, 10]  # each epoch's end


def test_every_is_checked_by_name_and_the_count_by_the_loop():
    from lossscale_callbacks.lightning import LossScaleMonitor

    with pytest.raises(ValueError, match=r"every must be one of \['epoch', 'trainer'\] or None, got 'steps'"):
        LossScaleMonitor(every="steps")
    with pytest.raises(ValueError, match=r"give log_every=N .* or every='epoch', not both"):
        LossScaleMonitor(log_every=5, every="epoch")
    with pytest.raises(ValueError, match="log_every must be an integer"):
        LossScaleMonitor(log_every=0)  # the loop's check, the one check of the count
    keras = pytest.importorskip("keras")
    del keras
    from lossscale_callbacks.keras import LossScaleCallback

    with pytest.raises(ValueError, match=r"every must be one of \['epoch'\]"):
        LossScaleCallback(every="trainer")
    assert LossScaleCallback().log_every == 100 and LossScaleCallback(every="epoch").log_every is None


def test_keras_every_epoch_reads_at_each_epochs_end():
    assert run_keras(log_every=None, every="epoch") == [5, 10]


def test_the_trainer_reads_at_its_own_log_events_by_default(tmp_path):
    assert run_trainer(tmp_path, log_every=None) == [3, 6, 9, 10]
