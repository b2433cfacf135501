"""Every state that gets into a LossScaler is checked whole: it loads a valid state, or a ValueError names
the field and the scaler is exactly as it was (issue 24's state gate, torch doors)."""

from __future__ import annotations

import math
import pickle

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy, policy_from_config  # noqa: E402
from lossscale_callbacks._state import LossScaleState  # noqa: E402
from lossscale_callbacks._validation import validate_state  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

POLICY = DynamicPolicy(initial_scale=1024.0, growth_interval=20, hysteresis=3)


def _trained(device_known: bool = True) -> LossScaler:
    scaler = LossScaler(policy=POLICY, diagnose=True)
    if not device_known:
        return scaler
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if step in (1, 3):
            model.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


def _snapshot(scaler: LossScaler) -> tuple:
    """What 'exactly as it was' means: the policy, the state, the live tensors, the settings."""
    return (scaler.policy, scaler.get_state(), scaler._path, scaler._scale, scaler.is_enabled(),
            scaler.sync_found_inf, scaler.forensics, scaler.device)


GARBAGE = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1, -1.0, 0, 0.0, 2**70, -(2**70), 1e300, 1.5, -0.5,
                     2**63, 2**63 - 1, "x", "", None, True, False, [1], {}, (1,), b"1"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.floats(-10.0, 1e6).map(torch.tensor),
    st.integers(-5, 5).map(lambda v: torch.tensor([v, v])),
)
KEY_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12)


@st.composite
def mutated(draw, base: dict) -> tuple[dict, set]:
    """``base`` with keys dropped, values replaced by garbage, unknown keys added; and the names touched."""
    out, touched = dict(base), set()
    for key in sorted(base):
        action = draw(st.sampled_from(["keep", "keep", "keep", "drop", "garbage"]))
        if action == "drop":
            del out[key]
            touched.add(key)
        elif action == "garbage":
            out[key] = draw(GARBAGE)
            touched.add(key)
    for key, value in draw(st.dictionaries(KEY_NAMES, GARBAGE, max_size=2)).items():
        if key not in base:
            out[key] = value
            touched.add(key)
    return out, touched


def _assert_refused_or_valid(scaler, before, call, touched):
    try:
        call()
    except ValueError as exc:
        assert any(name in str(exc) for name in touched), (str(exc), touched)
        assert _snapshot(scaler) == before
        return None
    except RuntimeError as exc:  # GradScaler's own refusal of an empty dict
        assert "empty" in str(exc)
        assert _snapshot(scaler) == before
        return None
    state = scaler.get_state()
    assert validate_state(scaler.policy, state) == state
    return state


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), device_known=st.booleans())
def test_load_state_dict_loads_a_valid_state_or_names_the_field_and_changes_nothing(data, device_known):
    scaler = _trained(device_known)
    base = _trained().state_dict()
    candidate, touched = data.draw(mutated(base))
    before = _snapshot(scaler)
    loaded = _assert_refused_or_valid(scaler, before, lambda: scaler.load_state_dict(candidate), touched)
    if loaded is not None and "policy" in candidate:  # what it loaded is what was asked for
        assert scaler.policy == policy_from_config(candidate["policy"])
        assert loaded == validate_state(scaler.policy, {k: candidate[k] for k in LossScaleState._fields})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_unpickling_loads_a_valid_state_or_names_the_field_and_changes_nothing(data):
    scaler = _trained()
    base = _trained().__getstate__()
    candidate, touched = data.draw(mutated(base))
    if isinstance(candidate.get("state"), dict) and data.draw(st.booleans()):
        inner, inner_touched = data.draw(mutated(candidate["state"]))
        candidate["state"], touched = inner, touched | inner_touched
    before = _snapshot(scaler)
    loaded = _assert_refused_or_valid(scaler, before, lambda: scaler.__setstate__(candidate), touched)
    if loaded is not None:
        assert pickle.loads(pickle.dumps(scaler)).get_state() == loaded


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(new_scale=GARBAGE)
def test_update_with_a_new_scale_sets_a_valid_scale_or_names_it_and_changes_nothing(new_scale):
    scaler = _trained()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    before = _snapshot(scaler)
    try:
        scaler.update(new_scale=new_scale)
    except ValueError as exc:
        assert "new_scale" in str(exc)
        assert _snapshot(scaler) == before
        return
    except AssertionError as exc:  # GradScaler's own refusal of a tensor of more than one element
        assert "new_scale should be a float or a 1-element" in str(exc) and _snapshot(scaler) == before
        return
    state = scaler.get_state()
    assert validate_state(scaler.policy, state) == state and state.steps == before[1].steps + 1


@pytest.mark.parametrize("device_known", [True, False])
def test_a_growth_counter_above_the_interval_is_refused(device_known):
    scaler = _trained(device_known)
    saved = _trained().state_dict()
    before = _snapshot(scaler)
    for bad in ({**saved, "growth_counter": 10**6, "_growth_tracker": 10**6},
                {**saved, "growth_counter": 20, "_growth_tracker": 20}):
        with pytest.raises(ValueError, match=r"growth_counter must be in \[0, 19\]"):
            scaler.load_state_dict(bad)
        assert _snapshot(scaler) == before
    stock = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
             "_growth_tracker": 10**6}
    with pytest.raises(ValueError, match=r"_growth_tracker.*growth_counter must be in \[0, 1999\]"):
        LossScaler(policy=DynamicPolicy()).load_state_dict(stock)
    pickled = {**scaler.__getstate__()}
    pickled["state"] = {**pickled["state"], "growth_counter": 10**6}
    with pytest.raises(ValueError, match="unpickling: growth_counter"):
        LossScaler.__new__(LossScaler).__setstate__(pickled)


