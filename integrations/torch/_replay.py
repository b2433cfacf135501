"""Replaying a bad step: the same micro-batches, forward and backward, on the same weights, with the
step's RNG state, at the same scale, at a much lower scale and in float32; the run left bit-identical.

When it runs: at the end of :meth:`LossScaler.update` of a step the host knows was skipped. A skipped
step leaves the parameters and the optimizer's state as they were, so they are the step's own. With a
non-fused optimizer the scaler already read the skip decision on the host in ``step()``: the replay
adds no host read to an ordinary step. With a fused optimizer (the skip is decided inside its kernel)
knowing it takes one read of the step's flag per step, at ``update()``: that is what ``replay=`` costs
there, and only there. Per micro-batch an ordinary step keeps a reference to the batch and a copy of
the CPU generator's state (a few µs) and of the CUDA generators' (host values, no device read), and
drops both at the step's end.

What a replay leaves as it found it (so the run goes on bit for bit as without replay): the parameters
(never written: no optimizer step), the optimizer's state, the gradients (the step's ``.grad`` tensors
are set aside and put back, the replay's own are dropped), the module buffers (BatchNorm's running
statistics: copied and restored), the RNG states (CPU, every CUDA device, Python's ``random``,
NumPy's), the scaler's state and forensics (its scale is read, never moved; the forward trace's hook
sees none of the replay's calls). Under ``torch.distributed`` every rank replays the same steps
(the skip decision is the same everywhere), each on its own samples, all three replays always (so
their collectives line up), then one all-gather says which ranks' samples overflowed again. A DDP
wrapper's gradient sync is off during a replay (``no_sync``).

What it finds (read from the device, on the bad step only): per replay whether the loss and the
gradients were finite; in the low-precision forward, the first module whose output turned
non-finite from finite inputs (the producing layer) and which rows of that output (which samples of
the micro-batch) did; at the same scale, the gradients' origin (the flagged layer nearest the loss,
the forensics' rule).
"""

from __future__ import annotations

import contextlib
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lossscale_callbacks.integration import Replay, layer_of
from lossscale_callbacks.torch._forensics import _parameter_names, unwrap

__all__ = ["MicroRecord", "StepReplayer", "capture_rng", "loss_of_output"]


