"""FabricLossScaleMonitor's doors (issue 24): what its constructor, step() and load_state_dict let in.

Each case was open on main at 52cfc0a: a stock GradScaler loaded a NaN, 0 or negative scale unchecked, a
``"bf16-mixed"`` plugin took an fp16 state, unknown keys were ignored, step counts that disagree with the
scaler's were kept, ``step()`` before ``fabric.setup`` counted phantom steps, the loop kept judging
against the old policy, and ``FabricLossScaleMonitor(None)`` was an ``AttributeError``.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks._sinks import InMemorySink  # noqa: E402
from lossscale_callbacks.lightning.fabric import FabricLossScaleMonitor, LossScaleFabricPlugin  # noqa: E402

POLICY = DynamicPolicy(initial_scale=2.0**10, growth_interval=3)


def _fabric(plugin):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.launch()
    return fabric


def _stock_plugin():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0,
                                                                        growth_interval=3))


def _run(fabric, monitor, steps, inject=()):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(steps):
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(3, 4)).float().pow(2).mean())
        if step in inject:
            model.weight.grad[0, 0] = math.inf
        optimizer.step()
        monitor.step()
    return monitor


def _unchanged(monitor):
    scaler = monitor.scaler
    state = scaler.state_dict()
    return (monitor.reader.steps, state, monitor.loop.policy, monitor.loop.last)


@pytest.mark.parametrize("scale", [math.nan, 0.0, -1024.0])
def test_a_stock_grad_scaler_state_goes_through_the_state_gate(scale):
    fabric = _fabric(_stock_plugin())
    monitor = _run(fabric, FabricLossScaleMonitor(fabric, log_every=1, health=None), 3, inject=(1,))
    saved = monitor.state_dict()
    before = _unchanged(monitor)
    for bad in ({**saved, "scaler": {**saved["scaler"], "scale": scale}},
                {**saved, "scaler": {**saved["scaler"], "_growth_tracker": -1}}):
        with pytest.raises(ValueError, match=r"scale|growth_counter"):
            monitor.load_state_dict(bad)
        assert _unchanged(monitor) == before  # the GradScaler never saw it
    assert monitor.scaler.get_scale() > 0


def test_an_fp16_state_is_refused_by_a_bf16_plugin_with_what_to_do():
    fp16 = _fabric(LossScaleFabricPlugin(device="cpu", policy=POLICY))
    saved = _run(fp16, FabricLossScaleMonitor(fp16, health=None), 2).state_dict()
    bf16 = _fabric(LossScaleFabricPlugin("bf16-mixed", device="cpu"))
    monitor = FabricLossScaleMonitor(bf16, health=None)
    before = _unchanged(monitor)
    with pytest.raises(ValueError, match=r"bf16-mixed.*resume it with precision='16-mixed'"):
        monitor.load_state_dict(saved)
    assert _unchanged(monitor) == before and monitor.scaler.get_scale() == 1.0


@pytest.mark.parametrize("change, match", [
    (lambda s: {**s, "extra": 1}, "unknown"),
    (lambda s: {**s, "scaler": "x"}, "scaler must be"),
    (lambda s: {**s, "steps": 10**9}, "disagrees"),
    (lambda s: {**s, "steps": 3}, "disagrees"),
    (lambda s: {**s, "steps": True}, "steps"),
    (lambda s: {k: v for k, v in s.items() if k != "steps"}, "missing"),
])
@pytest.mark.parametrize("stock", [False, True])
def test_unknown_keys_and_disagreeing_steps_are_refused_whole(stock, change, match):
    def plugin():
        return _stock_plugin() if stock else LossScaleFabricPlugin(device="cpu", policy=POLICY)

    first = _fabric(plugin())
    saved = _run(first, FabricLossScaleMonitor(first, health=None), 20).state_dict()
    fabric = _fabric(plugin())
    monitor = _run(fabric, FabricLossScaleMonitor(fabric, log_every=1, health=None), 2)
    before = _unchanged(monitor)
    with pytest.raises(ValueError, match=match):
        monitor.load_state_dict(change(saved))
    assert _unchanged(monitor) == before


def test_step_before_the_scaler_scaled_anything_is_an_error_not_a_phantom_step():
    fabric = _fabric(LossScaleFabricPlugin(device="cpu", policy=POLICY))
    monitor = FabricLossScaleMonitor(fabric, log_every=1, health=None)
    with pytest.raises(RuntimeError, match=r"has not scaled any loss yet.*fabric\.setup"):
        monitor.step()
    assert monitor.state_dict()["steps"] == 0 and monitor.reader.steps == 0
    stock = _fabric(_stock_plugin())
    with pytest.raises(RuntimeError, match="has not scaled any loss yet"):
        FabricLossScaleMonitor(stock, health=None).step()


def test_the_loop_judges_against_the_loaded_policy():
    other = DynamicPolicy(initial_scale=2.0**12, growth_interval=7, min_scale=4.0)
    first = _fabric(LossScaleFabricPlugin(device="cpu", policy=other))
    saved = _run(first, FabricLossScaleMonitor(first, health=None), 4).state_dict()
    fabric = _fabric(LossScaleFabricPlugin(device="cpu", policy=POLICY))
    memory = InMemorySink()
    monitor = FabricLossScaleMonitor(fabric, log_every=1, sinks=[memory])
    monitor.load_state_dict(saved)
    assert monitor.loop.policy == other and monitor.loop.tracker.min_scale == 4.0
    decreasing = next(r for r in monitor.loop.health.rules if type(r).__name__ == "ScaleOnlyDecreases")
    assert decreasing.min_steps == 14  # two of the loaded policy's growth intervals, not of POLICY's
    _run(fabric, monitor, 1)
    assert memory.records[-1][0] == 5 and memory.records[-1][1]["loss_scale/steps"] == 5
    assert "| growth_interval | 7 |" in [md for tag, md in memory.texts if tag == "loss_scale/policy"][-1]


@pytest.mark.parametrize("fabric", [None, "fabric", object()])
def test_what_is_not_a_fabric_is_a_value_error_naming_it(fabric):
    with pytest.raises(ValueError, match="fabric must be"):
        FabricLossScaleMonitor(fabric)


def test_monitor_arguments_are_checked_at_construction(tmp_path):
    fabric = _fabric(LossScaleFabricPlugin(device="cpu", policy=POLICY))
    for kwargs, match in [({"sinks": None}, "sinks"), ({"tensorboard": ""}, "tensorboard"),
                          ({"wandb": {"mode": "nonsense"}}, "mode"), ({"log_every": 0}, "log_every"),
                          ({"health": "loud"}, "health")]:
        with pytest.raises(ValueError, match=match):
            FabricLossScaleMonitor(fabric, **kwargs)


@pytest.mark.parametrize("stock", [False, True])
def test_a_stop_rule_sets_should_stop_on_the_fabric_monitor(stock):
    # The health rules' "stop" must reach the user's loop, as Lightning's should_stop does for a Trainer.
    from lossscale_callbacks._health import ConsecutiveSkips

    fabric = _fabric(_stock_plugin() if stock else LossScaleFabricPlugin(device="cpu", policy=POLICY))
    monitor = FabricLossScaleMonitor(fabric, log_every=1, health=[ConsecutiveSkips(limit=2, action="stop")])
    _run(fabric, monitor, 2, inject=(0,))
    assert not monitor.should_stop
    with pytest.warns(UserWarning, match="stopping training"):
        _run(fabric, monitor, 3, inject=(0, 1))
    assert monitor.should_stop


def test_an_unknown_key_in_the_scalers_part_names_the_monitor_and_where():
    fabric = _fabric(LossScaleFabricPlugin(device="cpu", policy=POLICY))
    monitor = _run(fabric, FabricLossScaleMonitor(fabric, log_every=1, health=None), 2)
    saved = monitor.state_dict()
    with pytest.raises(ValueError, match=r"FabricLossScaleMonitor\.load_state_dict: state\['scaler'\]: "
                                         r"unknown key\(s\) \['x'\]"):
        monitor.load_state_dict({**saved, "scaler": {**saved["scaler"], "x": 1}})


@pytest.mark.parametrize("log_every", [None, 0, 1.5, True])
def test_log_every_is_checked_by_the_one_interval_rule(log_every):
    """Issue 30: ``log_every=None`` was accepted and logged nothing until ``finish()``."""
    fabric = _fabric(LossScaleFabricPlugin(policy=POLICY))
    with pytest.raises(ValueError, match="log_every must be an integer in"):
        FabricLossScaleMonitor(fabric, log_every=log_every)
