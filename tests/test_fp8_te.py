"""TransformerEngine's ``fp8_meta`` read by its source's fields, on a RECORDING of its state
(``tests/te_recording.py``, built from TransformerEngine v2.18's fields and update rule, not by
TransformerEngine, which needs CUDA). What is tested is the reader: the layout (columns per GEMM and role,
the rolled rows), the per-step rebuild, and the findings on that state."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from te_recording import RecordedTeModule  # noqa: E402

from lossscale_callbacks.fp8._reads import Fp8Read  # noqa: E402
from lossscale_callbacks.fp8._rules import Fp8CoarseScale, Fp8Saturation, Fp8StaleHistory  # noqa: E402
from lossscale_callbacks.torch._fp8_te import TeScales  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = RecordedTeModule(**kw)
        self.mlp = RecordedTeModule(num_gemms=2, **kw)


def run(net, amaxes, read_every, scales, start=0):
    """Train ``amaxes`` (step -> (input, weight, grad) amax) reading every ``read_every`` steps."""
    reads, used = [], {}
    for step in range(start + 1, start + len(amaxes) + 1):
        used[step] = net.attn.scales()
        i, w, g = amaxes[step - start - 1]
        net.attn.step([i], [w], [g])
        net.mlp.step([i, i], [w, w], [g, g])
        if step % read_every == 0:
            reads.append(Fp8Read(step, tuple(scales.read(step))))
    return reads, used


def test_the_layout_and_every_steps_scale():
    net = Net(amax_history_len=16)
    scales = TeScales()
    scales.watch(net)
    assert scales.layers == ("attn", "mlp")
    scales.read(0)
    amaxes = [(1.0 + 0.1 * s, 0.5, 1e-3 * (1 + s % 3)) for s in range(40)]
    reads, used = run(net, amaxes, 8, scales)
    names = {(t.layer, t.role, t.format) for t in reads[0].tensors}
    assert ("attn", "grad_output", "e5m2") in names and ("mlp/gemm2", "weight", "e4m3") in names
    assert len(names) == 9
    for read in reads:
        by = {(t.layer, t.role): t for t in read.tensors}
        rows = {s: (a, m) for s, a, m in by["attn", "input"].rows}
        assert sorted(rows) == list(range(read.step - 7, read.step + 1))
        for step, (amax, scale) in rows.items():
            assert amax == pytest.approx(amaxes[step - 1][0], rel=1e-6)
            assert scale == pytest.approx(used[step][0], rel=1e-6)
        grad_rows = {s: m for s, _, m in by["attn", "grad_output"].rows}
        assert all(grad_rows[s] == pytest.approx(used[s][2], rel=1e-6) for s in grad_rows)
        assert by["attn", "input"].replaced_after is None


def test_an_outlier_saturates_one_step_then_coarsens_the_scale_for_the_history():
    net = Net()  # DelayedScaling's default: a 1024-step history
    scales = TeScales()
    scales.watch(net)
    scales.read(0)
    amaxes = [(2.0, 0.5, 1e-3)] * 40
    amaxes[29] = (100.0, 0.5, 1e-3)  # step 30
    reads, _ = run(net, amaxes, 10, scales)
    at30 = {(t.layer, t.role): t for t in reads[2].tensors}["attn", "input"]
    # TransformerEngine updates after each step (lag 1): the outlier step itself casts with the old scale
    assert at30.saturated_steps == 1 and at30.first_saturated_step == 30
    assert at30.max_overshoot == pytest.approx(50.0, rel=1e-5)
    assert [v.rule for v in Fp8Saturation()(reads[2])][:1] == ["fp8_saturation"]
    at40 = {(t.layer, t.role): t for t in reads[3].tensors}["attn", "input"]
    assert at40.history_ratio == pytest.approx(50.0, rel=1e-5) and at40.outlier_step == 30
    assert at40.coarse_until == 30 + 1 + 1024 - 1
    coarse = [v.message for v in Fp8CoarseScale()(reads[3]) if v.message.startswith("`attn`'s input")]
    assert coarse and "1024-step history" in coarse[0] and "amax_history_len" in coarse[0]


def test_a_checkpoint_loaded_into_a_run_that_moved_is_stale_at_the_first_read():
    """TransformerEngine PR #567: a loaded amax history that no longer matches the tensors."""
    net = Net(amax_history_len=64)
    scales = TeScales()
    scales.watch(net)
    scales.read(0)
    run(net, [(1.0, 0.5, 1e-3)] * 20, 10, scales)
    saved = net.attn.extra_state()
    run(net, [(9.0, 0.5, 1e-3)] * 10, 10, scales, start=20)  # the values moved 9x after step 20
    net.attn.load_extra_state(saved)  # loaded after step 30: the histories of step 20
    read = Fp8Read(30, tuple(scales.read(30)))
    stale = {(t.layer, t.role): t for t in read.tensors}["attn", "input"]
    assert stale.replaced_after == 30 and stale.stale_ratio == pytest.approx(9.0)
    (verdict,) = [v for v in Fp8StaleHistory()(read) if "`attn`'s input" in v.message]
    assert verdict.step == 30 and "PR #567" in verdict.message
    # the weight's history was loaded too, but its amax did not move: not stale
    assert {(t.layer, t.role): t for t in read.tensors}["attn", "weight"].stale_ratio == pytest.approx(1.0)
    assert not [v for v in Fp8StaleHistory()(read) if "`mlp" in v.message]  # not loaded: not replaced


