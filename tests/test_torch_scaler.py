"""LossScaler: GradScaler's API and call-order rules, the core's rule on the device, no host reads."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from lightning_scripts.host_reads import HostReadCounter  # noqa: E402

from lossscale_callbacks import DynamicPolicy, FixedPolicy, initial_state, next_state  # noqa: E402
from lossscale_callbacks.torch import LossScaler  # noqa: E402
from lossscale_callbacks.torch._scaler import _is_sharded  # noqa: E402


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
        "adam": lambda: torch.optim.Adam(params, lr=1e-2, foreach=True),
        "sgd_fused": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
        "adam_fused": lambda: torch.optim.Adam(params, lr=1e-2, fused=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-2, fused=True),
    }[kind]()


def _train_step(model, opt, scaler, x, inject_inf: bool = False):
    opt.zero_grad(set_to_none=False)
    loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    if inject_inf:
        with torch.no_grad():
            model[0].weight.grad[0, 0].fill_(math.inf)  # a view filled on the device: no host copy
    scaler.step(opt)
    scaler.update()


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    return params, state


def _assert_bit_identical(a, b):
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        for name, value in a[1][key].items():
            other = b[1][key][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), name
            else:
                assert value == other, name


# ------------------------------------------------------------------------ host reads


def test_the_counter_sees_host_reads():
    """The detector itself must be able to fail."""
    t = torch.ones(())
    with HostReadCounter() as counter:
        t.item()
        bool(t)
        float(t)
        t.tolist()
        t.cpu()
    assert counter.reads == ["item", "__bool__", "__float__", "tolist", "cpu"]
    with HostReadCounter() as counter:
        torch.equal(t, t)
        torch.allclose(t, t)
        t.is_nonzero()
        f"{t:.1f}"
        t.nonzero()
        t.__array__()
    assert counter.reads == ["equal", "allclose", "is_nonzero", "__format__", "nonzero", "__array__"]
    # A meta tensor stands in for an accelerator on a CPU-only machine (the refusal comes before
    # the copy, which meta tensors could not do).
    meta = torch.empty((), device="meta")
    for copy_to_host in (lambda: meta.to("cpu"), lambda: meta.to(torch.device("cpu"), non_blocking=True),
                         lambda: torch.empty(()).copy_(meta)):
        with pytest.raises(AssertionError, match="host read"), HostReadCounter(raise_on_read=True):
            copy_to_host()
    with HostReadCounter(raise_on_read=True):
        t.to("cpu")  # already on the host: no read
        meta.to("meta")
    scaler = LossScaler(device="cpu")
    with HostReadCounter(raise_on_read=True):
        scaler.get_scale()  # before the first scale() the state is on the host: nothing to read
    scaler.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="host read"), HostReadCounter(raise_on_read=True):
        scaler.get_scale()


@pytest.mark.parametrize("kind", ["adam_fused", "adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("inject_inf", [False, True])
def test_no_host_read_in_a_step_with_a_fused_optimizer(kind, inject_inf):
    model = _model()
    opt = _optimizer(kind, model.parameters())
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=2), device="cpu")
    _train_step(model, opt, scaler, _batch(0))  # optimizer state exists from here on
    for step in range(1, 4):
        with HostReadCounter(raise_on_read=True):
            _train_step(model, opt, scaler, _batch(step), inject_inf=inject_inf and step == 2)
    assert scaler.get_state().skipped_steps == (1 if inject_inf else 0)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["adam_fused", "adamw_fused", "sgd_fused"])
def test_fused_step_on_cuda_passes_sync_debug_mode_error(kind):
    model = _model().cuda()
    opt = _optimizer(kind, model.parameters())
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=2), device="cuda")
    x = _batch(0).cuda()
    _train_step(model, opt, scaler, x)  # lazy init and optimizer state outside the checked steps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            _train_step(model, opt, scaler, x, inject_inf=step == 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaler.get_state().skipped_steps == 1


def test_exactly_one_host_read_with_a_non_fused_optimizer():
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    scaler = LossScaler(device="cpu")
    reference = torch.amp.GradScaler("cpu")
    ref_model = _model()
    ref_opt = _optimizer("sgd", ref_model.parameters())
    for step in range(3):
        with HostReadCounter() as ours:
            _train_step(model, opt, scaler, _batch(step))
        with HostReadCounter() as theirs:
            _train_step(ref_model, ref_opt, reference, _batch(step))
        assert ours.reads == ["item"]
        assert theirs.reads == ["item"]


def test_unscale_then_clip_then_step_reads_once():
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    scaler = LossScaler(device="cpu")
    with HostReadCounter() as counter:
        scaler.scale(model(_batch(0)).sum()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()
    # clip_grad_norm_ itself reads nothing; the one read is the skip decision.
    assert counter.reads == ["item"]


# --------------------------------------------------------------------- skipped steps


@pytest.mark.parametrize("kind", ["sgd", "adam", "sgd_fused", "adam_fused", "adamw_fused"])
def test_a_skipped_step_leaves_parameters_and_optimizer_state_bit_identical(kind):
    model = _model()
    opt = _optimizer(kind, model.parameters())
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=256.0), device="cpu")
    for step in range(3):
        _train_step(model, opt, scaler, _batch(step))
    before = _snapshot(model, opt)
    _train_step(model, opt, scaler, _batch(3), inject_inf=True)
    _assert_bit_identical(before, _snapshot(model, opt))
    state = scaler.get_state()
    assert state.scale == 128.0 and state.skipped_steps == 1 and state.steps == 4
    _train_step(model, opt, scaler, _batch(4))
    changed = _snapshot(model, opt)
    assert not torch.equal(before[0][0], changed[0][0]), "a finite step must move the weights"


def test_nan_loss_is_skipped_too():
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    scaler = LossScaler(device="cpu")
    before = _snapshot(model, opt)
    opt.zero_grad()
    scaler.scale(model(_batch(0)).sum() * math.nan).backward()
    assert scaler.step(opt) is None
    scaler.update()
    _assert_bit_identical(before, _snapshot(model, opt))
    assert scaler.last_step_skipped() is True


# ------------------------------------------------------------- GradScaler compatibility


@pytest.mark.parametrize("kind", ["sgd", "adam_fused"])
def test_same_trajectory_as_torch_grad_scaler(kind):
    """With GradScaler's settings (no hysteresis, bounds out of reach) the two agree bit for bit."""
    policy = DynamicPolicy(initial_scale=2.0**16, growth_interval=3, min_scale=2.0**-20, max_scale=2.0**40)
    ours_model, theirs_model = _model(), _model()
    ours_opt = _optimizer(kind, ours_model.parameters())
    theirs_opt = _optimizer(kind, theirs_model.parameters())
    ours = LossScaler(policy=policy, device="cpu")
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    for step in range(14):
        inf = step in (2, 3, 9)
        _train_step(ours_model, ours_opt, ours, _batch(step), inject_inf=inf)
        _train_step(theirs_model, theirs_opt, theirs, _batch(step), inject_inf=inf)
        assert ours.get_scale() == theirs.get_scale()
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
        _assert_bit_identical(_snapshot(ours_model, ours_opt), _snapshot(theirs_model, theirs_opt))
    assert ours.get_state().skipped_steps == 3