def test_unknown_keys_and_disagreeing_mirrors_are_refused_by_name():
    scaler = _trained()
    saved = scaler.state_dict()
    before = _snapshot(scaler)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['scael'\]"):
        scaler.load_state_dict({**saved, "scael": 2.0})
    with pytest.raises(ValueError, match=r"growth_interval=100 disagrees with the policy's growth_interval"):
        scaler.load_state_dict({**saved, "growth_interval": 100})
    stock = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['foo'\]"):
        scaler.load_state_dict({**stock, "foo": 3})
    with pytest.raises(ValueError, match=r"has LossScaler's \['steps'\] but no 'policy'"):
        scaler.load_state_dict({**stock, "steps": 3})
    with pytest.raises(ValueError, match=r"policy: config\['type'\]"):
        scaler.load_state_dict({**saved, "policy": {"type": "exotic"}})
    assert _snapshot(scaler) == before
    scaler.load_state_dict({k: v for k, v in saved.items() if k not in ("growth_factor", "_growth_tracker")})
    assert scaler.get_state() == before[1]  # the mirrors are optional


@pytest.mark.parametrize("kwargs, match", [({"process_group": "world"}, "process_group"),
                                           ({"diagnose": 1.0}, "diagnose"),
                                           ({"diagnose": torch.tensor(True)}, "diagnose")])
def test_constructor_arguments_that_would_fail_later_are_refused_now(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)


def test_a_fixed_policy_checkpoint_round_trips():
    scaler = LossScaler(policy=FixedPolicy(8.0), device="cpu")
    scaler.scale(torch.ones(()))
    other = LossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.policy == FixedPolicy(8.0) and other.get_state() == scaler.get_state()


def test_numbers_held_as_tensors_load_as_they_do_into_a_grad_scaler():
    # GradScaler.load_state_dict takes a 0-d tensor scale (fill_ reads it); a state dict converted by
    # other tools (or one of ours with tensors in it) must load the same, not be refused as "not a number".
    stock = {"scale": torch.tensor(512.0), "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": 2000, "_growth_tracker": torch.tensor(7)}
    reference = torch.amp.GradScaler("cpu")
    reference.load_state_dict(stock)
    ours = LossScaler(policy=DynamicPolicy(), device="cpu")
    ours.load_state_dict(stock)
    assert ours.get_scale() == reference.get_scale() == 512.0
    assert ours.get_state().growth_counter == 7
    saved = _trained().state_dict()
    tensors = {k: torch.tensor(v) if isinstance(v, (int, float)) else v for k, v in saved.items()}
    other = LossScaler()
    other.load_state_dict(tensors)
    assert other.get_state() == _trained().get_state()
    with pytest.raises(ValueError, match=r"scale must be a finite number"):
        other.load_state_dict({**tensors, "scale": torch.tensor([512.0, 1.0])})  # two numbers, not one
    assert other.get_state() == _trained().get_state()


def test_a_grad_scaler_dict_with_tensor_settings_loads_as_into_a_grad_scaler():
    stock = {"scale": torch.tensor(256.0), "growth_factor": torch.tensor(4.0),
             "backoff_factor": torch.tensor(0.25), "growth_interval": torch.tensor(50),
             "_growth_tracker": torch.tensor(3)}
    reference = torch.amp.GradScaler("cpu")
    reference.load_state_dict(stock)
    ours = LossScaler(policy=DynamicPolicy(), device="cpu")
    ours.load_state_dict(stock)
    c = ours.policy.constants
    assert (c.growth_factor, c.backoff_factor, c.growth_interval) == (4.0, 0.25, 50)
    assert ours.get_scale() == reference.get_scale() == 256.0


def test_grad_scaler_settings_given_as_tensors_are_taken_as_numbers():
    scaler = LossScaler(device="cpu", init_scale=torch.tensor(512.0), growth_interval=torch.tensor(100),
                        growth_factor=torch.tensor(4.0), backoff_factor=torch.tensor(0.25))
    assert scaler.policy == DynamicPolicy(initial_scale=512.0, growth_interval=100, growth_factor=4.0,
                                          backoff_factor=0.25)
    with pytest.raises(ValueError, match="init_scale"):
        LossScaler(device="cpu", init_scale=torch.tensor([512.0, 2.0]))


def test_the_setters_take_tensors_as_the_constructor_does():
    scaler = LossScaler(device="cpu")
    scaler.set_growth_factor(torch.tensor(4.0))
    scaler.set_backoff_factor(torch.tensor(0.25))
    scaler.set_growth_interval(torch.tensor(7))
    got = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert got == (4.0, 0.25, 7)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(torch.tensor([7, 8]))
    assert scaler.get_growth_interval() == 7
