"""Skip truth, the record: every step applied or skipped with its cause, written on the device, read at the
interval (the interface the bad-step ledger builds on)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aten_ops import AtenOps  # noqa: E402
from lightning_scripts.host_reads import HostReadCounter  # noqa: E402

import lossscale_callbacks  # noqa: E402
import lossscale_callbacks.torch  # noqa: E402
from lossscale_callbacks import DynamicPolicy, FixedPolicy, initial_state, next_state  # noqa: E402
from lossscale_callbacks.skips._outcomes import (  # noqa: E402
    CODES,
    IntervalOutcomes,
    StepOutcome,
    decode_records,
    is_applied,
    nonfinite_cause,
    rule_finite,
    step_code,
)
from lossscale_callbacks.torch._ops import TorchOps  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

INJECTED = (3, 17, 42)
LIBRARY = tuple(os.path.dirname(m.__file__) for m in (lossscale_callbacks, lossscale_callbacks.torch))


# ------------------------------------------------------------------------------------------ the core


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_the_step_code_is_the_same_function_on_numpy_and_torch(skip_nonfinite):
    """The code and the rule's input, written once against Ops: the same values on every backend, for
    every combination (the whole truth table)."""
    torch_ops = TorchOps(torch.device("cpu"))
    for nonfinite in (False, True):
        for spike in (False, True):
            ref = int(step_code(nonfinite, spike, skip_nonfinite))
            got = int(step_code(torch.tensor(nonfinite), torch.tensor(spike), skip_nonfinite, torch_ops))
            assert got == ref
            assert bool(rule_finite(torch.tensor(nonfinite), skip_nonfinite, torch_ops)) == bool(
                rule_finite(nonfinite, skip_nonfinite))
    assert [int(step_code(n, s, skip_nonfinite)) for n, s in
            [(False, False), (True, False), (False, True), (True, True)]] == (
        [0, 1, 2, 1] if skip_nonfinite else [0, 3, 2, 3])


def test_applied_codes_and_the_rules_input():
    assert [bool(is_applied(c)) for c in CODES] == [True, False, False, True]
    # A spike skip is a clean step for the scale; a monitored non-finite step was not skipped.
    assert bool(rule_finite(False)) and not bool(rule_finite(True))
    assert bool(rule_finite(True, skip_nonfinite=False))
    assert nonfinite_cause(DynamicPolicy()) == "overflow" and nonfinite_cause(FixedPolicy(1.0)) == "nonfinite"
    assert nonfinite_cause(FixedPolicy(1024.0)) == "overflow" and nonfinite_cause(None) == "overflow"


def test_decode_keeps_the_newest_records_of_a_wrapped_ring():
    capacity = 3
    rows = [[0.0, 0.0, 0.0] for _ in range(capacity + 1)]
    for k, step in enumerate(range(10, 16)):  # 6 records: rows 0,1,2,3,0,1
        rows[k % (capacity + 1)] = [float(step), 1.0, 2.0**k]
    outcomes, missed = decode_records(rows, written=6, previous=1, capacity=capacity)
    assert [o.step for o in outcomes] == [13, 14, 15] and missed == 2
    assert outcomes[0] == StepOutcome(13, "overflow", 8.0)
    assert decode_records(rows, 6, 6, capacity) == ((), 0)
    with pytest.raises(ValueError, match="capacity 3 has 4 rows"):
        decode_records(rows[:3], 6, 1, capacity)
    with pytest.raises(ValueError, match="written"):
        decode_records(rows, 1, 6, capacity)
    with pytest.raises(ValueError, match="code must be one of"):
        decode_records([[1.0, 7.0, 1.0]] * 2, 1, 0, 1)


def test_interval_outcomes_check_themselves_and_merge():
    first = IntervalOutcomes(1, 10, (StepOutcome(3, "overflow", 8.0),), {"overflow": 1})
    assert (first.steps, first.skipped, first.applied, first.skipped_steps) == (10, 1, 9, (3,))
    later = IntervalOutcomes(11, 20, (StepOutcome(12, "applied_nonfinite", 1.0),), {"applied_nonfinite": 1})
    both = first.merged(later)
    assert both.steps == 20 and both.applied == 19 and both.counts["applied_nonfinite"] == 1
    assert [o.skipped for o in both.outcomes] == [True, False]
    with pytest.raises(ValueError, match="starts at 12"):
        first.merged(IntervalOutcomes(12, 20))
    with pytest.raises(ValueError, match="unknown cause"):
        IntervalOutcomes(1, 10, counts={"bogus": 1})
    with pytest.raises(ValueError, match="do not fit"):
        IntervalOutcomes(1, 2, counts={"overflow": 3})
    with pytest.raises(ValueError, match="do not fit"):
        IntervalOutcomes(1, 10, (StepOutcome(3, "overflow", 8.0),))
    assert IntervalOutcomes(5, 4).steps == 0


# ------------------------------------------------------------------------------------ the torch ring


def _run(scaler: LossScaler, optimizer: str, steps: int = 100, inject=INJECTED, on_read=None, every=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    kwargs = {"fused": True} if optimizer == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    x = torch.randn(8, 4)
    for step in range(1, steps + 1):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if step in inject:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if every is not None and step % every == 0:
            on_read(step)
    return model, opt


def _replayed_scales(policy, flags):
    """The scale each step used, by the NumPy reference rule (the conformance oracle)."""
    state, used = initial_state(policy), []
    for finite in flags:
        used.append(float(state.scale))
        state = next_state(policy, state, finite)
    return used


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_exactly_the_injected_steps_are_reported_skipped_with_their_cause_and_scale(optimizer):
    policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=20)
    scaler = LossScaler(device="cpu", policy=policy)
    _, opt = _run(scaler, optimizer)
    got = scaler.read_outcomes()
    assert (got.first_step, got.last_step) == (1, 100)
    assert got.skipped_steps == INJECTED and got.applied == 97 and got.missed == 0
    assert got.counts == {"overflow": 3, "nonfinite": 0, "spike": 0, "applied_nonfinite": 0}
    assert {o.cause for o in got.outcomes} == {"overflow"}
    scales = _replayed_scales(policy, [s not in INJECTED for s in range(1, 101)])
    assert [o.scale for o in got.outcomes] == [scales[s - 1] for s in INJECTED]
    # The optimizer agrees: AdamW's own step count is the applied steps.
    assert {int(s["step"]) for s in opt.state.values()} == {97}
    assert scaler.read_outcomes() == IntervalOutcomes(101, 100)  # nothing new since


def test_each_read_covers_its_own_interval():
    scaler, reads = LossScaler(device="cpu", init_scale=256.0), []
    _run(scaler, "fused", on_read=lambda step: reads.append(scaler.read_outcomes()), every=25)
    assert [(r.first_step, r.last_step) for r in reads] == [(1, 25), (26, 50), (51, 75), (76, 100)]
    assert [r.skipped_steps for r in reads] == [(3, 17), (42,), (), ()]
    assert sum(r.applied for r in reads) == 97


def test_an_interval_longer_than_the_ring_lists_the_newest_and_counts_all():
    scaler = LossScaler(device="cpu", init_scale=2.0**20, outcome_capacity=2)
    _run(scaler, "fused", steps=30, inject=(2, 5, 9, 11, 20))
    got = scaler.read_outcomes()
    assert got.skipped_steps == (11, 20) and got.missed == 3 and got.counts["overflow"] == 5
    assert got.applied == 25


def test_bf16_runs_name_the_cause_nonfinite():
    scaler = LossScaler(device="cpu", policy=FixedPolicy(1.0))
    _run(scaler, "fused")
    got = scaler.read_outcomes()
    assert got.skipped_steps == INJECTED and {o.cause for o in got.outcomes} == {"nonfinite"}
    assert got.counts["nonfinite"] == 3 and got.applied == 97 and {o.scale for o in got.outcomes} == {1.0}


def test_a_loaded_state_starts_the_record_afresh_and_a_pickle_keeps_the_capacity():
    scaler = LossScaler(device="cpu", init_scale=256.0, outcome_capacity=8)
    _run(scaler, "fused", steps=20)
    saved = scaler.state_dict()
    scaler.load_state_dict(saved)
    assert scaler.read_outcomes() == IntervalOutcomes(21, 20)
    _run(scaler, "fused", steps=5, inject=(4,))
    got = scaler.read_outcomes()
    assert (got.first_step, got.last_step, got.skipped_steps) == (21, 25, (24,))
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone._outcome_capacity == 8
    with pytest.raises(ValueError, match="outcome_capacity"):
        LossScaler(outcome_capacity=0)


def test_the_record_adds_no_host_read_to_the_step_and_is_read_in_one_copy():
    scaler = LossScaler(device="cpu")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for _ in range(3):
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        with AtenOps() as ops, HostReadCounter(only_under=LIBRARY) as reads:
            scaler.step(opt)
            scaler.update()
        assert "_local_scalar_dense" not in ops.names and reads.reads == []
        opt.zero_grad()
    with HostReadCounter(only_under=LIBRARY) as reads:
        scaler.read_state_and_outcomes()
    assert [name for name, _ in reads.reads] == ["cpu", "tolist"]  # the state and the ring: one copy


def test_disabled_and_unstarted_scalers_report_an_empty_interval():
    assert LossScaler(enabled=False).read_outcomes() == IntervalOutcomes(1, 0)
    assert LossScaler(device="cpu").read_outcomes() == IntervalOutcomes(1, 0)


def test_the_record_matches_the_rule_on_random_sequences():
    """Every step's cause and scale against the NumPy rule, on a hysteresis policy (TablePath)."""
    rng = np.random.default_rng(3)
    policy = DynamicPolicy(initial_scale=2.0**12, growth_interval=5, hysteresis=2)
    scaler = LossScaler(device="cpu", policy=policy, outcome_capacity=256)
    flags = [bool(f) for f in rng.random(200) > 0.2]
    _run(scaler, "foreach", steps=200, inject=tuple(i + 1 for i, f in enumerate(flags) if not f))
    got = scaler.read_outcomes()
    scales = _replayed_scales(policy, flags)
    want = tuple(StepOutcome(i + 1, "overflow", scales[i]) for i, f in enumerate(flags) if not f)
    assert got.outcomes == want
    assert scaler.get_state() == next_state_run(policy, flags)


def next_state_run(policy, flags):
    state = initial_state(policy)
    for finite in flags:
        state = next_state(policy, state, finite)
    return type(state)(float(state.scale), *(int(v) for v in state[1:]))