def _call_sequence(scaler, calls):
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    try:
        for call in calls:
            if call == "scale_backward":
                scaler.scale(model(_batch(0)).sum()).backward()
            elif call == "scale_only":  # a forgotten backward: no gradient to check
                scaler.scale(model(_batch(0)).sum())
            elif call == "unscale":
                scaler.unscale_(opt)
            elif call == "step":
                scaler.step(opt)
            elif call == "step_closure":
                scaler.step(opt, closure=lambda: None)
            elif call == "update":
                scaler.update()
    except (RuntimeError, AssertionError, ValueError) as exc:
        return type(exc).__name__, str(exc).split(".")[0]
    return None


@pytest.mark.parametrize("calls", [
    ["scale_backward", "unscale", "unscale"],
    ["scale_backward", "step", "unscale"],
    ["scale_backward", "step", "step"],
    ["scale_backward", "update"],
    ["scale_backward", "step_closure"],
    ["step"],
    ["unscale"],
    ["update"],
    ["scale_backward", "unscale", "step", "update", "scale_backward", "step", "update"],
    ["scale_only", "step"],
    ["scale_only", "unscale", "update"],
])
def test_call_order_rules_match_grad_scaler(calls):
    ours = _call_sequence(LossScaler(), calls)
    theirs = _call_sequence(torch.amp.GradScaler("cpu"), calls)
    assert ours == theirs
    if calls == ["scale_backward", "step", "step"]:
        assert ours == ("RuntimeError", "step() has already been called since the last update()")
    if calls[0] == "scale_only":
        assert ours[0] == "AssertionError" and ours[1].startswith("No inf checks were recorded")


