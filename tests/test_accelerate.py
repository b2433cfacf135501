"""Hugging Face Accelerate: our scaler installed before ``prepare``, and the monitor of a plain loop.

The loops are Accelerate's own (``backward``, ``clip_grad_norm_``, ``accumulate``, a prepared
scheduler, ``save_state``/``load_state``) on the CPU, with overflows injected at known steps; ours
and torch's ``GradScaler`` run in the same place and must agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType, GradScalerKwargs  # noqa: E402
from hf_scripts import tiny_accelerate as tiny  # noqa: E402
from lightning_scripts.host_reads import HostReadCounter  # noqa: E402
from report_json import the_read_run  # noqa: E402

import lossscale_callbacks  # noqa: E402
import lossscale_callbacks.accelerate  # noqa: E402
import lossscale_callbacks.torch  # noqa: E402
from lossscale_callbacks._cli import main as cli_main  # noqa: E402
from lossscale_callbacks._health import ConsecutiveSkips, LossScaleHealthError  # noqa: E402
from lossscale_callbacks._metrics import METRIC_NAMES  # noqa: E402
from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks._sinks import InMemorySink  # noqa: E402
from lossscale_callbacks.accelerate._install import install_loss_scaler  # noqa: E402
from lossscale_callbacks.accelerate._monitor import COUNTS_FILE, AccelerateLossScaleMonitor  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

LIBRARY = tuple(os.path.dirname(m.__file__) for m in (lossscale_callbacks, lossscale_callbacks.accelerate,
                                                        lossscale_callbacks.torch))


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Each test makes its own Accelerator from its own arguments (Accelerate keeps process-wide state)."""
    tiny.reset_accelerate()
    yield
    tiny.reset_accelerate()


def fp16_cpu(**kwargs) -> Accelerator:
    return Accelerator(mixed_precision="fp16", cpu=True, **kwargs)


def linear_and_sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# ------------------------------------------------------------------------------------- installing


def test_on_the_cpu_accelerate_alone_trains_fp16_in_float32_and_the_route_makes_it_real():
    def forward_dtype(accelerator: Accelerator) -> torch.dtype:
        """The dtype a layer inside the prepared model computes in (the model's output is made float32)."""
        layer, _ = linear_and_sgd()
        model = accelerator.prepare(torch.nn.Sequential(layer))
        seen: list[torch.dtype] = []
        layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        assert model(torch.ones(2, 4)).dtype == torch.float32
        return seen[0]

    plain = fp16_cpu()
    assert (plain.scaler, plain.native_amp) == (None, False)  # what Accelerate does by itself on the CPU
    assert forward_dtype(plain) == torch.float32
    tiny.reset_accelerate()
    routed = fp16_cpu()
    scaler = install_loss_scaler(routed)
    assert isinstance(scaler, LossScaler) and routed.scaler is scaler and routed.native_amp
    assert forward_dtype(routed) == torch.float16
    with routed.autocast():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float16


def test_the_default_scaler_takes_the_policy_diagnose_or_gradscalerkwargs():
    policy = DynamicPolicy(initial_scale=256.0, hysteresis=2)
    scaler = install_loss_scaler(fp16_cpu(), policy=policy, diagnose=True)
    assert scaler.policy == policy and scaler.forensics is not None
    tiny.reset_accelerate()
    handler = GradScalerKwargs(init_scale=128.0, growth_interval=7)
    scaler = install_loss_scaler(fp16_cpu(kwargs_handlers=[handler]))
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (128.0, 7)
    tiny.reset_accelerate()
    stock = torch.amp.GradScaler("cpu")
    assert install_loss_scaler(fp16_cpu(), stock) is stock


