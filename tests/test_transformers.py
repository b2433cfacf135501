"""Hugging Face Transformers: ``LossScaleTrainerCallback`` on a real ``Trainer`` (tiny GPT-2 from a config).

The end-to-end tests read the scale back from the event files that the Trainer's own TensorBoard
integration (``report_to=["tensorboard"]``) wrote, with overflows injected at known steps, for
Accelerate's stock ``GradScaler`` and for ours, and check them against the core's update rule.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_scripts import tiny_accelerate  # noqa: E402
from hf_scripts import tiny_trainer as tiny  # noqa: E402
from lightning_scripts.host_reads import HostReadCounter  # noqa: E402
from report_json import the_read_run  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import lossscale_callbacks  # noqa: E402
import lossscale_callbacks.accelerate  # noqa: E402
import lossscale_callbacks.torch  # noqa: E402
import lossscale_callbacks.transformers  # noqa: E402
from lossscale_callbacks._cli import main as cli_main  # noqa: E402
from lossscale_callbacks._health import ConsecutiveSkips  # noqa: E402
from lossscale_callbacks._metrics import METRIC_NAMES  # noqa: E402
from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks._update import initial_state, next_state  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402
from lossscale_callbacks.transformers._callback import LossScaleTrainerCallback  # noqa: E402

PACKAGES = (lossscale_callbacks, lossscale_callbacks.accelerate, lossscale_callbacks.torch,
            lossscale_callbacks.transformers)
LIBRARY = tuple(os.path.dirname(m.__file__) for m in PACKAGES)
POLICY = DynamicPolicy(initial_scale=1024.0, growth_interval=3)
INJECT = (2, 5, 9)


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Each Trainer makes its Accelerator from its own arguments (Accelerate keeps process-wide state)."""
    tiny_accelerate.reset_accelerate()
    yield
    tiny_accelerate.reset_accelerate()


class RecordLogs(TrainerCallback):
    """What a report_to integration receives (it runs after the Trainer's integrations)."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, Any]]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))

    def series(self, name: str) -> list[tuple[int, Any]]:
        return [(step, logs[name]) for step, logs in self.logs if name in logs]


def callback_for(kind: str, **kwargs: Any) -> LossScaleTrainerCallback:
    if kind == "ours":
        return LossScaleTrainerCallback(policy=POLICY, **kwargs)
    stock = torch.amp.GradScaler("cpu", init_scale=POLICY.initial_scale, growth_interval=3)
    return LossScaleTrainerCallback(scaler=stock, **kwargs)


def expected(steps: int, inject: tuple[int, ...]) -> dict[int, tuple[float, int]]:
    """The core's update rule: (scale, skipped steps) after each optimizer step, counted from 1."""
    state, out = initial_state(POLICY), {}
    for step in range(steps):
        state = next_state(POLICY, state, finite=step not in inject)
        out[step + 1] = (float(state.scale), int(state.skipped_steps))
    return out


