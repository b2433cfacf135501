"""How many aten ops (kernel launches on a GPU) the torch scaler dispatches: counted, deterministic."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from aten_ops import AtenOps  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from update_strategies import dynamic_policies, fixed_policies  # noqa: E402

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402


def _model(n_layers: int = 2, width: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n_layers)])


# The step's outcome written into the device ring (lossscale_callbacks.torch._outcome_ring) before the
# rule's ops: on the CPU 7 more dispatched ops per update; on CUDA they are inside the update's captured
# graph (tests/test_cuda.py: still two launches).
RECORD_OPS = ["add_", "copy_", "copy_", "remainder", "index_copy_", "ne", "add_"]

OPTIMIZERS = {
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
}


def _counted_step(scaler, kind: str, inject_inf: bool = False, model=None):
    """Ops of one whole step (scale, backward, unscale/check, step, update) after 3 warm-up steps."""
    model = model or _model()
    opt = OPTIMIZERS[kind](model.parameters())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        with AtenOps() as ops:
            scaler.scale(loss).backward()
            if inject_inf:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            with AtenOps() as update_ops:
                scaler.update()
        return ops, update_ops

    for _ in range(3):
        step()
    return step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("inject_inf", [False, True])
def test_a_whole_step_dispatches_no_more_than_with_grad_scaler_plus_the_outcome_record(kind, inject_inf):
    ours, ours_update = _counted_step(LossScaler(device="cpu"), kind, inject_inf)
    theirs, theirs_update = _counted_step(torch.amp.GradScaler("cpu"), kind, inject_inf)
    assert len(ours) <= len(theirs) + len(RECORD_OPS), (ours.names, theirs.names)
    assert ours_update.names[:len(RECORD_OPS)] == RECORD_OPS
    assert len(ours_update) <= 4 + len(RECORD_OPS) and len(theirs_update) == 1
    assert "_local_scalar_dense" not in ours_update.names


@settings(max_examples=25, deadline=None)
@given(policy=st.one_of(dynamic_policies(intervals=st.integers(1, 2**31 - 1)), fixed_policies),
       flags=st.lists(st.booleans(), min_size=3, max_size=3))
def test_update_dispatches_at_most_6_ops_for_any_policy_and_4_without_hysteresis_plus_record(policy, flags):
    scaler = LossScaler(device="cpu", policy=policy)
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    most = (4 if policy.constants.hysteresis <= 1 else 6) + len(RECORD_OPS)
    for finite in flags:
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        if not finite:
            model[0].bias.grad[0] = float("nan")
        scaler.step(opt)
        with AtenOps() as ops:
            scaler.update()
        assert len(ops) <= most, ops.names
        opt.zero_grad()


def test_the_default_policy_and_grad_scalers_settings_update_in_4_ops_after_the_record():
    for scaler in (LossScaler(device="cpu"), LossScaler(device="cpu", policy=DynamicPolicy()),
                   LossScaler(device="cpu", policy=FixedPolicy(1.0))):
        _, update_ops = _counted_step(scaler, "adam_fused")
        assert update_ops.names == [*RECORD_OPS, "_amp_update_scale_", "_amp_update_scale_", "clamp_", "add_"]


def test_the_float32_reciprocal_is_grad_scalers_float64_one_on_every_exponent():
    """unscale_ takes 1/scale in float32; GradScaler in float64 then rounds. Same bits, every exponent
    a scale can have (both bounds of float32 included), in the vectorised and the 0-d kernel."""
    generator = torch.Generator().manual_seed(0)
    mantissas = torch.rand(2048, generator=generator, dtype=torch.float64) + 1.0
    mantissas = torch.cat([mantissas, torch.tensor([1.0, 2.0 - 2.0**-23, 1.5])]).float()
    exponents = torch.arange(-126, 128)
    scales = torch.ldexp(mantissas[None, :], exponents[:, None]).reshape(-1)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    ours = torch.reciprocal(scales)
    theirs = scales.double().reciprocal().float()
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    for scale in scales[::997]:  # 0-d, as the scaler's scale
        bits = torch.reciprocal(scale).view(torch.int32)
        assert bits == scale.double().reciprocal().float().view(torch.int32)


@pytest.mark.cuda
def test_the_float32_reciprocal_matches_on_cuda_too():
    generator = torch.Generator().manual_seed(1)
    mantissas = (torch.rand(4096, generator=generator, dtype=torch.float64) + 1.0).float()
    scales = torch.ldexp(mantissas[None, :], torch.arange(-126, 128)[:, None]).reshape(-1).cuda()
    assert torch.equal(torch.reciprocal(scales).view(torch.int32),
                       scales.double().reciprocal().float().view(torch.int32))