def test_the_monitor_reads_transformer_engine_modules_through_the_loop():
    from lossscale_callbacks import InMemorySink
    from lossscale_callbacks.torch import Fp8ScaleMonitor

    net = Net(amax_history_len=64)
    memory = InMemorySink()
    monitor = Fp8ScaleMonitor(net, log_every=5, sinks=[memory], echo=None)
    assert monitor.layers == ("attn", "mlp")
    for step in range(1, 21):
        i = 80.0 if step == 12 else 1.0
        net.attn.step([i], [0.5], [1e-3])
        net.mlp.step([1.0, 1.0], [0.5, 0.5], [1e-3, 1e-3])
        monitor.step()
    summary = monitor.finish()
    # every step's scale on the dashboards, rebuilt from the histories read every 5 steps
    assert [s for s, _ in memory.series("fp8/attn/input/scale")] == list(range(1, 21))
    assert dict(memory.series("fp8/attn/input/saturated_steps"))[15] == 1
    rules = [(v.rule, v.step) for v in monitor.loop.verdicts if "`attn`'s input" in v.message]
    assert rules == [("fp8_saturation", 15), ("fp8_coarse_scale", 15)]
    assert "64-step history" in summary and "until step 76" in summary


@pytest.mark.cuda
def test_transformer_engine_itself_on_a_gpu():
    """The same reading on TransformerEngine's own ``te.Linear`` (needs CUDA and an fp8 GPU, SM 8.9 or
    newer; skipped elsewhere): every step's rebuilt scale equals the one TransformerEngine held before that
    step, a 50x input at step 12 saturates there, and the coarse scale is said with the 16-step history."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import DelayedScaling, Format

    from lossscale_callbacks import InMemorySink
    from lossscale_callbacks.torch import Fp8ScaleMonitor

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM 8.9 or newer")
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    # TransformerEngine 2.x: ``te.autocast(recipe=...)``; older releases: ``te.fp8_autocast(fp8_recipe=...)``
    autocast = ((lambda: te.autocast(enabled=True, recipe=recipe)) if hasattr(te, "autocast") else
                (lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)))
    torch.manual_seed(0)
    net = torch.nn.Sequential(te.Linear(64, 64), torch.nn.ReLU(), te.Linear(64, 64)).cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")

    def train(factor: float) -> None:
        with autocast():
            out = net(x * factor)
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    train(1.0)  # fp8_meta is made at the first forward under autocast
    memory = InMemorySink()
    monitor = Fp8ScaleMonitor(net, log_every=5, sinks=[memory], echo=None)
    assert monitor.layers == ("0", "2")
    held = {}
    for step in range(1, 21):
        held[step] = float(net[0].fp8_meta["scaling_fwd"].scale[0])  # a test's read, not the monitor's
        train(50.0 if step == 12 else 1.0)
        monitor.step()
    summary = monitor.finish()
    rebuilt = dict(memory.series("fp8/0/input/scale"))
    assert sorted(rebuilt) == list(range(1, 21))
    for step, scale in held.items():
        assert rebuilt[step] == pytest.approx(scale, rel=1e-5), step
    assert dict(memory.series("fp8/0/input/saturated_steps"))[15] >= 1
    rules = {v.rule for v in monitor.loop.verdicts if "`0`'s input" in v.message}
    assert {"fp8_saturation", "fp8_coarse_scale"} <= rules
    assert "16-step history" in summary
