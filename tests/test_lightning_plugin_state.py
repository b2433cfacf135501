"""The precision plugins' checkpoints: what Lightning's own plugin reads, and all-or-nothing loading.

Real Trainers on the CPU for the checkpoint round trips (Lightning's ``MixedPrecision`` is built with
an explicit CPU ``GradScaler``: ``Trainer(precision="16-mixed")`` on a CPU silently becomes bf16).
"""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from lightning_scripts import tiny  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.lightning._plugin import LossScaleFSDPPlugin, LossScalePlugin  # noqa: E402
from lossscale_callbacks.lightning.fabric import LossScaleFabricFSDPPlugin, LossScaleFabricPlugin  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

tiny.quiet_lightning_warnings()

PLUGINS = (LossScalePlugin, LossScaleFSDPPlugin, LossScaleFabricPlugin, LossScaleFabricFSDPPlugin)


@pytest.fixture(params=tiny.NAMESPACES)
def pl(request):
    return pytest.importorskip(request.param)


def _fit(pl, plugin, max_steps, inject_inf_at=(), ckpt_path=None):
    model = tiny.module_class(pl)(inject_inf_at=inject_inf_at, snapshots=False)
    trainer = pl.Trainer(plugins=[plugin], **tiny.trainer_kwargs(max_steps=max_steps))
    trainer.fit(model, tiny.data(), ckpt_path=ckpt_path)
    return trainer


def _stock(pl):
    return pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


# ------------------------------------------------------------------ checkpoints Lightning's plugin reads


def test_a_checkpoint_of_ours_resumes_with_lightnings_own_mixed_precision_and_back(pl, tmp_path):
    policy = DynamicPolicy(initial_scale=2.0**10, growth_interval=3, hysteresis=2)
    ours = LossScalePlugin(device="cpu", policy=policy)
    trainer = _fit(pl, ours, max_steps=6, inject_inf_at=(0, 1))
    path = str(tmp_path / "ours.ckpt")
    trainer.save_checkpoint(path)
    # 0: overflow, hysteresis absorbs it; 1: back off (512); 2-4 finite: growth (1024); 5: counter 1.
    state = ours.scaler.get_state()
    assert state == (1024.0, 1, 2, 2, 6)
    saved = torch.load(path, weights_only=False)
    assert saved["MixedPrecision"] == {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                       "growth_interval": 3, "_growth_tracker": 1}

    # Our own resume still takes our entry: hysteresis and skip counts, which a GradScaler cannot hold.
    again = LossScalePlugin(device="cpu")
    _fit(pl, again, max_steps=6, ckpt_path=path)  # nothing left to train: only the restore
    assert again.scaler.get_state() == state and again.policy == policy

    # Lightning's own plugin keeps the scale and goes on from it: two finite steps, tracker 3, growth.
    stock = _stock(pl)
    trainer = _fit(pl, stock, max_steps=8, ckpt_path=path)
    assert stock.scaler.get_scale() == 2048.0 and stock.scaler._get_growth_tracker() == 0
    assert stock.scaler.get_growth_interval() == 3

    # And back: the stock plugin's checkpoint resumes with ours.
    path = str(tmp_path / "stock.ckpt")
    trainer.save_checkpoint(path)
    back = LossScalePlugin(device="cpu")
    _fit(pl, back, max_steps=8, ckpt_path=path)
    assert back.scaler.get_state().scale == 2048.0 and back.policy.growth_interval == 3


def test_the_stock_entry_is_written_only_where_a_stock_scaler_can_take_it():
    # bf16 never scaled: a stock fp16 run starts from its own initial scale, not from 1.
    bf16 = LossScalePlugin("bf16-mixed", device="cpu")
    checkpoint = {"LossScalePlugin": bf16.state_dict()}
    bf16.on_save_checkpoint(checkpoint)
    assert list(checkpoint) == ["LossScalePlugin"]
    # A disabled scaler saves no state (only the lag here): nothing for a GradScaler either.
    disabled = LossScalePlugin(device="cpu", scaler=LossScaler(enabled=False), hold_lr_schedulers=True)
    checkpoint = {"LossScalePlugin": disabled.state_dict()}
    disabled.on_save_checkpoint(checkpoint)
    assert checkpoint == {"LossScalePlugin": {"lr_scheduler_lag": 0}}
    # The FSDP plugin writes what Lightning's FSDPPrecision (a ShardedGradScaler) reads.
    fsdp = LossScaleFSDPPlugin(device="cpu", policy=DynamicPolicy(initial_scale=512.0, growth_interval=7))
    checkpoint = {"LossScaleFSDPPlugin": fsdp.state_dict()}
    fsdp.on_save_checkpoint(checkpoint)
    sharded = ShardedGradScaler("cpu")
    sharded.load_state_dict(checkpoint["FSDPPrecision"])
    assert sharded.get_scale() == 512.0 and sharded.get_growth_interval() == 7


# ------------------------------------------------------------------------- all-or-nothing loading


def _plugin_with_state(cls, precision="16-mixed"):
    plugin = cls(precision, device="cpu")
    if precision == "16-mixed":
        policy = DynamicPolicy(initial_scale=2.0**12, growth_interval=5, hysteresis=2)
        plugin.load_state_dict({"policy": policy.to_config(), "scale": 2.0**11, "growth_counter": 3,
                                "hysteresis_left": 1, "skipped_steps": 2, "steps": 9})
    if hasattr(plugin, "lr_scheduler_lag"):
        plugin.lr_scheduler_lag = 4
    return plugin