def test_fp16_gradients_are_refused_like_grad_scaler():
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(device="cpu")
    scaler.scale(model(_batch(0).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_disabled_scaler_is_a_pass_through():
    scaler = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    model(_batch(0)).sum().backward()
    scaler.step(opt)
    scaler.update()


def test_scale_accepts_nested_outputs_and_lazily_picks_the_device():
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=4.0))
    assert scaler.device is None
    out = scaler.scale([torch.ones(2), (torch.ones(()), torch.full((1,), 2.0))])
    assert scaler.device == torch.device("cpu")
    assert out[0].tolist() == [4.0, 4.0] and out[1][1].tolist() == [8.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        scaler.scale([1.0])


def test_getters_setters_and_update_with_new_scale():
    scaler = LossScaler(policy=DynamicPolicy(growth_interval=7), device="cpu")
    factors = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert factors == (2.0, 0.5, 7)
    scaler.set_growth_interval(3)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    assert scaler.policy == DynamicPolicy(growth_interval=3, growth_factor=4.0, backoff_factor=0.25)
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    scaler.scale(model(_batch(0)).sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=5.0)
    assert scaler.get_scale() == 5.0 and scaler.get_state().steps == 1
    fixed = LossScaler(policy=FixedPolicy(1.0))
    with pytest.raises(ValueError, match="DynamicPolicy"):
        fixed.set_growth_interval(2)


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": 3.0}, "policy"),
    ({"sync_found_inf": "yes"}, "sync_found_inf"),
    ({"sync_found_inf": 1}, "sync_found_inf"),
    ({"enabled": 1}, "enabled"),
    ({"device": "nodevice"}, "device"),
])
def test_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)


# ----------------------------------------------------------------------- checkpoints


def test_state_dict_round_trips_exactly_and_resumes_the_same_sequence():
    policy = DynamicPolicy(initial_scale=3.0e4, growth_interval=2, growth_factor=1.7, hysteresis=2)
    flags = [True, False, True, True, False, False, True, True, True, False, True]
    full = LossScaler(policy=policy, device="cpu")
    resumed = None
    model = _model()
    opt = _optimizer("sgd_fused", model.parameters())
    for i, finite in enumerate(flags):
        _train_step(model, opt, full, _batch(i), inject_inf=not finite)
        if i == 4:
            saved = full.state_dict()
            resumed = LossScaler()  # another policy; the checkpoint brings its own
            resumed.load_state_dict(copy.deepcopy(saved))
            assert resumed.get_state() == full.get_state()  # before the device is known
        if resumed is not None and i > 4:
            _train_step(model, opt, resumed, _batch(i), inject_inf=not finite)
            assert resumed.get_state() == full.get_state()
    assert resumed.policy == policy
    # And the state matches the core's reference rule step for step.
    ref = initial_state(policy)
    for finite in flags:
        ref = next_state(policy, ref, finite)
    assert full.get_state().scale == float(ref.scale)
    assert full.get_state().skipped_steps == int(ref.skipped_steps) == 4


def test_loads_a_grad_scaler_state_dict():
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=10)
    ours = LossScaler(device="cpu")
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 512.0 and ours.get_growth_interval() == 10
    with pytest.raises(RuntimeError, match="empty"):
        ours.load_state_dict({})
    # And GradScaler can read ours.
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 512.0