def test_installing_after_prepare_is_refused_and_changes_nothing():
    accelerator = fp16_cpu()
    accelerator.prepare(*linear_and_sgd())
    with pytest.raises(RuntimeError, match=r"before accelerator\.prepare"):
        install_loss_scaler(accelerator)
    assert (accelerator.scaler, accelerator.native_amp) == (None, False)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scaler": "x"}, r"scaler must be None, a LossScaler or a torch\.amp\.GradScaler, got str"),
    ({"scaler": torch.amp.GradScaler("cpu", enabled=False)}, r"scaler is disabled"),
    ({"scaler": LossScaler("cpu"), "policy": DynamicPolicy()}, r"pass either scaler or policy"),
    ({"scaler": LossScaler("cpu"), "diagnose": True}, r"pass either scaler or diagnose"),
    ({"policy": "dynamic"}, r"policy must be"),
    ({"diagnose": "sometimes"}, r"diagnose"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    accelerator = fp16_cpu()
    with pytest.raises(ValueError, match=message):
        install_loss_scaler(accelerator, **kwargs)
    assert accelerator.scaler is None


def test_a_scaler_for_another_device_or_settings_twice_are_refused():
    class CudaScaler(torch.amp.GradScaler):
        def is_enabled(self) -> bool:  # as on a GPU machine
            return True

    with pytest.raises(ValueError, match=r"made for device 'cuda', but the accelerator runs on 'cpu'"):
        install_loss_scaler(fp16_cpu(), CudaScaler("cuda", enabled=False))
    tiny.reset_accelerate()
    with pytest.raises(ValueError, match=r"pass either policy or a GradScalerKwargs handler"):
        handler = GradScalerKwargs(init_scale=8.0)
        install_loss_scaler(fp16_cpu(kwargs_handlers=[handler]), policy=DynamicPolicy())


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_only_fp16_accelerators_take_a_loss_scaler(precision):
    with pytest.raises(ValueError, match=rf"needs Accelerator\(mixed_precision='fp16'\), got mixed_precision="
                                         rf"'{precision}'"):
        install_loss_scaler(Accelerator(mixed_precision=precision, cpu=True))
    with pytest.raises(ValueError, match=r"accelerator must be an accelerate\.Accelerator, got str"):
        install_loss_scaler("accelerator")


def test_distributed_types_that_scale_themselves_are_refused(monkeypatch):
    accelerator = fp16_cpu()
    deepspeed = property(lambda self: DistributedType.DEEPSPEED)
    monkeypatch.setattr(type(accelerator), "distributed_type", deepspeed)
    with pytest.raises(ValueError, match=r"supports the distributed types NO, MULTI_CPU, MULTI_GPU; this "
                                         r"accelerator runs DEEPSPEED"):
        install_loss_scaler(accelerator)


def test_without_accelerate_the_import_names_the_extra():
    # A fresh interpreter where `import accelerate` fails, as where the package is not installed.
    code = ("import sys; sys.modules['accelerate'] = None\n"
            "try:\n    import lossscale_callbacks.accelerate\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("MissingExtraError lossscale_callbacks.accelerate needs the 'accelerate' package")
    assert 'pip install "lossscale-callbacks[accelerate]"' in out


# ----------------------------------------------------------------- bit-identical to GradScaler

VARIANTS = {
    "plain": {},
    "clip_grad_norm": {"clip": True},
    "accumulate": {"accumulate": 2},
    "accumulate_and_clip": {"accumulate": 2, "clip": True},
}


def both(setup: tiny.Setup, **run_kwargs) -> dict[str, list[tiny.Record]]:
    records = {}
    for kind in ("ours", "stock"):
        tiny.reset_accelerate()
        kind_setup = dataclasses.replace(setup, scaler=kind)
        records[kind], _ = tiny.run(tiny.make_accelerator(kind_setup), kind_setup, **run_kwargs)
    return records


def assert_identical(ours: list[tiny.Record], stock: list[tiny.Record]) -> None:
    assert len(ours) == len(stock) > 0
    for a, b in zip(ours, stock, strict=True):
        assert (a.step, a.scale, a.lr, a.skipped) == (b.step, b.scale, b.lr, b.skipped)
        assert tiny.same_bits(a.params, b.params), a.step


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_our_scaler_is_bit_identical_to_gradscaler_in_the_same_place(variant):
    setup = tiny.Setup(**VARIANTS[variant])
    records = both(setup)
    assert_identical(records["ours"], records["stock"])
    ours = records["ours"]
    # The injected steps, and only those, are skipped: parameters and learning rate are held there.
    assert [r.step for r in ours if r.skipped] == list(setup.inject_at)
    for before, after in itertools.pairwise(ours):
        assert tiny.same_bits(before.params, after.params) == after.skipped
        assert (before.lr == after.lr) == after.skipped
    assert [r.scale for r in ours] == [1024, 1024, 512, 256, 256, 256, 512, 256, 256, 256, 512, 512]


def test_with_a_fused_optimizer_the_skip_is_decided_on_the_device_alike():
    setup = tiny.Setup(fused=True, clip=True)
    records = both(setup)
    ours, stock = records["ours"], records["stock"]
    # The same skips and scales; the same parameters until the first step applied after a skip (4), where
    # the held schedule and the stock one part.
    parted = min(s for s in range(min(setup.inject_at), setup.steps) if s not in setup.inject_at)
    for a, b in zip(ours, stock, strict=True):
        assert (a.step, a.scale, a.skipped) == (b.step, b.scale, b.skipped)
        assert tiny.same_bits(a.params, b.params) == (a.step < parted), a.step
    # The parameters are held on the injected steps, but Accelerate cannot see a skip made on the
    # device (the optimizer's step ran: step_was_skipped stays False, accelerate#4242): with GradScaler
    # the scheduler advances there; ours holds it (install_loss_scaler holds the prepared schedulers).
    held = [after.step for before, after in itertools.pairwise(ours) if tiny.same_bits(before.params,
                                                                                         after.params)]
    assert held == [s for s in setup.inject_at if s > 0]
    assert not any(r.skipped for r in ours) and len({r.lr for r in stock}) == len(stock)
    injected = set(setup.inject_at)
    assert [r.lr for r in ours if r.step not in injected] == [r.lr for r in stock][:len(ours) - len(injected)]
    assert all(after.lr == before.lr for before, after in itertools.pairwise(ours) if after.step in injected)


def test_save_state_and_load_state_resume_bit_identically(tmp_path):
    setup = tiny.Setup(accumulate=2, clip=True)
    full = both(setup, save_at=6, save_dir=str(tmp_path / "checkpoint"))
    for kind in ("ours", "stock"):
        tiny.reset_accelerate()
        kind_setup = dataclasses.replace(setup, scaler=kind)
        # Saved by the run above (ours, then stock overwrote it: resume each from its own save).
        tiny.run(tiny.make_accelerator(kind_setup), kind_setup, save_at=6, save_dir=str(tmp_path / kind))
        tiny.reset_accelerate()
        resumed, monitor = tiny.run(tiny.make_accelerator(kind_setup), kind_setup, first=6,
                                    resume_from=str(tmp_path / kind))
        assert_identical(resumed, full[kind][6:])
        # The monitor resumed its counts from its own file (for GradScaler, which checkpoints no skips, too).
        assert monitor.summary.startswith("Loss scaling: 12 optimizer steps, 3 skipped (25.00%)")
    assert_identical(full["ours"], full["stock"])
    saved = torch.load(tmp_path / "ours" / "scaler.pt", weights_only=True)
    assert saved["policy"]["initial_scale"] == tiny.INITIAL_SCALE and saved["steps"] == 6


@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_checkpoints_load_with_and_without_the_monitor(tmp_path, kind):
    """Issue 30: register_for_checkpointing(monitor), as the README advised, made checkpoints that a loop
    without the monitor could not load, and the reverse. The monitor's counts now ride in their own file."""
    setup = tiny.Setup(scaler=kind, steps=6)
    tiny.reset_accelerate()
    tiny.run(tiny.make_accelerator(setup), setup, save_at=6, save_dir=str(tmp_path / "with"))
    assert json.loads((tmp_path / "with" / COUNTS_FILE).read_text())["skipped_steps"] == 2  # steps 2, 3
    tiny.reset_accelerate()
    plain = tiny.make_accelerator(setup)  # a loop without the monitor loads it
    plain.prepare(*tiny.model_and_data())
    plain.load_state(str(tmp_path / "with"))
    plain.save_state(str(tmp_path / "without"))  # ... and saves one without the counts
    assert not (tmp_path / "without" / COUNTS_FILE).exists()
    tiny.reset_accelerate()
    longer = dataclasses.replace(setup, steps=8)
    _, monitor = tiny.run(tiny.make_accelerator(longer), longer, first=6,
                          resume_from=str(tmp_path / "without"))
    assert monitor.summary.startswith("Loss scaling: 8 optimizer steps" if kind == "ours"
                                      else "Loss scaling: 2 optimizer steps")  # a stock scaler kept no count


def test_bad_saved_counts_are_refused_naming_the_file_and_field(tmp_path):
    setup = tiny.Setup(scaler="stock", steps=2)
    tiny.reset_accelerate()
    tiny.run(tiny.make_accelerator(setup), setup, save_at=2, save_dir=str(tmp_path))
    saved = json.loads((tmp_path / COUNTS_FILE).read_text())
    (tmp_path / COUNTS_FILE).write_text(json.dumps({**saved, "skipped_steps": 5}))
    tiny.reset_accelerate()
    with pytest.raises(ValueError, match=r"loss_scale_counts.json: .*skipped_steps"):
        tiny.run(tiny.make_accelerator(setup), setup, first=2, resume_from=str(tmp_path))


# ------------------------------------------------------------------------------------ monitor


def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the one TensorBoard run under ``folder``, read with TensorBoard's own reader:
    ``SummaryWriter``'s (Accelerate's tracker) as scalars, our sink's as float32 tensors."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    (run,) = {os.path.dirname(f) for f in glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"),
                                                    recursive=True)}
    acc = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        if events and events[0].tensor_proto.dtype == 1:  # DT_FLOAT: a scalar (texts are strings)
            series[tag] = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events]
    return series


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_the_monitor_writes_to_the_trackers_and_report_reads_them(tmp_path, kind, capsys):
    setup = tiny.Setup(scaler=kind, log_every=4,
                       monitor_kwargs={"tensorboard": str(tmp_path / "ours_tb"), "echo": print})
    accelerator = tiny.make_accelerator(setup, log_with="tensorboard", project_dir=str(tmp_path / "tracked"))
    accelerator.init_trackers("run")
    records, monitor = tiny.run(accelerator, setup)
    accelerator.end_training()
    scales = {r.step + 1: r.scale for r in records}
    skipped = {r.step + 1: sum(s.skipped for s in records[:r.step + 1]) for r in records}
    for folder in ("tracked", "ours_tb"):
        series = read_scalars(str(tmp_path / folder))
        assert set(METRIC_NAMES) <= set(series)
        assert series["loss_scale/scale"] == [(s, scales[s]) for s in (4, 8, 12)]
        assert series["loss_scale/skipped_steps"] == [(s, skipped[s]) for s in (4, 8, 12)]
        assert series["loss_scale/steps"] == [(4, 4), (8, 8), (12, 12)]
    assert monitor.summary.startswith("Loss scaling: 12 optimizer steps, 3 skipped (25.00%)")
    assert monitor.summary in capsys.readouterr().out
    for folder in ("tracked", "ours_tb"):
        assert cli_main(["report", str(tmp_path / folder), "--json"]) == 0
        payload = the_read_run(capsys.readouterr().out)
        assert (payload["steps"], payload["skipped_steps"], payload["final_scale"]) == (12, 3, 512.0)


