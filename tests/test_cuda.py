"""What only a CUDA device can show: no host synchronisation in a training step, and launches counted.

Every test here carries the ``cuda`` marker: without a CUDA device it is skipped with the reason, and
the run's summary line says how many were (``tests/conftest.py``). ``python3 dev.py gpu`` runs them.

* Sync-free steps run under ``torch.cuda.set_sync_debug_mode("error")``, which turns every
  synchronising CUDA call (a device-to-host copy, ``.item()``, a blocking host-to-device copy) into
  an error: a fused AdamW step with the forensics on, the Lightning ``Trainer`` with our plugin and
  monitor, and Lightning Fabric with our plugin.
* Launches are counted with torch's profiler: the kernel launches, CUDA-graph launches and
  asynchronous copies/memsets the host issues (CUPTI's runtime-API records), which is what a step
  costs the launch queue; a replayed graph is one launch however many kernels it holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

from lossscale_callbacks._policy import DynamicPolicy, FixedPolicy  # noqa: E402
from lossscale_callbacks.torch._scaler import LossScaler  # noqa: E402

pytestmark = pytest.mark.cuda

# Host-side CUDA runtime/driver calls that put work on the device.
LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync",
})

POLICIES = {
    "default": DynamicPolicy(),
    "hysteresis": DynamicPolicy(initial_scale=2.0**10, growth_interval=3, growth_factor=3.0,
                                backoff_factor=0.25, hysteresis=3, min_scale=2.0**-4, max_scale=2.0**20),
    "fixed": FixedPolicy(2.0**8),
}

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
}


def count_launches(fn: Callable[[], object]) -> int:
    """Launches (kernels, graphs, async copies and memsets) that ``fn`` issues, from torch's profiler."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(event.count for event in prof.key_averages() if event.key in LAUNCH_CALLS)


@contextmanager
def no_sync() -> Iterator[None]:
    """Every synchronising CUDA call inside is an error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def mlp(layers: int, width: int = 16, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` Linear layers (2 parameter tensors each) on the GPU."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).cuda()


def backward(model: torch.nn.Module, scaler: torch.amp.GradScaler, x: torch.Tensor,
             inject_inf: bool = False) -> None:
    """Forward under fp16 autocast and the scaled backward; optionally an Inf in the first gradient."""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if inject_inf:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0].fill_(math.inf)  # a view filled on the device: no host copy


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               x: torch.Tensor, inject_inf: bool = False) -> None:
    """scale -> backward -> unscale (non-fused optimizers) -> step -> update."""
    opt.zero_grad(set_to_none=False)
    backward(model, scaler, x, inject_inf)
    if not getattr(opt, "_step_supports_amp_scaling", False):
        scaler.unscale_(opt)  # where clipping would go
    scaler.step(opt)
    scaler.update()


def test_the_launch_count_counts_launches():
    x = torch.zeros(1024, device="cuda")

    def two_kernels() -> None:
        x.add_(1.0)
        x.mul_(2.0)

    two_kernels()  # lazy initialisation outside the count
    assert count_launches(two_kernels) == 2


@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_update_is_at_most_two_launches_as_the_cuda_runtime_counts_them(policy, overflow):
    model = mlp(2)
    opt = OPTIMIZERS["adamw_fused"](model.parameters())
    scaler = LossScaler(policy=POLICIES[policy], device="cuda")
    x = torch.randn(8, 16, device="cuda")
    for _ in range(3):  # lazy state, optimizer state, anything captured once
        train_step(model, opt, scaler, x)
    opt.zero_grad(set_to_none=False)
    backward(model, scaler, x, inject_inf=overflow)
    scaler.step(opt)
    assert count_launches(scaler.update) <= 2
    assert scaler.get_state().skipped_steps == int(overflow)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_whole_step_launches_at_most_grad_scalers(kind):
    x = torch.randn(8, 16, device="cuda")
    counts = {}
    for name, scaler in (("ours", LossScaler(device="cuda")), ("torch", torch.amp.GradScaler("cuda"))):
        model = mlp(4)
        opt = OPTIMIZERS[kind](model.parameters())
        for _ in range(3):
            train_step(model, opt, scaler, x)
        counts[name] = count_launches(functools.partial(train_step, model, opt, scaler, x))
    assert counts["ours"] <= counts["torch"], counts


def _forensics_launches(layers: int, diagnose: bool | str, headroom_every: int, trace_forward: bool) -> int:
    """Launches a whole fused-AdamW step adds with the forensics on, for an MLP of ``layers`` layers.

    ``trace_forward``: whether the forward trace (the advisor's, on at the headroom samples) is on too.
    """
    x = torch.randn(8, 16, device="cuda")
    counts = []
    for mode in (False, diagnose):
        model = mlp(layers)
        opt = OPTIMIZERS["adamw_fused"](model.parameters())
        scaler = LossScaler(device="cuda", diagnose=mode, headroom_every=headroom_every).watch(model)
        if scaler.forensics is not None:
            scaler.forensics.trace_forward = trace_forward
        for _ in range(3):
            train_step(model, opt, scaler, x)
        counts.append(count_launches(functools.partial(train_step, model, opt, scaler, x)))
    print(f"forensics launches, {layers} layers, diagnose={diagnose!r}, headroom_every={headroom_every}, "
          f"trace_forward={trace_forward}: {counts[1]} - {counts[0]} = {counts[1] - counts[0]}")
    return counts[1] - counts[0]


@pytest.mark.parametrize(("diagnose", "headroom_every"), [(True, 1000), (True, 1), ("every_step", 1000)],
                         ids=["ordinary-step", "sampled-step", "every-step"])
def test_gradient_forensics_launches_do_not_grow_with_the_model(diagnose, headroom_every):
    small = _forensics_launches(2, diagnose, headroom_every, trace_forward=False)  # 4 parameter tensors
    large = _forensics_launches(100, diagnose, headroom_every, trace_forward=False)  # 200 parameter tensors
    # A multi-tensor kernel launches once per chunk of its tensor list (up to ~100 tensors a chunk on
    # CUDA), so 200 tensors may cost each such kernel one or two launches more than 4 do; a pass per
    # parameter would cost about 200 more.
    assert large <= small + 16, (small, large)


@pytest.mark.parametrize(("diagnose", "headroom_every"), [(True, 1), ("every_step", 1000)],
                         ids=["sampled-step", "every-step"])
def test_the_forward_trace_adds_a_few_launches_per_module_call(diagnose, headroom_every):
    """The forward trace takes one multi-tensor max-norm per module call (its design: a module's output
    exists only inside its call): on CUDA a few launches per call, nothing per parameter or element."""
    def trace_only(layers: int) -> int:
        return (_forensics_launches(layers, diagnose, headroom_every, trace_forward=True)
                - _forensics_launches(layers, diagnose, headroom_every, trace_forward=False))

    small, large = trace_only(2), trace_only(100)
    per_call = (large - small) / 98
    print(f"forward trace on CUDA: {small} launches at 2 Linear layers, {large} at 100: "
          f"{per_call:.2f} per module call")
    assert 1 <= per_call <= 4, (small, large)


@pytest.mark.parametrize("diagnose", [False, True, "every_step"])
def test_fused_adamw_step_makes_no_host_sync(diagnose):
    model = mlp(2)
    opt = OPTIMIZERS["adamw_fused"](model.parameters())
    scaler = LossScaler(policy=DynamicPolicy(initial_scale=2.0**10, growth_interval=2), device="cuda",
                        diagnose=diagnose).watch(model)
    x = torch.randn(8, 16, device="cuda")
    train_step(model, opt, scaler, x)  # lazy initialisation and optimizer state before the check
    with no_sync():
        for step in range(4):
            train_step(model, opt, scaler, x, inject_inf=step == 2)
    assert scaler.get_state().skipped_steps == 1
    if diagnose:
        assert scaler.read_forensics() is not None


def _cuda_loader(steps: int) -> torch.utils.data.DataLoader:
    """Batches already on the GPU: the Trainer's transfer is then a no-op, not a blocking copy."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * steps, 16, generator=g).cuda()
    y = torch.randn(8 * steps, 16, generator=g).cuda()
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False, num_workers=0)