def capture_rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state and, where CUDA is initialised, every CUDA device's (host values)."""
    cuda = (torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None)
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def loss_of_output(output: Any) -> torch.Tensor:
    """The loss in what a training step returned: a tensor, a mapping's ``"loss"``, an object's
    ``.loss`` (a Transformers model output), or a tuple's first element.

    Raises:
        ValueError: none of these holds a tensor.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "keys"):
        value = output.get("loss") if hasattr(output, "get") else None
        if isinstance(value, torch.Tensor):
            return value
    value = getattr(output, "loss", None)
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"the replay could not find the loss in what the step returned "
                     f"({type(output).__name__})")


class MicroRecord:
    """One micro-batch as the step received it: the batch (a reference), the RNG state before its
    forward, and the autocast it ran under (found at the model's forward)."""

    __slots__ = ("autocast", "batch", "rng")

    def __init__(self, batch: Any, rng: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
        self.batch = batch
        self.rng = rng
        self.autocast: tuple[str, torch.dtype] | None = None


def _rows_of(batch: Any) -> int | None:
    """The number of samples in a batch: the first dimension of its first tensor."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


class _Saved:
    """What a replay must give back: gradients, buffers, RNG states; restored on exit, whatever happened."""

    def __init__(self, params: Sequence[torch.nn.Parameter], buffers: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.grads = [p.grad for p in params]
        self.buffers = [(b, b.detach().clone()) for b in buffers]
        self.rng = capture_rng()
        self.py_random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.np_random = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            for param, grad in zip(self.params, self.grads, strict=True):
                param.grad = grad
            for buffer, copy in self.buffers:
                buffer.copy_(copy)
        _set_rng(self.rng)
        random.setstate(self.py_random)
        if self.np_random is not None:
            sys.modules["numpy"].random.set_state(self.np_random)


class _ForwardWatch:
    """The replay's own forward hook: per module call of the model, inputs and output finite, and the
    output's non-finite rows; read once per forward."""

    def __init__(self, names: dict[torch.nn.Module, str], rows: int | None) -> None:
        self.names = names
        self.rows = rows
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = self.names.get(module)
        if name is None:
            return
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not outs:
            return
        ins = [t for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
        with torch.no_grad():
            out_ok = torch.stack([torch.isfinite(t).all() for t in outs]).all()
            in_ok = torch.stack([torch.isfinite(t).all() for t in ins]).all() if ins else out_ok.new_ones(())
            first = outs[0]
            bad_rows = None
            if self.rows and first.dim() > 0 and first.shape[0] == self.rows:
                bad_rows = torch.isfinite(first.reshape(self.rows, -1)).all(dim=1).logical_not()
        self.calls.append((name, in_ok, out_ok, bad_rows))

    def producer(self) -> tuple[str | None, tuple[int, ...]]:
        """The first call whose inputs were finite and whose output was not, and its non-finite rows."""
        if not self.calls:
            return None, ()
        flags = torch.stack([torch.stack([i, o]) for _, i, o, _ in self.calls]).cpu().tolist()
        for (name, _, _, bad_rows), (in_ok, out_ok) in zip(self.calls, flags, strict=True):
            if in_ok and not out_ok:
                rows = (() if bad_rows is None
                        else tuple(int(i) for i in torch.nonzero(bad_rows).flatten().tolist()))
                if self.rows is not None and len(rows) == self.rows:
                    rows = ()  # every row: the layer mixes the samples, or all of them overflow
                return name, rows
        return None, ()


class StepReplayer:
    """Replays the micro-batches of a bad step (see the module's docstring).

    Args:
        model: the watched model (its parameters' gradients, its buffers, its layer names).
        loss_of: the forward and the loss of one micro-batch, as the step computes them, without the
            autocast block (the replay runs it under the step's autocast, then with autocast off).
        low_scale: the much lower scale (the policy's minimum).
        autocast: the step's autocast ``(device_type, dtype)`` when the integration knows it; otherwise
            it is taken from the model's forward at each micro-batch.
    """

    def __init__(self, model: torch.nn.Module, loss_of: Callable[[Any], Any], low_scale: float,
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        self._model = weakref.ref(model)
        self.loss_of = loss_of
        self.low_scale = low_scale
        self.autocast = autocast
        self.replaying = False

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model()

    def note_autocast(self, record: MicroRecord, device_type: str) -> None:
        """At the model's forward: the autocast the micro-batch runs under (a host query)."""
        if record.autocast is None and torch.is_autocast_enabled(device_type):
            record.autocast = (device_type, torch.get_autocast_dtype(device_type))

    # ---------------------------------------------------------------------------------- replay

    def replay(self, records: Sequence[MicroRecord], scale: float) -> Replay:
        """Replay ``records`` (one step's micro-batches) at ``scale``, the low scale and in float32."""
        model = self.model
        if model is None:
            raise RuntimeError("the model to replay is gone")
        inner, _ = unwrap(model)
        params = [p for p in model.parameters() if p.requires_grad]
        saved = _Saved(params, list(model.buffers()))
        autocast = self.autocast or next((r.autocast for r in records if r.autocast is not None), None)
        dtype = "bfloat16" if autocast is not None and autocast[1] == torch.bfloat16 else "float16"
        names = {module: name or type(inner).__name__ for name, module in inner.named_modules()}
        layer_of_param = _layers(model)
        self.replaying = True
        try:
            with torch.enable_grad(), _no_sync(model):
                same = [self._run(r, scale, autocast, params, names) for r in records]
                low = [self._run(r, self.low_scale, autocast, params, None) for r in records]
                full = ([self._run(r, 1.0, (autocast[0], None), params, None) for r in records]
                        if autocast is not None else None)
        finally:
            self.replaying = False
            saved.restore()
        producer = next((s[2] for s in same if s[2] is not None), None)
        rows = tuple(s[3] for s in same)
        origin = _origin([s[4] for s in same], layer_of_param)
        same_ok = all(s[0] for s in same)
        others = _ranks_reproduced(not same_ok)
        return Replay(scale=scale, same=same_ok, low_scale=self.low_scale,
                      low=all(s[0] for s in low), float32=None if full is None else all(s[0] for s in full),
                      dtype=dtype, micro_finite=tuple(s[0] for s in same), rows=rows, producer=producer,
                      origin=origin, other_ranks=others)

    def _run(self, record: MicroRecord, scale: float, autocast: tuple[str, torch.dtype | None] | None,
             params: list[torch.nn.Parameter], names: dict[torch.nn.Module, str] | None
             ) -> tuple[bool, bool, str | None, tuple[int, ...], list[bool] | None]:
        """One micro-batch forward and backward; (finite, loss finite, producer, rows, grads finite)."""
        for param in params:
            param.grad = None
        _set_rng(record.rng)
        watch = _ForwardWatch(names, _rows_of(record.batch)) if names is not None else None
        handle = (torch.nn.modules.module.register_module_forward_hook(watch, with_kwargs=True)
                  if watch is not None else None)
        try:
            # (device, dtype): the step's autocast; (device, None): autocast off there (float32 compute).
            context = (contextlib.nullcontext() if autocast is None else
                       torch.autocast(autocast[0], enabled=False) if autocast[1] is None else
                       torch.autocast(autocast[0], dtype=autocast[1]))
            with context:
                loss = loss_of_output(self.loss_of(record.batch))
        finally:
            if handle is not None:
                handle.remove()
        producer, rows = watch.producer() if watch is not None else (None, ())
        loss = loss.float()
        if loss.dim():
            loss = loss.sum()
        loss_finite = bool(torch.isfinite(loss.detach()))
        if loss.requires_grad:
            (loss * scale).backward()
        with torch.no_grad():
            checks = [torch.isfinite(p.grad).all().to("cpu", non_blocking=False) if p.grad is not None
                      else torch.ones((), dtype=torch.bool) for p in params]
        flags = [bool(v) for v in torch.stack(checks).tolist()] if checks else []
        finite = loss_finite and all(flags)
        return finite, loss_finite, producer, rows, flags if names is not None else None


@contextlib.contextmanager
def _no_sync(model: torch.nn.Module) -> Iterator[None]:
    """DDP's gradient sync off while replaying (each rank replays its own samples)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    with model.no_sync() if isinstance(model, ddp) else contextlib.nullcontext():
        yield


def _layers(model: torch.nn.Module) -> list[str]:
    """The layer of each trainable parameter in ``model.parameters()`` order (the forensics' names)."""
    names = _parameter_names(model)
    return [layer_of(names.get(id(p), f"param{i}"))
            for i, p in enumerate(p for p in model.parameters() if p.requires_grad)]


def _origin(flags_per_micro: list[list[bool] | None], layers: list[str]) -> str | None:
    """The flagged layer nearest the loss (last in registration order) among non-finite gradients."""
    flagged: set[str] = set()
    for flags in flags_per_micro:
        for ok, layer in zip(flags or (), layers, strict=False):
            if not ok:
                flagged.add(layer)
    order = list(dict.fromkeys(layers))
    last = [layer for layer in order if layer in flagged]
    return last[-1] if last else None


def _ranks_reproduced(here: bool) -> tuple[int, ...]:
    """Under ``torch.distributed``: the other ranks whose replay reproduced the step (one all-gather)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ()
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1.0 if here else 0.0], device=device)
    gathered = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flag)
    me = dist.get_rank()
    return tuple(r for r, value in enumerate(gathered) if r != me and float(value) > 0)