def test_the_summary_reaches_the_tensorboard_tracker_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    setup = tiny.Setup(steps=4, log_every=2)
    accelerator = tiny.make_accelerator(setup, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    tiny.run(accelerator, setup)
    accelerator.end_training()
    (run,) = {os.path.dirname(f) for f in glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"),
                                                    recursive=True)}
    acc = EventAccumulator(run)
    acc.Reload()
    texts = set(acc.Tags()["tensors"])
    assert {"loss_scale/summary/text_summary", "loss_scale/policy/text_summary"} <= texts


@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_the_scaler_is_read_once_per_interval_and_never_in_a_step(kind):
    setup = tiny.Setup(scaler=kind, steps=8, log_every=4, inject_at=(3,))
    accelerator = tiny.make_accelerator(setup)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    # A fused optimizer: the scalers themselves decide on the device, so every read counted is the monitor's.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=4, trackers=False, echo=None)
    with HostReadCounter(only_under=LIBRARY) as counter:
        for step in range(8):
            accelerator.backward(model(torch.randn(4, 8)).float().pow(2).mean())
            if step == 3:
                model.weight.grad.view(-1)[0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    where = "_stock.py" if kind == "stock" else "_update_paths.py"
    # one copy: .cpu(), then numpy (no sync) for our scaler, tolist for the stock one
    read = [("cpu", where), ("tolist" if kind == "stock" else "numpy", where)]
    assert counter.reads == read * 2
    assert monitor.loop.last.skipped_steps == 1 and monitor.loop.last.step == 8


def test_accumulation_steps_are_not_counted_and_the_log_step_is_used():
    memory = InMemorySink()
    setup = tiny.Setup(accumulate=3, steps=6, log_every=2, inject_at=(),
                       monitor_kwargs={"sinks": [memory], "trackers": False})
    _, monitor = tiny.run(tiny.make_accelerator(setup), setup)
    assert [s for s, _ in memory.series("loss_scale/steps")] == [2, 4, 6]
    tiny.reset_accelerate()
    accelerator = fp16_cpu()
    install_loss_scaler(accelerator)
    model, optimizer = accelerator.prepare(*linear_and_sgd())
    memory = InMemorySink()
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=1, sinks=[memory], echo=None)
    accelerator.backward(model(torch.ones(2, 4)).float().mean())
    optimizer.step()
    monitor.step(log_step=40)  # the step of the user's own accelerator.log calls
    assert memory.series("loss_scale/steps") == [(40, 1.0)]
    monitor.step(log_step=41)  # no optimizer step in between: our scaler's own count is the truth
    assert memory.series("loss_scale/steps") == [(40, 1.0)]


