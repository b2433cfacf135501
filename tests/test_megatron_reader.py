"""Megatron-Core's own grad scaler read by ``MegatronScalerReader``: the DeepSpeed reader's tests, for it.

Megatron-Core's ``DynamicGradScaler`` makes its tensors on CUDA (``device='cuda'`` in its
constructor), so on this CPU the reader is tested against a recording of megatron-core 0.16.1's
``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py). How the recording was made (and is
re-made by the first test wherever megatron-core is installed): the installed class (its file loaded
by path, without the rest of Megatron-Core), its module's ``torch.tensor`` redirected to the CPU
(nothing else changed), ``DynamicGradScaler(initial_scale=1024,
min_scale=1, growth_factor=2, backoff_factor=0.5, growth_interval=3, hysteresis=2)``, then
``update(found_inf)`` for each overflow below, recording ``(float(_scale), _growth_tracker,
_hysteresis_tracker)`` after each. megatron-core 0.16.1 installs in seconds with only numpy, packaging
and torch, so it is in the dev extra (Python < 3.12; 0.17+ needs 3.12); the test skips without it.
Runtime: about 3 s (the LoggingLoop end-to-end test included).
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks._update import initial_state, next_state  # noqa: E402
from lossscale_callbacks.torch import ScalerReader  # noqa: E402
from lossscale_callbacks.torch._megatron_reader import MegatronScalerReader  # noqa: E402

OVERFLOWS = [False, True, True, False, False, False, False, True, False]
# (scale, _growth_tracker, _hysteresis_tracker) after update(found_inf), megatron-core 0.16.1.
RECORDED = [(1024.0, 1, 2), (1024.0, 0, 1), (512.0, 0, 0), (512.0, 1, 0), (512.0, 2, 0), (1024.0, 0, 2),
            (1024.0, 1, 2), (1024.0, 0, 1), (1024.0, 1, 1)]
SETTINGS = {"growth_interval": 3, "hysteresis": 2}
FACTORS = {"growth_factor": 2.0, "backoff_factor": 0.5, "min_scale": 1.0}
# Hysteresis 2: the first overflow (step 1) only spends it, the second (step 2) halves the scale.
# Growth: after growth_interval good steps (3-5), the trackers reset.
SKIPPED = [0, 1, 2, 2, 2, 2, 2, 3, 3]


class _Recorded(SimpleNamespace):
    """A DynamicGradScaler's attributes at one step of the recording (CPU tensors where Megatron has CUDA)."""

    @property
    def inv_scale(self):
        return self._scale.double().reciprocal().float()


def _recorded_scaler(step: int) -> _Recorded:
    scale, growth, hysteresis = RECORDED[step]
    return _Recorded(_scale=torch.tensor([scale]), _growth_tracker=growth, _hysteresis_tracker=hysteresis,
                     **SETTINGS, **{k: torch.tensor([v]) for k, v in FACTORS.items()})