def tensorboard_scalars(out: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = glob.glob(os.path.join(out, "runs", "*"))  # the Trainer's TensorBoard integration's folder
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stock", "ours"])
def test_the_trainers_tensorboard_files_hold_the_scale_and_the_skips(tmp_path, kind, capsys):
    trainer = tiny.trainer(str(tmp_path), inject_at=INJECT)
    callback = callback_for(kind).attach(trainer)
    layer = trainer.model.transformer.h[0].mlp.c_fc
    dtypes: list[torch.dtype] = []
    layer.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    trainer.train()
    assert set(dtypes) == {torch.float16}  # fp16 is real on the CPU
    series = tensorboard_scalars(str(tmp_path))
    assert {f"train/{name}" for name in METRIC_NAMES} <= set(series)
    truth = expected(12, INJECT)
    assert series["train/loss_scale/scale"] == [(s, truth[s][0]) for s in (4, 8, 12)]
    assert series["train/loss_scale/skipped_steps"] == [(s, truth[s][1]) for s in (4, 8, 12)]
    assert series["train/loss_scale/steps"] == [(4, 4.0), (8, 8.0), (12, 12.0)]
    # ... equal to what the scaler itself counted.
    scaler = trainer.accelerator.scaler
    if kind == "ours":
        state = scaler.get_state()
        assert (state.scale, state.skipped_steps, state.steps) == (truth[12][0], len(INJECT), 12)
    else:
        assert type(scaler) is torch.amp.GradScaler and scaler.get_scale() == truth[12][0]
        assert callback.reader.read().skipped_steps == len(INJECT)
    out = capsys.readouterr().out
    assert callback.summary.startswith("Loss scaling: 12 optimizer steps, 3 skipped (25.00%)")
    assert callback.summary in out and "Health:" in callback.summary
    assert cli_main(["report", str(tmp_path / "runs"), "--json"]) == 0
    payload = the_read_run(capsys.readouterr().out)
    assert (payload["steps"], payload["skipped_steps"], payload["final_scale"]) == (12, 3, truth[12][0])


def test_no_host_read_in_a_step_only_at_the_trainers_log_steps(tmp_path):
    for kind, read in (("ours", [("cpu", "_update_paths.py"), ("numpy", "_update_paths.py")]),
                       ("stock", [("cpu", "_stock.py"), ("tolist", "_stock.py")])):
        tiny_accelerate.reset_accelerate()
        # The Trainer's default optimizer (fused AdamW) decides the skip on the device for both scalers.
        trainer = tiny.trainer(str(tmp_path / kind), inject_at=(1,), max_steps=8, report_to=[])
        assert trainer.args.optim == "adamw_torch_fused"
        callback_for(kind, echo=None).attach(trainer)
        with HostReadCounter(only_under=LIBRARY) as counter:
            trainer.train()
        assert counter.reads == read * 2, kind  # logging_steps=4: steps 4 and 8


def test_log_every_asks_the_trainer_to_log_and_evaluation_logs_are_left_alone(tmp_path):
    record = RecordLogs()
    trainer = tiny.trainer(str(tmp_path), inject_at=(1,), max_steps=7, logging_steps=100, report_to=[])
    trainer.add_callback(record)
    callback_for("ours", log_every=3, echo=None).attach(trainer)
    trainer.train()
    # Steps 3 and 6 at our request; 7 at the end of training (the Trainer's own last log).
    assert record.series("loss_scale/steps") == [(3, 3), (6, 6), (7, 7)]
    assert record.series("loss_scale/skipped_in_interval") == [(3, 1), (6, 0), (7, 0)]
    metrics = trainer.evaluate(tiny.dataset(8))
    assert not any(key.startswith("loss_scale/") for key in metrics)
    assert not any(key.startswith("loss_scale/") for key in record.logs[-1][1])


def test_a_stop_rule_stops_training(tmp_path):
    trainer = tiny.trainer(str(tmp_path), inject_at=tuple(range(12)), logging_steps=1, report_to=[])
    callback_for("ours", health=[ConsecutiveSkips(limit=2, action="stop")], echo=None).attach(trainer)
    with pytest.warns(UserWarning, match="skipped"):
        trainer.train()
    assert trainer.state.global_step == 2


def test_diagnose_logs_the_causes_and_names_the_layer(tmp_path):
    record = RecordLogs()
    trainer = tiny.trainer(str(tmp_path), inject_at=(2,), max_steps=4, report_to=[])
    trainer.add_callback(record)
    callback = LossScaleTrainerCallback(policy=POLICY, diagnose=True, echo=None).attach(trainer)
    trainer.train()
    assert isinstance(trainer.accelerator.scaler, LossScaler)
    causes = {key: value for key, value in record.logs[0][1].items() if key.startswith("loss_scale/skips/")}
    # One skip for non-finite gradients (told as Inf, or as "Inf or NaN" where a fused optimizer decides).
    assert record.logs[0][0] == 4 and causes["loss_scale/skips/loss_nonfinite"] == 0
    assert sum(causes.values()) == 1 and causes.get("loss_scale/skips/grad_nan") == 0
    assert record.series("loss_scale/layer_skips/transformer.wte") == [(4, 1)]
    assert "transformer.wte" in callback.summary


@pytest.mark.slow
def test_resuming_from_a_checkpoint_restores_our_scaler(tmp_path):
    full = tiny.trainer(str(tmp_path / "full"), inject_at=INJECT, save_strategy="steps", save_steps=6,
                        report_to=[])
    callback_for("ours", echo=None).attach(full)
    full.train()
    tiny_accelerate.reset_accelerate()
    record = RecordLogs()
    resumed = tiny.trainer(str(tmp_path / "resumed"), inject_at=INJECT, report_to=[])
    resumed.add_callback(record)
    callback = callback_for("ours", echo=None).attach(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-6"))
    assert resumed.accelerator.scaler.get_state() == full.accelerator.scaler.get_state()
    # The first interval after the resume covers its own two steps (7, 8), not the first six.
    assert record.series("loss_scale/skipped_in_interval") == [(8, 0), (12, 1)]
    assert callback.summary.startswith("Loss scaling: 12 optimizer steps, 3 skipped")


def test_without_fp16_on_the_cpu_the_callback_says_the_run_is_float32(tmp_path):
    record = RecordLogs()
    trainer = tiny.trainer(str(tmp_path), max_steps=4, report_to=[])
    trainer.add_callback(record)
    LossScaleTrainerCallback(echo=None).attach(trainer)
    with pytest.warns(UserWarning, match=r"found no loss scaler: .*on the CPU.*trains in float32.*"
                                         r"LossScaleTrainerCallback\(policy=\.\.\.\)"):
        trainer.train()
    assert not record.series("loss_scale/scale")


def test_attach_is_required_and_checked(tmp_path):
    callback = LossScaleTrainerCallback(echo=None)
    trainer = tiny.trainer(str(tmp_path), max_steps=2, report_to=[])
    trainer.add_callback(callback)
    with pytest.raises(RuntimeError, match=r"without attach\(\): use LossScaleTrainerCallback\(\.\.\.\)"
                                           r"\.attach\(trainer\)"):
        trainer.train()
    with pytest.raises(ValueError, match=r"trainer must be a transformers\.Trainer, got str"):
        callback.attach("trainer")
    callback.attach(trainer)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.count("LossScaleTrainerCallback") == 1 and names.index("LossScaleTrainerCallback") == 1
    tiny_accelerate.reset_accelerate()
    with pytest.raises(ValueError, match="attached to another Trainer"):
        callback.attach(tiny.trainer(str(tmp_path), max_steps=2))


def test_attaching_twice_installs_once_more_and_keeps_one_callback(tmp_path):
    trainer = tiny.trainer(str(tmp_path), max_steps=2, report_to=[])
    callback = callback_for("ours", echo=None)
    first = callback.attach(trainer).installed
    second = callback.attach(trainer).installed
    assert first is not second and trainer.accelerator.scaler is second and second.policy == POLICY
    assert trainer.callback_handler.callbacks.count(callback) == 1
    trainer.train()
    assert callback.loop.last.step == 2


def test_installing_needs_fp16_and_must_come_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"needs TrainingArguments\(fp16=True\)"):
        LossScaleTrainerCallback(policy=POLICY).attach(tiny.trainer(str(tmp_path), fp16=False))
    tiny_accelerate.reset_accelerate()
    trainer = tiny.trainer(str(tmp_path), max_steps=1, report_to=[])
    trainer.train()
    with pytest.raises(RuntimeError, match=r"before accelerator\.prepare"):
        LossScaleTrainerCallback(policy=POLICY).attach(trainer)


@pytest.mark.parametrize("hidden", ["transformers", "accelerate"])
def test_without_its_packages_the_import_names_the_extra(hidden):
    code = (f"import sys; sys.modules[{hidden!r}] = None\n"
            "try:\n    import lossscale_callbacks.transformers\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"MissingExtraError lossscale_callbacks.transformers needs the {hidden!r} package")
    assert 'pip install "lossscale-callbacks[transformers]"' in out


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"log_every": 0}, "log_every"), ({"health": "loud"}, "health"), ({"diagnose": "x"}, "diagnose"),
    ({"tensorboard": ""}, "tensorboard"), ({"sinks": None}, "sinks"), ({"wandb": "yes"}, "wandb"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaleTrainerCallback(**kwargs)


def test_the_scale_reaches_log_history_and_trainer_state_json(tmp_path):
    """Issue 30: the Trainer copies the logs into log_history before the callbacks add to them."""
    trainer = tiny.trainer(str(tmp_path), inject_at=(1,), max_steps=8, report_to=[], save_strategy="steps",
                           save_steps=8)
    callback_for("stock", echo=None).attach(trainer)
    trainer.train()
    logged = [(e["step"], e["loss_scale/skipped_steps"]) for e in trainer.state.log_history
              if "loss_scale/scale" in e]
    assert logged == [(4, 1), (8, 1)]
    saved = json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    scales = [(e["step"], e["loss_scale/scale"]) for e in saved if "loss_scale/scale" in e]
    assert scales == [(4, 512.0), (8, 2048.0)]  # 1024, backed off at step 2, grown at 5 and 8


def test_the_summary_starts_on_a_line_of_its_own_after_the_progress_bar(tmp_path):
    """Issue 30: the summary was printed on the line of tqdm's finished progress bar."""
    trainer = tiny.trainer(str(tmp_path), max_steps=4, report_to=[], disable_tqdm=False)
    callback_for("ours").attach(trainer)
    terminal = io.StringIO()  # stdout and stderr on one terminal, as a user sees them
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
        trainer.train()
    lines = re.split(r"[\r\n]", terminal.getvalue())
    assert "4/4" in terminal.getvalue()  # the bar was drawn
    assert any(line.startswith("Loss scaling: 4 optimizer steps") for line in lines), lines


@pytest.mark.slow
def test_resuming_a_stock_scaler_keeps_the_skips_before_the_checkpoint(tmp_path):
    """Issue 30: with Accelerate's GradScaler (no count in scaler.pt) the skip count restarted on resume."""
    full = tiny.trainer(str(tmp_path / "full"), inject_at=INJECT, save_strategy="steps", save_steps=6,
                        report_to=[])
    callback_for("stock", echo=None).attach(full)
    full.train()
    tiny_accelerate.reset_accelerate()
    resumed = tiny.trainer(str(tmp_path / "resumed"), inject_at=INJECT, report_to=[])
    callback = callback_for("stock", echo=None).attach(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-6"))
    assert callback.summary.startswith("Loss scaling: 12 optimizer steps, 3 skipped")


@pytest.mark.slow
def test_taking_over_a_stock_trainer_checkpoint_with_a_policy_counts_on_from_its_step(tmp_path):
    """Issue 30: a stock Trainer checkpoint resumed with policy=: loss_scale/steps restarted at 0."""
    full = tiny.trainer(str(tmp_path / "full"), inject_at=INJECT, save_strategy="steps", save_steps=6,
                        report_to=[])
    lossscale_callbacks.accelerate.install_loss_scaler(
        full.accelerator, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3))
    full.train()
    tiny_accelerate.reset_accelerate()
    record = RecordLogs()
    resumed = tiny.trainer(str(tmp_path / "resumed"), inject_at=INJECT, report_to=[])
    resumed.add_callback(record)
    callback = callback_for("ours", echo=None).attach(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-6"))
    assert record.series("loss_scale/steps") == [(8, 8), (12, 12)]
    assert record.series("loss_scale/skipped_in_interval") == [(8, 0), (12, 1)]
    # The skips before the checkpoint were not saved anywhere: the count says only what it knows.
    assert callback.summary.startswith("Loss scaling: 12 optimizer steps, 1 skipped")