def test_sync_is_off_without_a_process_group_and_detects_sharded_parameters():
    class FlatParameter(torch.nn.Parameter):
        pass

    scaler = LossScaler(sync_found_inf=True)
    sharded_opt = torch.optim.SGD([FlatParameter(torch.ones(1))], lr=0.1)
    assert scaler._should_sync(sharded_opt) is False  # no process group here
    assert not _is_sharded(torch.nn.Parameter(torch.ones(1)))
    assert _is_sharded(FlatParameter(torch.ones(1)))


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_a_skipped_first_step_of_fused_momentum_sgd_leaves_no_momentum_buffer(dampening):
    """torch's fused SGD allocates its momentum buffers before the kernel and the kernel leaves them
    uninitialised on a skipped step; the first step of such an optimizer must not call it at all."""
    def run(fused):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=dampening, fused=fused)
        scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0), device="cpu")
        before = _snapshot(model, opt)
        _train_step(model, opt, scaler, _batch(0), inject_inf=True)
        _assert_bit_identical(before, _snapshot(model, opt))
        assert opt.state_dict()["state"] == {} and scaler.last_step_skipped() is True
        for step in range(1, 4):
            _train_step(model, opt, scaler, _batch(step))
        return [p.detach() for p in model.parameters()]

    for fused_param, plain_param in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(fused_param, plain_param)


# ------------------------------------------------------------ GradScaler-style construction


def test_constructed_like_grad_scaler_it_starts_where_grad_scaler_starts():
    ours, theirs = LossScaler("cpu"), torch.amp.GradScaler("cpu")
    assert isinstance(ours, torch.amp.GradScaler)
    assert ours.get_scale() == theirs.get_scale() == 65536.0
    settings = (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval())
    assert settings == (2.0, 0.5, 2000)
    custom = LossScaler(device="cpu", init_scale=128.0, growth_factor=4.0, backoff_factor=0.25,
                        growth_interval=7, enabled=True)
    assert custom.policy == DynamicPolicy(initial_scale=128.0, growth_factor=4.0, backoff_factor=0.25,
                                          growth_interval=7, min_scale=1.0, max_scale=2.0**24)
    # The bounds widen to contain the initial scale, as far as growth stays finite in float32.
    assert LossScaler(init_scale=0.25).policy.min_scale == 0.25
    assert LossScaler(init_scale=2.0**30).policy.max_scale == 2.0**30
    with pytest.warns(UserWarning, match="init_scale=1e\\+38 is above the largest scale"):
        assert LossScaler(init_scale=1e38, growth_factor=16.0).get_scale() == 2.0**122


def test_policy_and_grad_scaler_settings_do_not_mix_and_a_positional_policy_is_explained():
    mixed = r"pass either policy or GradScaler's settings, not both.*init_scale=2"
    with pytest.raises(ValueError, match=mixed):
        LossScaler(init_scale=2.0, policy=DynamicPolicy())
    with pytest.raises(ValueError, match=r"first argument is the device.*LossScaler\(policy=FixedPolicy"):
        LossScaler(FixedPolicy(8.0))
    for kwargs, match in [({"growth_factor": 1.0}, "growth_factor"),
                          ({"backoff_factor": 1.0}, "backoff_factor"),
                          ({"growth_interval": 0}, "growth_interval"), ({"init_scale": 0.0}, "init_scale"),
                          ({"init_scale": math.inf}, "init_scale")]:
        with pytest.raises(ValueError, match=match):
            LossScaler(**kwargs)


def test_cuda_without_cuda_disables_with_a_warning_like_grad_scaler():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = LossScaler("cuda")
    assert not scaler.is_enabled() and scaler.scale(torch.ones(())) == 1.0


# ---------------------------------------------------------- no state can corrupt a run


def _trained(policy=None, steps=3):
    scaler = LossScaler(policy=policy or DynamicPolicy(initial_scale=1024.0, growth_interval=2, hysteresis=2))
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    for step in range(steps):
        _train_step(model, opt, scaler, _batch(step), inject_inf=step == 1)
    return scaler, model, opt


BAD_STATES = [
    ({"scale": 0.0}, "scale must be a finite number"),
    ({"scale": math.nan}, "scale must be a finite number"),
    ({"scale": math.inf}, "scale must be a finite number"),
    ({"scale": -4.0}, "scale must be a finite number"),
    ({"scale": 2.0**25}, "scale must be a finite number"),
    ({"growth_counter": -1}, "growth_counter"),
    ({"steps": 1.5}, "steps"),
    ({"skipped_steps": 5, "steps": 4}, "cannot exceed steps"),
    ({"hysteresis_left": 3}, "hysteresis_left"),
]


