"""torchao's float8 training watched on the CPU: what each cast did, checked against torchao's own casts
(their scales and their fp8 bits, caught as torchao makes them), eager and compiled, the three recipes; the
ops a counted step adds, counted; acceptance 2 of the fp8 issue at the capture."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

import torchao.float8.float8_linear as float8_linear  # noqa: E402
from aten_ops import AtenOps  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from lossscale_callbacks.fp8._formats import E4M3, fp8_format  # noqa: E402
from lossscale_callbacks.fp8._reads import Fp8Read  # noqa: E402
from lossscale_callbacks.fp8._rules import Fp8Saturation, Fp8ZeroAmax  # noqa: E402
from lossscale_callbacks.torch._fp8_torchao import TorchaoCasts  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def model(recipe: str = "tensorwise") -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe))
    return net


class Casts:
    """torchao's own casts, caught as it makes them: (layer's config id, role, input, the Float8 tensor)."""

    def __init__(self):
        self.seen = []
        self._original = float8_linear.hp_tensor_to_float8_dynamic

    def __enter__(self):
        def caught(hp, dtype, mm_config, *args, **kwargs):
            out = self._original(hp, dtype, mm_config, *args, **kwargs)
            backward = torch._C._current_autograd_node() is not None
            role = str(kwargs.get("gemm_input_role"))
            self.seen.append((id(mm_config), role, backward, hp.detach().clone(), out))
            return out
        float8_linear.hp_tensor_to_float8_dynamic = caught
        return self

    def __exit__(self, *exc):
        float8_linear.hp_tensor_to_float8_dynamic = self._original

    def first(self, layer: torch.nn.Module, role: str):
        """The cast of ``role`` torchao made first for ``layer`` in the step (the one its first GEMM uses)."""
        want = {"input": ("INPUT", False), "weight": ("WEIGHT", False),
                "grad_output": ("GRAD_OUTPUT", True)}[role]
        for key, name, backward, hp, out in self.seen:
            if key == id(layer.linear_mm_config) and name.endswith(want[0]) and backward == want[1]:
                return hp, out
        raise AssertionError(f"no {role} cast")


def _recount(hp: torch.Tensor, cast) -> tuple[int, int]:
    """From torchao's fp8 bits: values that came out clipped (at ±max from beyond it) and values that came
    out subnormal or zero though not zero."""
    fmt = fp8_format(str(cast._data.dtype).rsplit(".", 1)[-1])
    bits = cast._data.float().abs()
    x = hp.float().abs()
    scaled = x * cast._scale.float()
    clipped = int(((bits == fmt.max) & (scaled >= fmt.saturation)).sum())
    under = int(((bits < fmt.min_normal) & (x > 0)).sum())
    return clipped, under


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_cast_is_torchaos_own(recipe):
    net = model(recipe)
    casts = TorchaoCasts()
    casts.watch(net)
    assert casts.layers == ("0", "2")
    casts.counting = True
    x = torch.randn(16, 64)
    x[3] *= 50  # one row 50 times the others: under tensorwise scaling the other rows lose their small values
    with Casts() as caught:
        net(x).square().mean().backward()
    reads = {(t.layer, t.role): t for t in casts.read(1)}
    for name, layer in (("0", net[0]), ("2", net[2])):
        for role in ("input", "weight", "grad_output"):
            t = reads[name, role]
            hp, cast = caught.first(layer, role)
            assert t.scale == pytest.approx(float(cast._scale.float().amin()), rel=1e-6), (name, role)
            assert t.amax == pytest.approx(float(hp.abs().max()), rel=1e-6)
            assert t.format == fp8_format(str(cast._data.dtype).rsplit(".", 1)[-1]).name
            clipped, under = _recount(hp, cast)
            total = hp.numel()
            assert t.saturated == clipped == 0  # dynamic scaling: the scale is the tensor's own
            # The bits round: a value just under the smallest normal can round up to it (never the reverse).
            assert under <= round(t.underflow_share * total) <= under + max(2, under // 100), (name, role)
    if recipe == "tensorwise":  # the row x50 set the tensor's scale: the other rows' small values underflow
        assert reads["0", "input"].underflow_share > 0.005
    else:  # each row its own scale: the outlier row costs the others nothing
        assert reads["0", "input"].underflow_share < 0.001


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_counts_what_eager_counts(recipe):
    results = []
    for compiled in (False, True):
        net = model(recipe)
        casts = TorchaoCasts()
        casts.watch(net)
        step_fn = torch.compile(net) if compiled else net
        torch.manual_seed(1)
        for step in range(1, 5):
            casts.counting = step % 2 == 0  # steps 2 and 4 counted, 1 and 3 not: two graphs, each once
            x = torch.randn(16, 64)
            x[0] *= 50
            step_fn(x).square().mean().backward()
        results.append([(t.layer, t.role, t.saturated, round(t.underflow_share, 6), t.scale)
                        for t in casts.read(4)])
    eager, compiled = results
    for a, b in zip(eager, compiled, strict=True):
        assert a[:3] == b[:3]
        assert a[3] == pytest.approx(b[3], abs=2e-3) and a[4] == pytest.approx(b[4], rel=1e-5)


def test_acceptance_2_outliers_and_a_zeroed_weight():
    net = model()
    casts = TorchaoCasts()
    casts.watch(net)
    casts.counting = True
    torch.manual_seed(2)
    x = torch.randn(64, 64)

    def step(inputs):
        net(inputs).square().mean().backward()
        return {(t.layer, t.role): t for t in casts.read(1)}

    plain = step(x)["0", "input"]
    whole = step(x * 50)["0", "input"]
    # A whole-tensor outlier: the scale follows it (dynamic scaling), nothing clips, nothing more underflows.
    assert whole.saturated == 0 and whole.scale == pytest.approx(plain.scale / 50, rel=1e-6)
    assert whole.underflow_share == pytest.approx(plain.underflow_share, abs=1 / x.numel())
    quiet = Fp8Read(1, (whole,))
    assert Fp8Saturation()(quiet) == [] and Fp8ZeroAmax()(quiet) == []
    # One row 50 times the others: the scale follows the row, the other rows' small values underflow.
    row = x.clone()
    row[5] *= 50
    one = step(row)["0", "input"]
    scale = E4M3.max / float(row.abs().max())  # torchao: max / amax, computed here in float64
    expected = int(((row.abs() * scale < E4M3.min_normal) & (row != 0)).sum())
    assert one.saturated == 0
    assert round(one.underflow_share * row.numel()) == expected
    assert plain.underflow_share == 0 and expected >= 5  # none without the outlier row
    # A zeroed weight: amax 0, torchao's scale 448 / 1e-12, the zero-amax finding names the layer.
    with torch.no_grad():
        net[2].weight.zero_()
    zero = step(x)
    assert zero["2", "weight"].amax == 0.0
    assert zero["2", "weight"].scale == pytest.approx(448 / 1e-12, rel=1e-6)
    found = [v.message for v in Fp8ZeroAmax()(Fp8Read(1, tuple(zero.values())))]
    # ...and the gradient reaching layer 0 through it is zero too: both are named.
    assert [m.split(" had")[0] for m in found] == ["`0`'s grad output", "`2`'s weight"]


def test_ops_added_per_step_counted():
    net = model()
    x = torch.randn(16, 64)

    def ops_of_step(counting: bool | None) -> int:
        casts = TorchaoCasts()
        if counting is not None:
            casts.watch(net)
            casts.counting = counting
        with AtenOps() as ops:
            net(x).square().mean().backward()
        casts.unwatch()
        return len(ops)

    bare, ordinary, counted = ops_of_step(None), ops_of_step(False), ops_of_step(True)
    assert ordinary == bare  # an ordinary step: not one op more
    added = counted - bare
    per_role = added / 6  # 2 layers x 3 roles
    assert 20 <= per_role <= 50, added
    print(f"torchao tensorwise: {bare} ops a step, +{added} on a counted step ({per_role:.0f} per role)")


def test_disabled_casts_are_not_watched():
    net = model("rowwise_with_gw_hp")
    casts = TorchaoCasts()
    casts.watch(net)
    casts.counting = True
    net(torch.randn(4, 64)).sum().backward()
    roles = {t.role for t in casts.read(1)}
    assert roles == {"input", "weight", "grad_output"}  # its first GEMMs' casts are all scaled
    assert all(math.isfinite(t.scale) for t in casts.read(2) if t.scale is not None)


def _tensorboard(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out = {tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
           for tag in acc.Tags()["tensors"] if tag.startswith("fp8/") and not tag.endswith("findings")}
    out.update({tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]})
    return out


@pytest.mark.slow
def test_acceptance_2_and_4_through_the_monitor_tensorboard_wandb_and_report(tmp_path, monkeypatch):
    """The monitor on a tensorwise run: a whole-tensor outlier at step 10 (healthy), one row x50 at step 15
    (underflow counted), a weight zeroed before each step from 18 on (the zero-amax finding); read back from
    TensorBoard's and W&B's own files; ``report`` says the findings in words."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import glob
    import subprocess
    import sys

    from lossscale_callbacks.torch import Fp8ScaleMonitor
    from lossscale_callbacks.wandb._reader import read_run, wait_until_finished

    monkeypatch.setenv("WANDB_MODE", "offline")
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    monitor = Fp8ScaleMonitor(net, log_every=5, count_every=1, tensorboard=str(tmp_path / "tb"),
                              wandb={"dir": str(tmp_path), "project": "fp8", "mode": "offline"}, echo=None)
    assert monitor.layers == ("0", "2")
    torch.manual_seed(3)
    x = torch.randn(64, 64)
    expected_underflow = None
    for step in range(1, 21):
        inputs = x.clone()
        if step == 10:
            inputs *= 50  # the whole tensor: dynamic scaling follows it
        if step == 15:
            inputs[5] *= 50  # one row: the others' small values underflow
            scale = E4M3.max / float(inputs.abs().max())
            expected_underflow = int(((inputs.abs() * scale < E4M3.min_normal) & (inputs != 0)).sum())
        if step >= 18:  # pruned: zeroed before each step from 18 on
            with torch.no_grad():
                net[2].weight.zero_()
        net(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    summary = monitor.finish()
    rules = [v.rule for v in monitor.loop.verdicts]
    assert "fp8_saturation" not in rules  # the whole-tensor outlier clipped nothing
    # the pruned weight, and the gradient it no longer passes back to layer 0
    assert rules == ["fp8_zero_amax", "fp8_zero_amax"]
    assert "`2`'s weight had an amax of 0" in summary and "`0`'s grad output had an amax of 0" in summary
    assert "No cast saturated" in summary and "Health: 2 problem(s) found." in summary

    board = _tensorboard(tmp_path / "tb")
    assert board["fp8/0/input/saturated"] == {5: 0, 10: 0, 15: 0, 20: 0}
    under = board["fp8/0/input/underflow_share"]
    assert round(under[15] * 5 * x.numel()) == expected_underflow  # the interval 11-15 counted 5 steps
    assert under[10] == under[5] == 0
    assert board["fp8/2/weight/amax"][20] == 0 and board["fp8/2/weight/amax"][15] > 0

    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    wait_until_finished(run)
    series = read_run(run)
    assert dict(series["fp8/0/input/underflow_share"]) == pytest.approx(under)
    assert dict(series["fp8/2/weight/amax"])[20] == 0
    done = subprocess.run([sys.executable, "-m", "lossscale_callbacks._cli", "report", run],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "`2`'s weight had an amax of 0" in done.stdout and "no loss scaling logged" in done.stdout
    assert "Health: 2 problem(s) found." in done.stdout


def test_a_model_without_fp8_layers_is_refused_with_the_extra_named():
    from lossscale_callbacks.torch import Fp8ScaleMonitor

    with pytest.raises(ValueError, match="no fp8 layer"):
        Fp8ScaleMonitor(torch.nn.Linear(2, 2))