class _CpuTorch:
    """The torch module with tensors made on the CPU: Megatron's scaler asks for device='cuda'."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **{**kwargs, "device": "cpu"})


def _installed_grad_scaler_module():
    """megatron-core's grad_scaler.py, loaded from the installed package by its path: importing it as
    megatron.core.optimizer.grad_scaler would first run megatron.core's __init__, which takes tens of
    seconds to import the rest of Megatron-Core; the file itself needs only torch."""
    spec = importlib.util.find_spec("megatron")
    folder = next(iter(spec.submodule_search_locations or ()), None) if spec else None
    path = os.path.join(folder, "core", "optimizer", "grad_scaler.py") if folder else None
    if path is None or not os.path.exists(path):
        pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)")
    module_spec = importlib.util.spec_from_file_location("installed_megatron_grad_scaler", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_the_recording_is_what_the_installed_megatron_core_does(monkeypatch):
    grad_scaler = _installed_grad_scaler_module()
    monkeypatch.setattr(grad_scaler, "torch", _CpuTorch())
    scaler = grad_scaler.DynamicGradScaler(initial_scale=1024, min_scale=1, growth_factor=2.0,
                                           backoff_factor=0.5, growth_interval=3, hysteresis=2)
    optimizer = SimpleNamespace(grad_scaler=scaler)  # where MixedPrecisionOptimizer keeps it
    reader = MegatronScalerReader(optimizer)
    for step, overflow in enumerate(OVERFLOWS):
        scaler.update(overflow)
        reader.after_optimizer_step()
        assert (float(scaler._scale), scaler._growth_tracker, scaler._hysteresis_tracker) == RECORDED[step]
        assert reader.read()["skipped_steps"] == SKIPPED[step]
    assert {k: getattr(scaler, k) for k in SETTINGS} == SETTINGS
    assert {k: float(getattr(scaler, k)) for k in FACTORS} == FACTORS
    assert reader.policy() == DynamicPolicy(initial_scale=1024.0, growth_interval=3, hysteresis=2,
                                            growth_factor=2.0, backoff_factor=0.5, min_scale=1.0,
                                            max_scale=2.0**24)


def test_the_recording_is_the_cores_update_rule():
    """Megatron's hysteresis is the core's: the same states, step by step."""
    policy = DynamicPolicy(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    state = initial_state(policy)
    for step, overflow in enumerate(OVERFLOWS):
        state = next_state(policy, state, not overflow)
        assert (float(state.scale), int(state.growth_counter), int(state.hysteresis_left)) == RECORDED[step]


def test_reader_follows_a_bare_grad_scaler_step_by_step():
    holder = SimpleNamespace(grad_scaler=_recorded_scaler(0))
    holder.grad_scaler._hysteresis_tracker = SETTINGS["hysteresis"]  # before the first step
    reader = MegatronScalerReader(holder)  # the reader counts steps and skips
    states = []
    for step in range(len(OVERFLOWS)):
        holder.grad_scaler = _recorded_scaler(step)
        reader.after_optimizer_step()
        states.append(reader.read())
    assert [s["scale"] for s in states] == [r[0] for r in RECORDED]
    assert [s["growth_counter"] for s in states] == [r[1] for r in RECORDED]
    assert [s["hysteresis_left"] for s in states] == [max(r[2], 0) for r in RECORDED]
    assert [s["skipped_steps"] for s in states] == SKIPPED
    assert [s["steps"] for s in states] == list(range(1, 10))
    grew = [i for i in range(1, 9) if states[i]["scale"] > states[i - 1]["scale"]]
    assert grew == [5] and states[4]["growth_counter"] == SETTINGS["growth_interval"] - 1


def test_reader_takes_the_callers_skips_and_follows_a_replaced_scaler():
    optimizer = SimpleNamespace(grad_scaler=_recorded_scaler(2))
    reader = MegatronScalerReader(optimizer)
    for skipped in (False, True, True):  # optimizer.step()'s update_successful, negated
        reader.after_optimizer_step(skipped=skipped)
    assert reader.read() == {"scale": 512.0, "growth_counter": 0, "hysteresis_left": 0, "skipped_steps": 2,
                             "steps": 3}
    # A checkpoint load gives the optimizer a new scale tensor (load_state_dict): looked up each time.
    optimizer.grad_scaler = _recorded_scaler(8)
    assert reader.read()["scale"] == 1024.0
    chained = SimpleNamespace(chained_optimizers=[optimizer, SimpleNamespace()])
    assert MegatronScalerReader(chained).read()["growth_counter"] == 1


def test_policy_reflects_the_megatron_settings():
    policy = MegatronScalerReader(_recorded_scaler(2)).policy()
    assert isinstance(policy, DynamicPolicy)
    settings = (policy.growth_interval, policy.hysteresis, policy.min_scale, policy.growth_factor)
    assert settings == (3, 2, 1.0, 2.0)
    constant = _Recorded(_scale=torch.tensor([128.0]))  # ConstantGradScaler: no trackers
    assert MegatronScalerReader(constant).policy() == FixedPolicy(128.0)
    assert MegatronScalerReader(constant).read()["growth_counter"] == 0


def test_reader_refuses_what_has_no_grad_scaler():
    with pytest.raises(ValueError, match="source"):
        MegatronScalerReader(SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1)))
    with pytest.raises(ValueError, match="source"):  # torch's GradScaler has `_scale` but is no Megatron one
        MegatronScalerReader(torch.amp.GradScaler("cpu"))


def test_the_logging_loop_logs_a_megatron_optimizers_scaler(tmp_path):
    """ScalerReader (what every monitor uses) on a Megatron optimizer, into LoggingLoop and TensorBoard."""
    pytest.importorskip("tensorboard")
    from lossscale_callbacks.loop._logging_loop import LoggingLoop
    from lossscale_callbacks.report._report_cli import judge_run
    from lossscale_callbacks.report._run_readers import discover_runs

    optimizer = SimpleNamespace(grad_scaler=_recorded_scaler(0))
    optimizer.grad_scaler._hysteresis_tracker = SETTINGS["hysteresis"]
    reader = ScalerReader(optimizer)
    assert reader.kind == "megatron" and reader.policy.hysteresis == 2
    loop = LoggingLoop(reader.policy, tensorboard=str(tmp_path), log_every=1, health=None, echo=None)
    for step in range(len(OVERFLOWS)):
        optimizer.grad_scaler = _recorded_scaler(step)  # what optimizer.step() does to its scaler
        reader.after_optimizer_step()
        loop.maybe_observe(reader.steps, reader.read)
    loop.finish(reader.read())
    loop.close()
    (found,) = discover_runs(str(tmp_path))
    report = judge_run(found).report
    assert [v for _, v in report.series["loss_scale/scale"]] == [r[0] for r in RECORDED]
    assert [v for _, v in report.series["loss_scale/skipped_steps"]] == SKIPPED
    assert report.steps == 9 and report.skipped_steps == 3
    with pytest.raises(ValueError, match="checkpointed by Megatron itself"):
        reader.state_dict()
