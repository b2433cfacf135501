"""torch forensics on the models people build: bounded ops, wrappers by type, sparse NaN, LayerDrop."""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")

from aten_ops import AtenOps  # noqa: E402
from lightning_scripts.host_reads import _caller_file  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import lossscale_callbacks  # noqa: E402
import lossscale_callbacks.torch  # noqa: E402
from lossscale_callbacks.policy import DynamicPolicy  # noqa: E402
from lossscale_callbacks.torch.forensics import MAX_PLANS, unwrap  # noqa: E402
from lossscale_callbacks.torch.scaler import LossScaler  # noqa: E402


def _mlp(n_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_layers)])


def _step_ops(model, opt, scaler, x, inject_inf=False):
    opt.zero_grad(set_to_none=False)
    loss = model(x).pow(2).mean()
    with AtenOps() as ops:
        scaler.scale(loss).backward()
        if inject_inf:
            model[-1].weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
    return len(ops)


def _added_ops(n_layers: int, kind: str) -> list[int]:
    """Ops diagnose=True adds to each of 4 steps (sampled every other step, one overflow)."""
    added = []
    runs = {}
    for diagnose in (False, True):
        model = _mlp(n_layers)
        opt = (torch.optim.AdamW(model.parameters(), fused=True) if kind == "fused"
               else torch.optim.AdamW(model.parameters(), foreach=True))
        scaler = LossScaler(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10), diagnose=diagnose,
                            headroom_every=2)
        if scaler.forensics is not None:  # the gradient side alone; the forward trace: test_advice_torch.py
            scaler.forensics.trace_forward = False
        scaler.watch(model)
        x = torch.ones(2, 4)
        _step_ops(model, opt, scaler, x)  # lazy init and plans outside the count
        runs[diagnose] = [_step_ops(model, opt, scaler, x, inject_inf=step == 2) for step in range(4)]
    added = [on - off for on, off in zip(runs[True], runs[False], strict=True)]
    return added


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_diagnose_adds_the_same_ops_to_a_4_and_a_200_parameter_model(kind):
    small, large = _added_ops(2, kind), _added_ops(100, kind)  # 4 and 200 parameter tensors
    assert small == large, (small, large)
    assert max(large) < 80  # ordinary and sampled steps alike: a bounded handful of ops
    assert large[0] != large[1]  # the sampled steps (every other) do more, still the same for both


