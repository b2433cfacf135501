"""ScalerReader: one reader for our LossScaler, a stock GradScaler and DeepSpeed; its checkpoint door.

Every state that comes in through ``load_state_dict`` goes through the core's state gate before it
reaches the scaler (a stock ``GradScaler`` included): it loads whole, or a ``ValueError`` names the
field and the reader and its scaler are exactly as they were.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks.torch._reader import ScalerReader  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402
from lossscale_callbacks.torch._stock import check_stock_state  # noqa: E402

POLICY = DynamicPolicy(initial_scale=2.0**10, growth_interval=3)


def _step(scaler, inject_inf=False):
    """One real optimizer step of a tiny model through ``scaler``."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler.scale((param * 2).sum()).backward()
    if inject_inf:
        param.grad[0] = math.inf
    scaler.step(optimizer)
    scaler.update()


def _stepped(reader, flags):
    for inject in flags:
        _step(reader.scaler, inject)
        reader.after_optimizer_step()
    return reader


def _snapshot(reader):
    scaler = reader.scaler
    return (reader.steps, scaler.state_dict(), getattr(reader._stock, "_restored_skipped", None),
            reader.read())


def test_one_reader_for_ours_and_the_stock_scaler_gives_the_same_state():
    flags = [False, True, True, False, False, False, False, True]
    ours = _stepped(ScalerReader(LossScaler(device="cpu", policy=POLICY)), flags)
    stock = _stepped(ScalerReader(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)), flags)
    assert (ours.kind, stock.kind) == ("ours", "stock")
    assert ours.read() == stock.read()._replace(hysteresis_left=ours.read().hysteresis_left)
    assert ours.steps == stock.steps == 8 and ours.read().skipped_steps == 3
    assert ours.policy == POLICY and stock.policy is None


def test_the_deepspeed_kind_reads_the_engine_counts():
    scaler = SimpleNamespace(cur_scale=512.0, cur_iter=5, last_overflow_iter=1, scale_window=1000,
                             scale_factor=2.0, min_scale=1.0, delayed_shift=1, cur_hysteresis=1, dynamic=True)
    engine = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=scaler), skipped_steps=2, global_steps=5)
    reader = ScalerReader(engine)
    assert reader.kind == "deepspeed" and reader.started and reader.steps == 5
    assert reader.read().scale == 512.0 and reader.read().skipped_steps == 2
    with pytest.raises(ValueError, match="checkpointed by DeepSpeed itself"):
        reader.state_dict()


@pytest.mark.parametrize("scaler, match", [
    (None, "scaler must be"), ("x", "scaler must be"),
    (torch.amp.GradScaler("cpu", enabled=False), "disabled"),
    (LossScaler(device="cpu", enabled=False), "disabled"),
])
def test_what_is_not_an_enabled_scaler_is_refused(scaler, match):
    with pytest.raises(ValueError, match=match):
        ScalerReader(scaler)


def test_started_says_whether_a_loss_was_scaled():
    reader = ScalerReader(torch.amp.GradScaler("cpu"))
    assert not reader.started
    _step(reader.scaler)
    assert reader.started


@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_state_dict_round_trip_continues_the_counts(kind):
    def make():
        return ScalerReader(LossScaler(device="cpu", policy=POLICY) if kind == "ours"
                            else torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))

    saved = _stepped(make(), [False, True, False, True, False]).state_dict()
    restored = make()
    restored.load_state_dict(saved)
    assert restored.steps == 5 and restored.read().skipped_steps == 2
    _stepped(restored, [True])
    assert (restored.steps, restored.read().skipped_steps) == (6, 3)


STOCK = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
         "_growth_tracker": 1}