def test_a_stop_rule_sets_should_stop_and_a_raise_rule_raises():
    rule = ConsecutiveSkips(limit=2, action="stop")
    setup = tiny.Setup(steps=8, log_every=1, inject_at=(1, 2, 3), monitor_kwargs={"health": [rule]})
    with pytest.warns(UserWarning, match="skipped"):
        _, monitor = tiny.run(tiny.make_accelerator(setup), setup)
    assert monitor.should_stop
    tiny.reset_accelerate()
    setup.monitor_kwargs = {"health": [ConsecutiveSkips(limit=2, action="raise")]}
    with pytest.raises(LossScaleHealthError, match="skipped"):
        tiny.run(tiny.make_accelerator(setup), setup)


def train_with_an_overflow_at_step_1(accelerator: Accelerator, model: torch.nn.Module, optimizer,
                                     monitor: AccelerateLossScaleMonitor, steps: int) -> None:
    for step in range(steps):
        accelerator.backward(model(torch.ones(2, 4)).float().sum())
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()


def test_diagnose_names_the_layer_in_the_summary():
    accelerator = fp16_cpu()
    model, optimizer = linear_and_sgd()
    install_loss_scaler(accelerator, policy=DynamicPolicy(initial_scale=64.0), diagnose=True).watch(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    memory = InMemorySink()
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=2, sinks=[memory], trackers=False, echo=None)
    train_with_an_overflow_at_step_1(accelerator, model, optimizer, monitor, steps=4)
    assert memory.series("loss_scale/skips/grad_inf")[0] == (2, 1.0)
    assert "Linear" in monitor.finish() and "Forensics:" in monitor.summary