@pytest.mark.parametrize("attribute", ["module", "_forward_module", "_orig_mod"])
def test_a_submodule_called_like_a_wrappers_attribute_is_a_layer(attribute):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            setattr(self, attribute, torch.nn.Linear(4, 4))
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(getattr(self, attribute)(x))

    model = Net()
    assert unwrap(model) == (model, "")
    scaler = LossScaler(device="cpu", diagnose=True).watch(model)
    assert set(scaler.forensics._names.values()) == {f"{attribute}.weight", f"{attribute}.bias",
                                                     "head.weight", "head.bias"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    getattr(model, attribute).weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.read_forensics().layer_skips == {attribute: 1}


def test_real_wrappers_are_looked_through_by_type():
    inner = _mlp(2)
    for wrapper, prefix in ((torch.nn.DataParallel(inner), "module."),
                            (torch.compile(inner), "_orig_mod."),
                            (torch.compile(torch.nn.DataParallel(inner)), "_orig_mod.module.")):
        assert unwrap(wrapper) == (inner, prefix)
        scaler = LossScaler(device="cpu", diagnose=True).watch(wrapper)
        assert set(scaler.forensics._names.values()) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_nan_in_a_sparse_gradient_is_reported_as_nan():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    head = torch.nn.Linear(4, 1)
    model = torch.nn.Sequential(embedding, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(device="cpu", diagnose=True).watch(model)
    scaler.scale(model(torch.tensor([1, 2, 2])).sum()).backward()
    assert embedding.weight.grad.is_sparse
    embedding.weight.grad._values()[0, 0] = math.nan
    scaler.step(opt)
    scaler.update()
    forensics = scaler.read_forensics()
    assert forensics.causes["grad_nan"] == 1 and forensics.causes["grad_inf"] == 0
    assert forensics.layer_skips == {"0": 1}


LIBRARY = tuple(os.path.dirname(m.__file__) + os.sep
                for m in (lossscale_callbacks, lossscale_callbacks.torch))


class _NewTensors(TorchFunctionMode):
    """Records every way the library turns host values into a tensor (on a GPU: a host-to-device copy)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.tensor, torch.as_tensor, torch.from_numpy):
            where = os.path.realpath(_caller_file())
            if where.startswith(LIBRARY):
                self.calls.append((func.__name__, os.path.basename(where)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [False, True])
def test_an_inf_clipped_after_unscale_is_still_told_as_inf_in_its_layer(fused):
    """unscale_, then clip_grad_norm_ (which turns an Inf into NaN and zeroes the rest), then step: the
    forensics tell what the check saw (the Trainer and Lightning clip there)."""
    model = _mlp(3)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    scaler = LossScaler(device="cpu", policy=DynamicPolicy(initial_scale=2.0**10), diagnose=True,
                        headroom_every=1000).watch(model)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).pow(2).mean()).backward()
        if step == 1:
            model[1].weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    forensics = scaler.read_forensics()
    assert forensics.causes["grad_inf"] == 1 and forensics.causes["grad_nan"] == 0
    assert forensics.layer_skips == {"1": 1}


@pytest.mark.parametrize("fused", [False, True])
def test_layerdrop_keeps_one_plan_and_makes_no_host_copy_in_the_step(fused):
    """Every step trains another subset of layers (LayerDrop, a mixture of experts' routing)."""
    model = _mlp(12)
    opt = torch.optim.AdamW(model.parameters(), fused=fused, foreach=not fused)
    scaler = LossScaler(device="cpu", diagnose=True, headroom_every=3).watch(model)
    generator = torch.Generator().manual_seed(0)

    def step(index):
        opt.zero_grad(set_to_none=True)
        keep = torch.rand(12, generator=generator) > 0.5
        x = torch.ones(2, 4)
        for layer, kept in zip(model, keep.tolist(), strict=True):
            x = layer(x) if kept else x
        scaler.scale(x.pow(2).mean() + 0 * model[0](x).sum()).backward()
        if index == 5:
            model[0].weight.grad.fill_(math.inf)
        scaler.step(opt)
        scaler.update()

    step(0)
    with _NewTensors() as new:
        for index in range(1, 40):
            step(index)
    assert new.calls == []
    assert len(scaler.forensics._plans) == 1 <= MAX_PLANS
    assert scaler.read_forensics().layer_skips == {"0": 1}


def test_the_plan_cache_is_bounded_when_optimizers_come_and_go():
    model = _mlp(3)
    scaler = LossScaler(device="cpu", diagnose=True).watch(model)
    alive = []  # parameters kept alive: their ids, which key the plans, stay distinct
    for i in range(MAX_PLANS + 5):
        extra = [] if i < 6 else [torch.nn.Parameter(torch.ones(2))]  # a new list of parameters each time
        alive += extra
        params = list(model.parameters())[: 1 + i % 6] + extra
        opt = torch.optim.SGD(params, lr=0.0)
        scaler.scale(model(torch.ones(1, 4)).sum() + sum(p.sum() for p in params)).backward()
        scaler.step(opt)
        scaler.update()
        model.zero_grad()
    assert len(scaler.forensics._plans) == MAX_PLANS


@pytest.mark.cuda
def test_layerdrop_on_cuda_passes_sync_debug_mode_error():
    model = _mlp(8).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = LossScaler(device="cuda", diagnose=True, headroom_every=2).watch(model)
    masks = [[(i + j) % 3 != 0 for j in range(8)] for i in range(10)]

    def step(mask):
        opt.zero_grad(set_to_none=True)
        x = torch.ones(2, 4, device="cuda")
        for layer, kept in zip(model, mask, strict=True):
            x = layer(x) if kept else x
        scaler.scale(x.pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()

    for mask in masks[:3]:  # every subset's plan, lazy init and the graph capture before the check
        step(mask)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mask in masks:
            step(mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(scaler.forensics._plans) == 1


def _origin_run(fused: bool, poison) -> dict:
    """Six steps of a 4-layer MLP (layers `0`, `2`, `4`, `6`), ``poison(model, step)`` at steps 1 and 4."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
              torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = LossScaler(device="cpu", diagnose=True).watch(model)
    x = torch.randn(16, 8)
    for step in range(6):
        opt.zero_grad()
        poison(model, step in (1, 4), "before")
        scaler.scale(model(x).pow(2).mean()).backward()
        poison(model, step in (1, 4), "after")
        scaler.step(opt)
        scaler.update()
    found = scaler.read_forensics()
    return {"skips": found.layer_skips, "origins": found.layer_origins, "order": found.layer_order,
            "sentences": found.sentences()}


def _poison_output(_module, _inputs, output):
    output.register_hook(lambda grad: torch.full_like(grad, math.inf))


def _late_output(model, hot, when):
    """An Inf in layer `4`'s output gradient: the backward pass carries it into `2` and `0`."""
    if when == "before" and hot:
        model._poison = model[4].register_forward_hook(_poison_output)
    elif when == "after" and hot:
        model._poison.remove()


def _first_weight(model, hot, when):
    """An Inf in layer `0`'s weight gradient only."""
    if when == "after" and hot:
        model[0].weight.grad[0, 0] = math.inf


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_origin_is_the_layer_nearest_the_loss_among_the_flagged_ones(fused):
    late = _origin_run(fused, _late_output)
    assert late["order"] == ("0", "2", "4", "6")  # registration order, the forward order here
    assert late["skips"] == {"0": 2, "2": 2, "4": 2}  # `6` (after the poisoned output) stays finite
    assert late["origins"] == {"4": 2}
    first = _origin_run(fused, _first_weight)
    assert first["skips"] == {"0": 2} and first["origins"] == {"0": 2}
    assert any(s.startswith("The overflow started in layer `0` in all 2 skipped steps")
               for s in first["sentences"])