@pytest.mark.slow
@pytest.mark.parametrize("diagnose", [False, True])
def test_lightning_plugin_and_monitor_make_no_host_sync_in_the_step(diagnose):
    pl = pytest.importorskip("lightning.pytorch")
    from lossscale_callbacks.lightning._monitor import LossScaleMonitor
    from lossscale_callbacks.lightning._plugin import LossScalePlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def on_after_backward(self) -> None:
            if self.trainer.global_step == 3:
                with torch.no_grad():
                    self.net[0].weight.grad[0, 0].fill_(math.inf)  # a view filled on the device: no host copy

        def configure_optimizers(self):
            return OPTIMIZERS["adamw_fused"](self.parameters())

    class SyncCheck(pl.Callback):
        """Each step after the first, from batch start to batch end, under sync debug mode "error"."""

        def __init__(self) -> None:
            self.checked = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx > 0:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.checked += torch.cuda.get_sync_debug_mode() == 2
            torch.cuda.set_sync_debug_mode("default")

    plugin = LossScalePlugin(policy=DynamicPolicy(initial_scale=2.0**12, growth_interval=2))
    check = SyncCheck()
    # The monitor logs at the Trainer's interval (50 steps): its batch-end hook in the checked steps
    # must not read the state.
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=6, plugins=[plugin],
                         callbacks=[LossScaleMonitor(diagnose=diagnose), check], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Module(), _cuda_loader(6))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert check.checked == 5
    state = plugin.scaler.get_state()
    assert (state.steps, state.skipped_steps) == (6, 1)


@pytest.mark.slow
def test_fabric_plugin_makes_no_host_sync_in_the_step():
    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric

    from lossscale_callbacks.lightning.fabric import LossScaleFabricPlugin

    plugin = LossScaleFabricPlugin(policy=DynamicPolicy(initial_scale=2.0**12, growth_interval=2))
    fabric = Fabric(accelerator="cuda", devices=1, plugins=[plugin])
    net = mlp(2)
    model, opt = fabric.setup(net, OPTIMIZERS["adamw_fused"](net.parameters()))
    x = torch.randn(8, 16, device=fabric.device)

    def step(inject_inf: bool = False) -> None:
        opt.zero_grad()
        with fabric.autocast():
            loss = model(x).float().pow(2).mean()
        fabric.backward(loss)
        if inject_inf:
            with torch.no_grad():
                net[0].weight.grad[0, 0].fill_(math.inf)  # a view filled on the device: no host copy
        opt.step()

    step()
    with no_sync():
        for i in range(4):
            step(inject_inf=i == 2)
    state = plugin.scaler.get_state()
    assert (state.steps, state.skipped_steps) == (5, 1)