def test_monitor_arguments_and_missing_scaler_are_refused():
    accelerator = fp16_cpu()
    with pytest.raises(ValueError, match=r"found no enabled loss scaler.*install_loss_scaler\(accelerator\)"):
        AccelerateLossScaleMonitor(accelerator)
    install_loss_scaler(accelerator)
    for kwargs, message in [({"log_every": 0}, "log_every"), ({"trackers": 1}, "trackers"),
                            ({"tensorboard": ""}, "tensorboard"), ({"sinks": None}, "sinks"),
                            ({"wandb": "yes"}, "wandb"), ({"health": "loud"}, "health")]:
        with pytest.raises(ValueError, match=message):
            AccelerateLossScaleMonitor(accelerator, **kwargs)
    with pytest.raises(ValueError, match=r"accelerator must be an accelerate\.Accelerator"):
        AccelerateLossScaleMonitor(None)
    monitor = AccelerateLossScaleMonitor(accelerator, echo=None)
    with pytest.raises(RuntimeError, match=r"has not scaled any loss yet"):
        monitor.step()  # no loss scaled yet: no optimizer step can have happened
    model, optimizer = accelerator.prepare(*linear_and_sgd())
    accelerator.backward(model(torch.ones(2, 4)).float().mean())
    optimizer.step()
    with pytest.raises(ValueError, match="log_step"):
        monitor.step(log_step=-1)


def trained_monitor(scaler: torch.amp.GradScaler, steps: int) -> AccelerateLossScaleMonitor:
    accelerator = fp16_cpu()
    install_loss_scaler(accelerator, scaler)
    model, optimizer = accelerator.prepare(*linear_and_sgd())
    monitor = AccelerateLossScaleMonitor(accelerator, log_every=100, trackers=False, echo=None)
    train_with_an_overflow_at_step_1(accelerator, model, optimizer, monitor, steps)
    return monitor


@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_load_state_dict_checks_everything_before_it_changes_anything(kind):
    make = (lambda: LossScaler("cpu", init_scale=64.0)) if kind == "ours" else (
        lambda: torch.amp.GradScaler("cpu", init_scale=64.0))
    saved = trained_monitor(make(), 3).state_dict()
    assert saved["steps"] == 3 and (kind == "ours" or saved["stock"] == {"steps": 3, "skipped_steps": 1})
    tiny.reset_accelerate()
    monitor = trained_monitor(make(), 0)
    before = monitor.state_dict()
    bad_scale = {**saved, "scaler": {**saved["scaler"], "scale": float("nan")}}
    for state, message in [({**saved, "extra": 1}, "unknown"), ({**saved, "steps": 7}, "disagrees"),
                           (bad_scale, "scale"), ({**saved, "steps": True}, "steps")]:
        with pytest.raises(ValueError, match=message):
            monitor.load_state_dict(state)
        assert monitor.state_dict() == before  # nothing was loaded
    monitor.load_state_dict(saved)
    assert monitor.state_dict() == saved
    # The baseline: the next interval covers only its own steps.
    assert (monitor.loop.last.step, monitor.loop.last.skipped_steps) == (3, 1)