def _snapshot(plugin):
    return plugin.scaler.state_dict(), getattr(plugin, "lr_scheduler_lag", None)


def _other_state():
    """A valid state, different from the plugin's, for the bad part to ride along with."""
    return LossScalePlugin(device="cpu", policy=DynamicPolicy(initial_scale=64.0)).scaler.state_dict()


@pytest.mark.parametrize("lag", ["x", -1, 1.5, True, None, float("nan"), 2**63])
def test_a_bad_lr_scheduler_lag_is_refused_before_anything_is_loaded(lag):
    for cls in (LossScalePlugin, LossScaleFSDPPlugin):
        plugin = _plugin_with_state(cls)
        before = _snapshot(plugin)
        with pytest.raises(ValueError, match="lr_scheduler_lag"):
            plugin.load_state_dict({**_other_state(), "lr_scheduler_lag": lag})
        assert _snapshot(plugin) == before


@pytest.mark.parametrize("cls", PLUGINS)
def test_unknown_keys_and_non_dicts_are_refused(cls):
    plugin = _plugin_with_state(cls)
    before = _snapshot(plugin)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['scaler'\]"):
        plugin.load_state_dict({**_other_state(), "scaler": {}})
    with pytest.raises(ValueError, match="state_dict must be a dict"):
        plugin.load_state_dict([("scale", 2.0)])
    assert _snapshot(plugin) == before


@pytest.mark.parametrize("cls", PLUGINS)
def test_the_scalers_part_goes_through_the_state_gate(cls):
    plugin = _plugin_with_state(cls)
    before = _snapshot(plugin)
    lag = {"lr_scheduler_lag": 1} if hasattr(plugin, "lr_scheduler_lag") else {}
    for field, value in (("scale", math.nan), ("scale", 0.0), ("growth_counter", -1), ("steps", 1.5)):
        with pytest.raises(ValueError, match=field):
            plugin.load_state_dict({**_other_state(), field: value, **lag})
        assert _snapshot(plugin) == before


@pytest.mark.parametrize("cls", PLUGINS)
def test_bf16_plugins_refuse_a_scaling_state_and_take_their_own(cls):
    plugin = _plugin_with_state(cls, "bf16-mixed")
    before = _snapshot(plugin)
    for saved in (_other_state(), torch.amp.GradScaler("cpu").state_dict()):
        with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*resume it with precision='16-mixed'"):
            plugin.load_state_dict(saved)
        assert _snapshot(plugin) == before
    own = cls("bf16-mixed", device="cpu").state_dict()
    plugin.load_state_dict(own)
    assert plugin.scaler.policy == FixedPolicy(1.0)


# ------------------------------------------------------------------------- garbage, property-tested

_KEYS = ("policy", "scale", "growth_counter", "hysteresis_left", "skipped_steps", "steps", "growth_factor",
         "backoff_factor", "growth_interval", "_growth_tracker", "lr_scheduler_lag")
_GARBAGE = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1, 2, 2.0**24, 2.0**30, -1.0]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@st.composite
def _garbled(draw):
    """A valid saved state (ours or a GradScaler's), then fields dropped, replaced and added."""
    if draw(st.booleans()):
        saved = {**_other_state(), "lr_scheduler_lag": 3}
    else:
        saved = torch.amp.GradScaler("cpu", init_scale=128.0).state_dict()
    for key in draw(st.lists(st.sampled_from(sorted(saved)), max_size=3, unique=True)):
        del saved[key]
    for key in draw(st.lists(st.sampled_from(_KEYS), max_size=3, unique=True)):
        saved[key] = draw(_GARBAGE)
    if draw(st.booleans()):
        saved[draw(st.text(min_size=1, max_size=6))] = draw(_GARBAGE)
    return saved


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(PLUGINS), precision=st.sampled_from(["16-mixed", "bf16-mixed"]), saved=_garbled())
def test_garbage_either_loads_a_valid_state_or_is_refused_naming_the_field_and_changes_nothing(
        cls, precision, saved):
    plugin = _plugin_with_state(cls, precision)
    before = _snapshot(plugin)
    scaler_keys = [k for k in saved if k != "lr_scheduler_lag"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a GradScaler scale moved into the bounds warns
            plugin.load_state_dict(saved)
    except ValueError as exc:
        assert _snapshot(plugin) == before
        # The message names the field (a key, a policy's own field, or the dict itself).
        assert any(name in str(exc) for name in (*_KEYS, "config", "state_dict", "bf16")), str(exc)
        return
    except RuntimeError as exc:
        # GradScaler's own answer to a dict with no scaler state (saved from a disabled scaler).
        assert not scaler_keys and "empty" in str(exc) and _snapshot(plugin) == before
        return
    # Loaded: the state the plugin now holds is one the gate accepts, and the lag an integer >= 0.
    state = plugin.scaler.get_state()
    assert math.isfinite(state.scale) and plugin.scaler.policy.constants.min_scale <= state.scale
    assert state.skipped_steps <= state.steps
    lag = getattr(plugin, "lr_scheduler_lag", 0)
    assert isinstance(lag, int) and not isinstance(lag, bool) and lag >= 0
