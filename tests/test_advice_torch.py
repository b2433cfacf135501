"""The precision advisor on torch, CPU float16 autocast: live forward tracing and the audit on known-answer
models (tests/advisor_models.py), no host read in the step, the ops a traced step adds, and
transformers' ``DebugUnderflowOverflow`` side by side. The fast tests take about 20 s together on a
free core; the training runs (keep list within 5%, the scale after 500 steps) are marked slow."""

from __future__ import annotations

import io
import math
import os
import re
import sys
from contextlib import redirect_stdout

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from advisor_models import (  # noqa: E402
    CROSSING_STEP,
    MODELS,
    Crossing,
    batches,
    crossing_input,
)
from aten_ops import AtenOps  # noqa: E402
from lightning_scripts.host_reads import HostReadCounter  # noqa: E402

import lossscale_callbacks  # noqa: E402
from lossscale_callbacks import InMemorySink, LoggingLoop  # noqa: E402
from lossscale_callbacks._policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks.torch import LossScaler, audit_precision, keep_in_float32  # noqa: E402

F = torch.nn.functional
LIBRARY = os.path.dirname(os.path.dirname(lossscale_callbacks.__file__))


def _mse(model, batch):
    return F.mse_loss(model(batch[0]).float(), batch[1])


def _step(model, opt, scaler, x, y=None):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = out.float().sum() * 1e-9 if y is None else F.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize(("diagnose", "named_at"), [("every_step", CROSSING_STEP), (True, CROSSING_STEP + 1)])
def test_a_linear_crossing_65504_is_named_at_its_step_or_the_next(diagnose, named_at):
    """Traced every step: named at the step it crosses. Sampled (every 1000 steps): that step is not traced,
    but its skip arms the next steps, where the same layer overflows again and is named."""
    model = Crossing()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = LossScaler("cpu", diagnose=diagnose, init_scale=2.0**10).watch(model)
    with HostReadCounter(only_under=(LIBRARY,)) as reads:
        for step in range(1, CROSSING_STEP + 3):
            _step(model, opt, scaler, crossing_input(step))
    forensics = scaler.read_forensics()
    trace = forensics.activations
    assert forensics.causes["loss_nonfinite"] == 3
    assert (trace.producer, trace.producer_step) == ("lin", named_at)
    assert trace.passed_on == ("head", "Crossing")  # the layers after it only passed it on
    assert trace.steps[-1] == named_at and math.isinf(trace.maxima[-1, trace.layers.index("lin")])
    if diagnose is True:
        assert trace.traced == 3  # step 1 (the first sample) and the two after the skip at step 11
    assert [r for r in reads.reads if r[0] != "item"] == []  # ours: no host read in any step
    # The one read a non-fused optimizer step makes anyway is the scaler's own (GradScaler's too).
    assert {r[1] for r in reads.reads} <= {"_scaler.py", "_update_paths.py"}


@pytest.mark.parametrize(("name", "producer", "passed"), [
    ("t5", "ff.wo", {"ff", "norm", "head", "T5Block"}),
    ("attention", "attn", {"head", "AttentionModel"}),
])
def test_the_producer_not_the_layer_that_turned_it_to_nan(name, producer, passed):
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = LossScaler("cpu", diagnose="every_step").watch(model)
    x, y = batches(name, 1)[0]
    _step(model, opt, scaler, x, y)
    trace = scaler.read_forensics().activations
    assert trace.producer == producer
    assert set(trace.passed_on) == passed
    if name == "t5":  # wo's Inf became NaN in the norm: the norm is not blamed
        assert math.isnan(trace.maxima[-1, trace.layers.index("norm")])


def test_a_model_that_fits_gets_series_and_no_advice():
    torch.manual_seed(0)
    model = MODELS["fits"]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = LossScaler("cpu", diagnose=True, headroom_every=2).watch(model)
    memory = InMemorySink()
    loop = LoggingLoop(scaler.policy, sinks=[memory], log_every=4, echo=None)
    for step, (x, y) in enumerate(batches("fits", 8), 1):
        _step(model, opt, scaler, x, y)
        loop.maybe_observe(step, scaler.get_state, read_forensics=scaler.read_forensics)
    summary = loop.finish(scaler.get_state())
    assert "Precision advice" not in summary and not loop.verdicts
    tags = {tag for _, metrics in memory.records for tag in metrics}
    assert {"loss_scale/activation_headroom/inp", "loss_scale/activation_headroom/out",
            "loss_scale/min_activation_headroom"} <= tags
    assert not any("activation_headroom/act" in tag for tag in tags)  # series for parameter layers only
    assert not any("activation_producer" in tag for tag in tags)


