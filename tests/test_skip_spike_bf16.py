"""Skip truth beyond fp16 overflows: the opt-in loss-spike rule, and bf16 runs (skip, or monitoring only)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import skip_runs as sr  # noqa: E402
from aten_ops import AtenOps  # noqa: E402

from lossscale_callbacks import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.skips._spike import SpikeRule, check_spike, spike_decisions  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402
from lossscale_callbacks.torch._spike import SpikeWindow  # noqa: E402

SPIKE_AT = 60
CLEAN_STEPS = 500


def _problem(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.3 * torch.randn(32, 1, generator=g)


def _spike_run(scaler: LossScaler, optimizer: str, spikes=(SPIKE_AT,), norm_spikes=(), inject=(),
               steps: int = CLEAN_STEPS):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{optimizer: True})
    losses = []
    for step in range(1, steps + 1):
        x, y = _problem(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * (10.0 if step in spikes else 1.0)
        if step in norm_spikes:  # the gradient 1000x, the loss value unchanged
            loss = loss + 1000.0 * (model.weight - model.weight.detach()).sum()
        losses.append(float(loss.detach()))
        scaler.scale(loss).backward()
        if step in inject:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return model, opt, losses


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_a_tenfold_loss_is_skipped_as_a_spike_and_nothing_else_of_500_steps_is(optimizer):
    scaler = LossScaler(device="cpu", init_scale=2.0**10, spike=SpikeRule(sigma=6.0, window=128, warmup=20))
    _, opt, losses = _spike_run(scaler, optimizer)
    got = scaler.read_outcomes()
    assert [(o.step, o.cause) for o in got.outcomes] == [(SPIKE_AT, "spike")]
    assert got.counts == {"overflow": 0, "nonfinite": 0, "spike": 1, "applied_nonfinite": 0}
    assert got.applied == CLEAN_STEPS - 1
    assert {int(s["step"]) for s in opt.state.values()} == {CLEAN_STEPS - 1}
    # Not an overflow: nothing counted as skipped for the scale, which never backed off.
    state = scaler.get_state()
    assert state.skipped_steps == 0 and state.scale == 2.0**10
    # The device decisions are the NumPy reference's, step by step (skipped values out of the window).
    assert spike_decisions(losses, scaler.spike_rule) == [s == SPIKE_AT for s in range(1, CLEAN_STEPS + 1)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), window=st.integers(2, 12), warmup_at=st.floats(0, 1),
       sigma=st.floats(0.5, 6.0), grad_norm=st.booleans(), micro=st.integers(1, 3))
def test_the_device_window_decides_as_the_numpy_reference(seed, window, warmup_at, sigma, grad_norm, micro):
    """Any rule, any run: spikes, steps skipped for another reason (their values stay out), the warm-up,
    a window turning over, micro-batch losses averaged; decision for decision as ``spike_decisions``."""
    warmup = 2 + round(warmup_at * (window - 2))
    rule = SpikeRule(sigma=sigma, window=window, warmup=warmup, grad_norm=grad_norm)
    rng = np.random.default_rng(seed)
    steps = 4 * window + 10
    jumps = np.where(rng.random((steps, 1, 2)) < 0.1, 20.0, 1.0)
    parts = rng.normal(1.0, 0.1, size=(steps, micro, 2)) * jumps
    skipped = rng.random(steps) < 0.15
    device = SpikeWindow(rule, torch.device("cpu"))
    got = []
    for step in range(steps):
        for loss in parts[step, :, 0]:
            device.note_loss(torch.tensor(loss, dtype=torch.float32))
        norm = torch.tensor(parts[step, 0, 1], dtype=torch.float64) if grad_norm else None
        spike = device.decide(norm)
        got.append(bool(spike))
        device.commit(torch.tensor(not (got[-1] or skipped[step])))
    # The reference sees what the device judged: the float32 losses' mean, the norm.
    losses = parts[:, :, 0].astype(np.float32).astype(np.float64).mean(axis=1)
    values = np.stack([losses, parts[:, 0, 1]], axis=1) if grad_norm else losses
    assert got == spike_decisions(values.tolist(), rule, skipped.tolist())


def test_without_the_rule_the_tenfold_loss_is_applied():
    scaler = LossScaler(device="cpu", init_scale=2.0**10)
    _, opt, _ = _spike_run(scaler, "fused")
    assert scaler.read_outcomes().outcomes == () and {int(s["step"]) for s in opt.state.values()} == {500}


def test_the_gradient_norm_window_and_an_overflow_at_a_spike():
    rule = SpikeRule(window=64, warmup=20, grad_norm=True)
    scaler = LossScaler(device="cpu", init_scale=2.0**10, spike=rule)
    model, opt, _ = _spike_run(scaler, "fused", spikes=(90,), norm_spikes=(150,), inject=(90, 200), steps=250)
    got = scaler.read_outcomes()
    # Step 90: a spike and an Inf: the overflow is the cause; 150: the norm alone; 200: an overflow.
    assert [(o.step, o.cause) for o in got.outcomes] == [(90, "overflow"), (150, "spike"), (200, "overflow")]
    assert got.counts["spike"] == 1 and got.counts["overflow"] == 2 and scaler.get_state().skipped_steps == 2
    assert opt.state[model.weight]["step"] == 247


def test_a_spike_is_a_clean_step_for_the_scale():
    """The scale rule sees the gradients: a spike skip grows the scale like an applied step."""
    policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=30)
    with_rule = LossScaler(device="cpu", policy=policy, spike=SpikeRule(window=16, warmup=8))
    without = LossScaler(device="cpu", policy=policy)
    _spike_run(with_rule, "fused", spikes=(25,), steps=40)
    _spike_run(without, "fused", spikes=(25,), steps=40)
    assert with_rule.get_state() == without.get_state()
    assert with_rule.read_outcomes().skipped_steps == (25,)


def test_spike_rule_arguments_and_pickles():
    assert check_spike("spike", True) == SpikeRule() and check_spike("spike", None) is None
    with pytest.raises(ValueError, match="spike must be"):
        check_spike("spike", 6)
    with pytest.raises(ValueError, match="warmup"):
        SpikeRule(window=10, warmup=11)
    with pytest.raises(ValueError, match="sigma"):
        SpikeRule(sigma=0)
    scaler = pickle.loads(pickle.dumps(LossScaler(device="cpu", spike=SpikeRule(window=9, warmup=3))))
    assert scaler.spike_rule == SpikeRule(window=9, warmup=3)
    with pytest.raises(ValueError, match="spike"):
        SpikeRule.from_config({"sigma": 1, "bogus": 2})


# ------------------------------------------------------------------------------------------------ bf16


def _bf16_run(scaler: LossScaler, optimizer: str):
    """100 bf16 steps; an Inf gradient at 3, 17, 42 on a parameter the forward pass does not use (so an
    applied Inf poisons that parameter only, and the other steps stay finite)."""
    model = sr.make_model()
    dead = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([*model.parameters(), dead], lr=1e-3, **{optimizer: True})
    for step in range(1, sr.STEPS + 1):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(sr.batch(step)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in sr.INJECTED:
            dead.grad = torch.tensor([float("inf"), 0.0, 0.0])
        scaler.step(opt)
        scaler.update()
    return opt, dead


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_bf16_at_a_fixed_scale_of_one_skips_the_nonfinite_steps(optimizer):
    scaler = LossScaler(device="cpu", policy=FixedPolicy(1.0))
    _, dead = _bf16_run(scaler, optimizer)
    got = scaler.read_outcomes()
    assert got.skipped_steps == sr.INJECTED and got.applied == sr.APPLIED
    assert {o.cause for o in got.outcomes} == {"nonfinite"} and got.counts["nonfinite"] == 3
    assert torch.isfinite(dead).all()


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_bf16_monitoring_only_applies_and_reports_the_nonfinite_steps(optimizer):
    scaler = LossScaler(device="cpu", policy=FixedPolicy(1.0), skip_nonfinite=False)
    _, dead = _bf16_run(scaler, optimizer)
    got = scaler.read_outcomes()
    assert [(o.step, o.cause) for o in got.outcomes] == [(s, "applied_nonfinite") for s in sr.INJECTED]
    assert got.counts["applied_nonfinite"] == 3 and got.skipped == 0 and got.applied == sr.STEPS
    assert not torch.isfinite(dead).all()  # applied: the Inf went in, as monitoring only means
    assert scaler.get_state().skipped_steps == 0


def test_monitoring_only_reads_nothing_in_the_step_and_needs_a_scale_of_one():
    scaler = LossScaler(device="cpu", policy=FixedPolicy(1.0), skip_nonfinite=False)
    model = sr.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # non-fused: a skipping scaler would read
    for _ in range(3):
        scaler.scale(model(sr.batch(1)).sum()).backward()
        with AtenOps() as ops:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        assert "_local_scalar_dense" not in ops.names
    with pytest.raises(ValueError, match="skip_nonfinite=False"):
        LossScaler(skip_nonfinite=False)


def _spike_step_ops(spike):
    scaler = LossScaler(device="cpu", init_scale=2.0**10, spike=spike)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for step in range(1, 6):
        x, y = _problem(step)
        opt.zero_grad()
        with AtenOps() as ops:
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
    return ops.names


def test_the_spike_rule_adds_no_host_read_and_a_counted_number_of_ops():
    """On the fused path the rule's decision goes to the kernel on the device: no read; its ops counted."""
    without, with_rule = _spike_step_ops(None), _spike_step_ops(SpikeRule())
    assert "_local_scalar_dense" not in with_rule and "item" not in with_rule
    added = len(with_rule) - len(without)
    assert added == SPIKE_OPS, (added, with_rule)


# The spike rule's ops in a fused step (the loss noted, the decision, merging it into the flag, the code for
# the record, the window's update): the figure the docs and the benchmark quote.
SPIKE_OPS = 16