@pytest.mark.parametrize("with_device", [True, False])
@pytest.mark.parametrize("change, match", BAD_STATES)
def test_a_bad_checkpoint_is_refused_at_load_time_and_changes_nothing(change, match, with_device):
    good, *_ = _trained()
    saved = good.state_dict()
    target = _trained(DynamicPolicy(initial_scale=64.0))[0] if with_device else LossScaler()
    before_policy, before_state = target.policy, target.get_state()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict({**saved, **change})
    assert target.policy == before_policy and target.get_state() == before_state  # nothing half-loaded
    # a bad policy in the checkpoint is refused the same way
    with pytest.raises(ValueError, match="growth_interval"):
        target.load_state_dict({**saved, "policy": {**saved["policy"], "growth_interval": 0}})
    assert target.policy == before_policy and target.get_state() == before_state


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf, -1.0, 2.0**25, 0.5, torch.tensor(math.nan), "x"])
def test_update_with_a_bad_new_scale_is_refused_and_changes_nothing(bad):
    scaler, model, opt = _trained()
    before = scaler.get_state()
    _train_step(model, opt, scaler, _batch(9), inject_inf=False)  # leaves the scaler ready for update()
    scaler.scale(model(_batch(9)).pow(2).mean()).backward()
    scaler.step(opt)
    with pytest.raises(ValueError, match=r"new_scale|scale must be a finite number"):
        scaler.update(new_scale=bad)
    after_failed = scaler.get_state()
    assert after_failed.steps == before.steps + 1  # only the clean step before, nothing from the failed call
    scaler.update(new_scale=torch.tensor(512.0))  # the same step, now with a good value
    assert scaler.get_scale() == 512.0 and scaler.get_state().steps == before.steps + 2


def test_a_collapsed_grad_scaler_checkpoint_is_refused_with_what_to_do():
    """GradScaler really reaches 0.0: ~165 overflows in a row from 2**16 underflow float32."""
    stock = torch.amp.GradScaler("cpu")
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    for step in range(170):
        _train_step(model, opt, stock, _batch(step), inject_inf=True)
    collapsed = stock.state_dict()
    assert collapsed["scale"] == 0.0
    ours = LossScaler()
    advice = r"collapsed.*load_state_dict\(\{\*\*checkpoint, 'scale': 65536.0\}\)"
    with pytest.raises(ValueError, match=advice):
        ours.load_state_dict(collapsed)
    assert ours.get_state() == LossScaler().get_state()
    ours.load_state_dict({**collapsed, "scale": 65536.0})  # the advice works
    assert ours.get_scale() == 65536.0


def test_a_grad_scaler_checkpoint_outside_the_bounds_is_clamped_with_a_warning():
    ours = LossScaler(policy=DynamicPolicy(max_scale=2.0**20))
    stock = {"scale": 2.0**30, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
             "_growth_tracker": 5}
    with pytest.warns(UserWarning, match="outside this policy's bounds"):
        ours.load_state_dict(stock)
    assert ours.get_state() == (2.0**20, 5, 1, 0, 0) and ours.get_growth_interval() == 100
    with pytest.raises(ValueError, match="DynamicPolicy"):
        LossScaler(policy=FixedPolicy(1.0)).load_state_dict(stock)
    with pytest.raises(ValueError, match="expects a LossScaler state dict"):
        ours.load_state_dict({"scale": 4.0})


def test_the_plugin_refuses_a_collapsed_stock_checkpoint_instead_of_training_on_nan(tmp_path):
    from lossscale_callbacks.lightning import LossScalePlugin

    plugin = LossScalePlugin(device="cpu")
    stock = {"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
             "_growth_tracker": 0}
    with pytest.raises(ValueError, match="collapsed"):
        plugin.on_load_checkpoint({"MixedPrecision": stock})
    assert plugin.scaler.get_scale() == 65536.0


def test_pickling_keeps_the_state_and_checks_it_when_unpickled():
    import pickle

    scaler, *_ = _trained()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_state() == scaler.get_state() and clone.policy == scaler.policy
    state = scaler.__getstate__()
    state["state"] = {**state["state"], "scale": 0.0}
    with pytest.raises(ValueError, match="unpickling: scale"):
        LossScaler.__new__(LossScaler).__setstate__(state)


def test_lightning_mixed_precision_accepts_our_scaler():
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=LossScaler())
    assert isinstance(plugin.scaler, LossScaler)