@pytest.mark.parametrize("changes, field", [
    ({"scale": math.nan}, "scale"), ({"scale": 0.0}, "scale"), ({"scale": -2.0}, "scale"),
    ({"scale": math.inf}, "scale"), ({"_growth_tracker": -1}, "growth_counter"),
    ({"growth_factor": 0.5}, "growth_factor"), ({"backoff_factor": 2.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"), ({"extra": 1}, "unknown"),
])
def test_a_bad_stock_state_never_reaches_the_grad_scaler(changes, field):
    reader = _stepped(ScalerReader(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)),
                      [False, True])
    before = _snapshot(reader)
    state = {"steps": 2, "scaler": {**STOCK, **changes}, "stock": {"steps": 2, "skipped_steps": 1}}
    with pytest.raises(ValueError, match=field):
        reader.load_state_dict(state)
    assert _snapshot(reader) == before


@pytest.mark.parametrize("state, match", [
    ({"steps": 10**9}, "steps .* disagrees"),
    ({"steps": 3}, "steps .* disagrees"),
    ({"steps": True}, "steps"),
    ({"steps": -1}, "steps"),
    ({"steps": 2.0}, "steps"),
    ({"stock": {"steps": 2, "skipped_steps": 3}}, "skipped_steps"),
    ({"stock": {"steps": 2}}, "missing"),
    ({"scaler": "x"}, "scaler must be a dict"),
    ({"more": 1}, "unknown"),
])
def test_stock_counts_that_disagree_are_refused_whole(state, match):
    reader = _stepped(ScalerReader(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)),
                      [False, True])
    before = _snapshot(reader)
    good = {"steps": 2, "scaler": dict(STOCK), "stock": {"steps": 2, "skipped_steps": 1}}
    with pytest.raises(ValueError, match=match):
        reader.load_state_dict({**good, **state})
    assert _snapshot(reader) == before


@pytest.mark.parametrize("change, match", [
    (lambda s: {**s, "steps": 10**9}, "disagrees"),
    (lambda s: {**s, "steps": 3}, "disagrees"),
    (lambda s: {**s, "steps": True}, "steps"),
    (lambda s: {**s, "scaler": "x"}, "scaler must be a LossScaler"),
    (lambda s: {**s, "scaler": {**s["scaler"], "scale": math.nan}}, "scale"),
    (lambda s: {**s, "stock": {"steps": 20, "skipped_steps": 0}}, "stock torch.amp.GradScaler"),
    (lambda s: {**s, "other": 1}, "unknown"),
    (lambda s: {"scaler": s["scaler"]}, "missing"),
])
def test_our_scaler_refuses_an_inconsistent_checkpoint_whole(change, match):
    saved = _stepped(ScalerReader(LossScaler(device="cpu", policy=POLICY)), [False] * 20).state_dict()
    reader = _stepped(ScalerReader(LossScaler(device="cpu", policy=POLICY)), [True, False])
    before = _snapshot(reader)
    with pytest.raises(ValueError, match=match):
        reader.load_state_dict(change(saved))
    assert _snapshot(reader) == before


def test_check_stock_state_returns_the_core_state():
    state = check_stock_state(STOCK, {"steps": 7, "skipped_steps": 2})
    assert tuple(state) == (1024.0, 1, 1, 2, 7)


GARBAGE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                    st.lists(st.integers(), max_size=2))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbage_states_load_whole_or_leave_the_reader_exactly_as_it_was(data):
    kind = data.draw(st.sampled_from(["ours", "stock"]))
    scaler = (LossScaler(device="cpu", policy=POLICY) if kind == "ours"
              else torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    # No search for schedulers and EMAs (a pass over the process's objects, twice per example): not what
    # this test is about, and 240 of them took two minutes in the suite's crowded process.
    reader = _stepped(ScalerReader(scaler, find_followers=False), [False, True, False])
    state = reader.state_dict()
    for _ in range(data.draw(st.integers(1, 3))):
        parts = ["top", "scaler", "stock"] if kind == "stock" else ["top", "scaler"]
        where = data.draw(st.sampled_from(parts))
        target = state if where == "top" else state.get(where)
        if not isinstance(target, dict):
            continue  # that part was replaced or removed by an earlier change
        key = data.draw(st.sampled_from([*target, "unknown_key"]))
        if data.draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = data.draw(GARBAGE)
    before = _snapshot(reader)
    try:
        reader.load_state_dict(state)
    except ValueError as exc:
        assert str(exc)  # a message that says what is wrong
        assert _snapshot(reader) == before
    else:
        loaded = reader.read()
        assert 0 <= loaded.skipped_steps <= loaded.steps == reader.steps and loaded.scale > 0