@pytest.mark.parametrize(("name", "keep"), [("t5", ("ff.wo",)), ("attention", ("attn",)), ("fits", ())])
def test_audit_known_answers(name, keep):
    torch.manual_seed(0)
    model = MODELS[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = audit_precision(model, batches(name, 2), _mse)
    advice = result.advice
    assert advice.keep_float32 == keep and advice.fits == (not keep) and result.verified
    assert not advice.use_bfloat16 and advice.growth_interval == 1000
    assert advice.initial_scale is not None and 1.0 <= advice.initial_scale <= 2.0**24
    text = result.markdown()
    if keep:
        assert f"Keep these layers in float32: `{keep[0]}` (`keep_in_float32(model, {list(keep)!r})`)" in text
    else:
        assert "float16 fits: no layer needs float32." in text
    # The model is left as it was: weights, dtypes, forwards, no gradients.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_audit_says_bfloat16_when_no_scale_holds_the_gradients():
    """Two branches whose gradients are 2^13 and 2^-37: 50 binades apart, float16 holds 40."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def loss_fn(m, x):
        return m[0](x).float().mean() * 2.0**16 + m[1](x).float().mean() * 2.0**-34

    result = audit_precision(model, [torch.randn(16, 8)], loss_fn)
    assert result.advice.use_bfloat16 and result.advice.initial_scale is None
    assert "no loss scale fits them all" in result.markdown()


def test_keep_in_float32_checks_names_first_and_is_idempotent():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="layers: no module named 'nope'"):
        keep_in_float32(model, ["0", "nope"])
    assert "forward" not in model[0].__dict__  # nothing changed by the refused call
    keep_in_float32(keep_in_float32(model.half(), ["0"]), ["0"])
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.float16):
        assert model[0](torch.ones(1, 4, dtype=torch.float16)).dtype == torch.float32


def _traced_step_ops(layers: int) -> tuple[int, int]:
    """Ops a traced step adds (forward, scale, backward, step, update) over the same step untraced:
    ``(max-norms, the rest)``."""
    counts = []
    for trace in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = LossScaler("cpu", diagnose="every_step")
        scaler.forensics.trace_forward = trace
        scaler.watch(model)
        x = torch.ones(2, 4)
        _step(model, opt, scaler, x)  # plans and lazy state outside the count
        with AtenOps() as ops:
            _step(model, opt, scaler, x)
        counts.append(ops.names)
    norms = counts[1].count("_foreach_norm") - counts[0].count("_foreach_norm")
    return norms, len(counts[1]) - len(counts[0]) - norms


def test_ops_added_per_traced_step_one_per_module_call_and_a_fixed_fold():
    """One multi-tensor max-norm per module call; the fold, the ring and the producer about 50 ops for any
    number of layers (the baseline step's own count moves by an op or two between runs: a bound, not ==)."""
    added = {n: _traced_step_ops(n) for n in (2, 8, 32)}
    for n, (norms, rest) in added.items():
        assert norms == n + 1, added  # the Sequential and its n Linears
        assert 40 <= rest <= 60, added
    print(f"ops added per traced step (max-norms, the rest) by layers: {added}")


def test_side_by_side_with_transformers_debug_underflow_overflow():
    """Both name ``ff.wo``; theirs reads the host at least once per module per step, ours never."""
    pytest.importorskip("transformers")
    from transformers.debug_utils import DebugUnderflowOverflow

    torch.manual_seed(0)
    x, y = batches("t5", 1)[0]
    theirs_model = MODELS["t5"]()
    DebugUnderflowOverflow(theirs_model)
    printed = io.StringIO()
    with HostReadCounter() as theirs, redirect_stdout(printed), pytest.raises(ValueError, match="inf/nan"):
        with torch.autocast("cpu", dtype=torch.float16):
            theirs_model(x)
    frames = printed.getvalue().split("Detected inf/nan")[1]
    last_module = re.findall(r"^\s+(\S+) (\w+)$", frames, re.M)[-1][0]  # the last frame: where it hit
    calls = len(re.findall(r"^\s+\S+ \w+$", frames, re.M))

    torch.manual_seed(0)
    ours_model = MODELS["t5"]()
    opt = torch.optim.SGD(ours_model.parameters(), lr=0.0)
    scaler = LossScaler("cpu", diagnose="every_step").watch(ours_model)
    with HostReadCounter(only_under=(LIBRARY,)) as ours:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ours_model(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
    trace = scaler.forensics.tracer
    scaler.step(opt)
    scaler.update()
    assert last_module == "ff.wo" == scaler.read_forensics().activations.producer
    assert len(theirs.reads) >= calls >= 3  # every module up to wo, one read or more each
    assert ours.reads == [] and trace is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5", "attention"])
def test_the_advised_keep_list_trains_within_5_percent_of_float32(name):
    """200 steps of Adam on mini-batches: float16 with the audit's keep list ends finite, and its last
    50 losses' mean is within 5% of the float32 run's (about 10 s per model on a free core)."""
    torch.manual_seed(0)
    advice = audit_precision(MODELS[name](), batches(name, 4), _mse).advice
    assert advice.keep_float32
    final = {fp16: _train(name, fp16, advice.keep_float32 if fp16 else (), 200)[0] for fp16 in (False, True)}
    assert math.isfinite(final[True])
    assert abs(final[True] - final[False]) <= 0.05 * final[False], final


@pytest.mark.slow
def test_the_advised_initial_scale_is_within_one_backoff_of_where_the_scale_settles():
    """500 steps from the largest scale (2^24, growth every 20 steps): where the dynamic scale ends up. A
    model at its loss floor from the start (no signal to learn, its head at zero), so its gradients keep
    one size: the audit's 4 batches then stand for the run's 500 (about 10 s on a free core)."""
    noise = {"signal": 0.0, "noise": 1.0}
    advice = audit_precision(_at_floor(), batches("fits", 4, **noise), _mse).advice
    _, settled = _train("fits", True, (), 500, initial_scale=2.0**24, growth_interval=20, model=_at_floor(),
                        data=noise)
    assert abs(math.log2(settled) - math.log2(advice.initial_scale)) <= 1, (settled, advice.initial_scale)


def _at_floor():
    torch.manual_seed(0)
    model = MODELS["fits"]()
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.zero_()
    return model


def _train(name, fp16, keep, steps, initial_scale=2.0**16, growth_interval=2000, model=None, data=None):
    torch.manual_seed(0)
    model = keep_in_float32(model if model is not None else MODELS[name](), keep)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    policy = DynamicPolicy(initial_scale=initial_scale, growth_interval=growth_interval)
    scaler = LossScaler("cpu", policy=policy, enabled=fp16)
    losses = []
    for x, y in batches(name, steps, **(data or {})):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return float(torch.stack(losses[-50:]).mean()), scaler.get_scale()



def test_readme_block(capsys):
    from test_readme import block_after

    namespace: dict = {}
    exec(block_after("Precision advisor: does float16 fit, what to keep in float32, which scale"), namespace)
    out = capsys.readouterr().out
    assert "Keep these layers in float32: `2` (`keep_in_float32(model, ['2'])`)" in out
    assert "Layer `2` reaches |1.096e+05|, 1.7× above float16's max 65504." in out
    assert namespace["model"][2].weight.dtype == torch.float32 and "forward" in namespace["model"][2].__dict__


def test_an_armed_tracer_does_not_outlive_its_scaler():
    """A scaler dropped while its tracer waits for the next step takes the global hook with it."""
    before = set(torch.nn.modules.module._global_forward_hooks)  # another test's live scaler may be armed

    def ours():
        return [h for key, h in torch.nn.modules.module._global_forward_hooks.items()
                if key not in before and h.__qualname__ == "ActivationTracer.arm.<locals>.hook"]

    model = MODELS["fits"]()
    scaler = LossScaler("cpu", diagnose="every_step").watch(model)  # armed for step 0
    assert scaler.forensics.tracer.armed and ours()
    del scaler
    model(torch.ones(2, 8))  # the first module call finds the tracer gone and removes the hook
    assert ours() == []
