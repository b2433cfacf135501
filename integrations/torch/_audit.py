"""The float16 audit of a torch module before training: does it fit, what to keep in float32, which scale.

:func:`audit_precision` runs a few sample batches forward and backward:

1. in the reference precision (float32, or the model's own dtype, e.g. a bf16-pretrained model):
   each layer's largest ``|output|`` (the forward tracer of :mod:`lossscale_callbacks.torch._tracing`),
   each layer's largest weight, the gradients' extent (the largest, and the 1% quantile of the non-zero
   ``|g|``);
2. under float16 autocast, with the layers found so far kept in float32: the layer that produced the
   first non-finite activation (or, when the forward pass is finite, the layer nearest the loss whose
   gradients are non-finite at scale 1), added to the keep set until the runs are finite
   (:func:`lossscale_callbacks.forensics._advice.smallest_keep_set`);
3. with that set kept: the largest power-of-two loss scale at which every sample batch's gradients are
   finite (a bisection over 2^0 to 2^24), the advised starting scale.

The rules and the words are the core's (:func:`lossscale_callbacks.forensics._advice.advise`); this module
only measures. :func:`keep_in_float32` applies a keep list to a module: autocast off inside those modules,
their inputs cast to float32 and their parameters kept float32.

The model's weights and gradients are left as they were; its modules are put back after each run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from lossscale_callbacks.integration import (
    ActivationTrace,
    AuditResult,
    GradientRange,
    advise,
    largest_finite_scale,
    layer_of,
    smallest_keep_set,
)
from lossscale_callbacks.torch._forensics import unwrap
from lossscale_callbacks.torch._tracing import ActivationTracer

__all__ = ["audit_precision", "keep_in_float32"]

_KEPT = "_lossscale_keep_float32"  # the module's own forward, kept under this attribute when wrapped
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module:
    inner, _ = unwrap(model)
    if name == type(inner).__name__:
        return inner
    try:
        return inner.get_submodule(name)
    except AttributeError:
        known = [n for n, _ in inner.named_modules() if n][:8]
        raise ValueError(f"layers: no module named {name!r} in the model; its modules are named like "
                         f"{known}") from None


def _to_float32(value: Any) -> Any:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    value)


def _wrap(module: torch.nn.Module) -> None:
    if _KEPT in module.__dict__:
        return
    forward = module.forward
    device = next((p.device.type for p in module.parameters()), "cpu")

    def float32_forward(*args: Any, **kwargs: Any) -> Any:
        # Off for everything inside, inputs in float32: the module computes as in a float32 model.
        with torch.autocast(device_type=device, enabled=False):
            return forward(*_to_float32(args), **_to_float32(kwargs))

    module.__dict__[_KEPT] = forward
    module.forward = float32_forward


def _unwrap_module(module: torch.nn.Module) -> None:
    if _KEPT in module.__dict__:
        del module.__dict__[_KEPT]
        del module.forward  # the class's forward again


def keep_in_float32(model: torch.nn.Module, layers: Iterable[str]) -> torch.nn.Module:
    """Keep the named layers in float32 under float16 autocast: autocast off inside them, their floating
    inputs cast to float32, their parameters and buffers float32 (the same ``Parameter`` objects, so an
    optimizer made before still holds them).

    Args:
        model: the model (framework wrappers such as DDP or ``torch.compile`` are looked through).
        layers: module names as the audit and the forensics give them (``"encoder.3.ff.wo"``).

    Returns:
        ``model``, changed in place (calling it again with the same names changes nothing).

    Raises:
        ValueError: a name is not a module of ``model``.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> _ = keep_in_float32(model, ["0"])
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     model[0](torch.ones(1, 4)).dtype, model[1](torch.ones(1, 4)).dtype
        (torch.float32, torch.float16)
    """
    modules = [_module(model, name) for name in layers]  # every name checked before anything changes
    for module in modules:
        module.float()
        _wrap(module)
    return model


@contextlib.contextmanager
def _kept(model: torch.nn.Module, layers: Sequence[str]) -> Iterator[None]:
    """``layers`` in float32 for the block, then put back as they were (dtypes and forwards)."""
    modules = [_module(model, name) for name in layers]
    dtypes = [{name: t.dtype for name, t in [*m.named_parameters(), *m.named_buffers()]} for m in modules]
    fresh = [_KEPT not in m.__dict__ for m in modules]
    keep_in_float32(model, layers)
    try:
        yield
    finally:
        for module, before, new in zip(modules, dtypes, fresh, strict=True):
            if new:
                _unwrap_module(module)
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                if name in before and tensor.dtype != before[name]:
                    tensor.data = tensor.data.to(before[name])


def _loss(model: torch.nn.Module, batch: Any, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(model, batch)
    out = model(*batch) if isinstance(batch, tuple) else model(batch)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn: the model's output is not a loss (a one-value tensor or an output with "
                         "`.loss`); pass loss_fn=lambda model, batch: ... returning the loss")
    return loss


class _Runner:
    """The sample batches run one way or another; gradients cleared after each."""

    def __init__(self, model: torch.nn.Module, batches: list[Any], loss_fn: Callable[..., Any] | None,
                 device_type: str) -> None:
        self.model, self.batches, self.loss_fn, self.device_type = model, batches, loss_fn, device_type
        self.tracer = ActivationTracer()
        self.tracer.watch(model)
        inner, prefix = unwrap(model)
        self.params = [(layer_of(n[len(prefix):]) if "." in n[len(prefix):] else type(inner).__name__, p)
                       for n, p in model.named_parameters() if p.requires_grad]

    def _grads(self) -> list[tuple[str, torch.Tensor]]:
        out = [(layer, p.grad.detach().float()) for layer, p in self.params if p.grad is not None]
        self.model.zero_grad(set_to_none=True)
        return out

    def reference(self) -> tuple[ActivationTrace | None, list[tuple[str, torch.Tensor]]]:
        """Float32 (the model's own dtype): the activation maxima, and each layer's ``|gradient|`` values."""
        traces, grads = [], []
        for i, batch in enumerate(self.batches):
            self.tracer.arm()
            loss = _loss(self.model, batch, self.loss_fn)
            self.tracer.end_step(i + 1)
            loss.float().backward()
            traces.append(self.tracer.read())
            grads += [(layer, g.abs().flatten()) for layer, g in self._grads()]
        return _merged([t for t in traces if t is not None]), grads

    def half(self, keep: Sequence[str], scale: float = 1.0) -> tuple[str | None, bool]:
        """Float16 autocast with ``keep`` in float32: ``(forward producer, gradients finite)``."""
        producer, finite = None, True
        with _kept(self.model, keep):
            for i, batch in enumerate(self.batches):
                self.tracer.arm()
                with torch.autocast(self.device_type, dtype=torch.float16):
                    loss = _loss(self.model, batch, self.loss_fn)
                self.tracer.end_step(i + 1)
                trace = self.tracer.read()
                if trace is not None and trace.producer is not None:
                    self.model.zero_grad(set_to_none=True)
                    return trace.producer, False
                (loss.float() * scale).backward()
                bad = [layer for layer, g in self._grads() if not bool(torch.isfinite(g).all())]
                if bad:
                    finite = False
                    producer = producer or bad[-1]  # the backward pass starts nearest the loss
        return (None if finite else producer), finite

    def largest_scale(self, keep: Sequence[str]) -> float:
        """The largest power of two (2^0 to 2^24) at which every batch's float16 gradients are finite."""
        return largest_finite_scale(lambda scale: self.half(keep, scale)[1])


def _extent(grads: list[tuple[str, torch.Tensor]], keep: Sequence[str], root: str) -> GradientRange | None:
    """The largest and the 1% quantile of the non-zero ``|gradient|`` of the layers float16 computes (those
    kept in float32 have float32 gradients: their spread is no float16 concern)."""
    def kept(layer: str) -> bool:
        return any(layer == k or layer.startswith(k + ".") or k == root for k in keep)

    parts = [g for layer, g in grads if not kept(layer)]
    values = torch.cat(parts) if parts else torch.zeros(0)
    values = values[torch.logical_and(values > 0, torch.isfinite(values))]
    if not values.numel():
        return None
    small = torch.kthvalue(values, max(1, int(1e-2 * values.numel()))).values
    return GradientRange(largest=float(values.max()), smallest=float(small))


def _merged(traces: list[ActivationTrace]) -> ActivationTrace | None:
    """One row: per layer the largest ``|output|`` over the batches (non-finite kept)."""
    if not traces:
        return None
    layers = traces[0].layers
    rows = [np.array([t.latest().get(layer, 0.0) for layer in layers]) for t in traces]
    stacked = np.stack(rows)
    worst = np.where(np.isnan(stacked).any(axis=0), np.nan, np.max(np.nan_to_num(stacked, nan=0.0), axis=0))
    return ActivationTrace(layers=layers, steps=(len(traces),), maxima=worst[None, :], traced=len(traces),
                           series_layers=traces[0].series_layers)


def audit_precision(model: torch.nn.Module, batches: Iterable[Any],
                    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None, *,
                    device_type: str | None = None, max_rounds: int = 8) -> AuditResult:
    """Can this model train in float16? Which layers must stay float32, which loss scale to start at.

    Runs the sample batches forward and backward in the model's own precision, then under float16
    autocast (see the module docstring); the weights are not changed, the gradients are cleared.

    Args:
        model: the model, in float32 or its own dtype (a bf16-pretrained model stays bf16 for step 1).
        batches: a few sample batches; each is passed to ``loss_fn``.
        loss_fn: ``loss_fn(model, batch)`` returns the loss; default: ``model(batch)`` (``model(*batch)``
            for a tuple) is the loss or has ``.loss`` (a Transformers model given labels).
        device_type: autocast's device type (default: the model's parameters').
        max_rounds: the most float16 runs spent finding the keep set.

    Returns:
        An :class:`~lossscale_callbacks.forensics._advice.AuditResult`: ``.advice`` (``fits``,
        ``keep_float32``, ``use_bfloat16``, ``initial_scale``, ``growth_interval``, the words),
        ``.markdown()``, ``.to_dict()``.

    Raises:
        ValueError: no batch, or the model's output is not a loss and no ``loss_fn`` was given.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> batches = [torch.randn(8, 4) for _ in range(2)]
        >>> result = audit_precision(model, batches, lambda m, x: m(x).pow(2).mean())
        >>> result.advice.fits, result.advice.keep_float32
        (True, ())
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches: give at least one sample batch")
    first = next(model.parameters(), None)
    device_type = device_type or (first.device.type if first is not None else "cpu")
    runner = _Runner(model, batches, loss_fn, device_type)
    trace, grads = runner.reference()
    keep, verified = smallest_keep_set(lambda kept: runner.half(kept)[0], max_rounds)
    gradients = _extent(grads, keep, type(unwrap(model)[0]).__name__)
    limit = 65504.0
    over = {layer: value for layer, value in (trace.latest() if trace else {}).items()
            if math.isfinite(value) and value > limit}
    for layer, param in runner.params:
        largest = float(param.detach().abs().max()) if param.numel() else 0.0
        if largest > limit:
            over[layer] = max(over.get(layer, 0.0), largest)
    scale = runner.largest_scale(keep) if verified else None
    advice = advise(over_range=over, producers=dict.fromkeys(keep, 1), keep_float32=keep, gradients=gradients,
                    initial_scale=scale,
                    code=lambda names: f"keep_in_float32(model, {list(names)!r})")
    reference = _DTYPES.get(first.dtype, "float32") if first is not None else "float32"
    return AuditResult(advice=advice, trace=trace, gradients=gradients, batches=len(batches),
                       reference=reference, verified=verified)
