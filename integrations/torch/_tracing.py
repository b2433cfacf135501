"""Forward tracing for ``LossScaler(diagnose=...)``: per-layer activation maxima on the device, read rarely.

What is traced, and when. On a traced step one global forward hook
(``torch.nn.modules.module.register_module_forward_hook``, registered for that step only, so an
untraced step runs torch's hook-free fast path) sees every module of the watched model; per module
call it takes one multi-tensor max-norm (``torch._foreach_norm(tensors, inf)``) over the floating
tensors of the call's inputs and output. When the loss reaches ``scaler.scale`` (the forward is done)
about 20 ops fold those calls into: each layer's largest ``|output|`` this step (one row of a ring of
the last :data:`RING` traced steps), and the **producer**: the first call, in the order the forward
pass finished them, whose inputs were finite and whose output was not (layers after it that were
non-finite too only passed it on). All of it stays on the device; :meth:`ActivationTracer.read` makes
one host read at the log interval.

Traced steps: the steps the gradient forensics sample their headroom (every ``headroom_every``, or
every step with ``"every_step"``), and the ``FOLLOW`` (3) steps after a skipped step the scaler saw
on the host (a non-fused optimizer reads the skip decision anyway): a forward overflow at an untraced
step keeps overflowing while the weights it came from stay unchanged, so the next step names it. With
a fused optimizer (the skip is decided on the device) a non-finite loss read at the log interval arms
the same following steps.

Layer names: the module's qualified name inside framework wrappers (``unwrap``), the model itself
by its class name: the gradient forensics' names for the modules that own parameters. Headroom
series are written for those; every module is traced (a producer can be a parameter-free container
whose own code overflowed, e.g. attention scores computed inline).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from lossscale_callbacks.integration import ActivationTrace, layer_of
from lossscale_callbacks.torch._forensics import _fill_index, unwrap

RING = 4  # traced steps kept per interval
MAX_CALLS = 65536  # module calls kept before a fold; more means no scaler step follows these forwards


__all__ = ["RING", "ActivationTracer", "autocast_dtype_name"]


def autocast_dtype_name(device_type: str, fallback: torch.dtype | None = None) -> str:
    """The compute dtype the activations are judged against: autocast's when on, else ``fallback``'s."""
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else fallback
    return "bfloat16" if dtype == torch.bfloat16 else "float16"


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


class ActivationTracer:
    """Per-layer activation maxima and the first non-finite producer, on the device.

    Made and driven by :class:`~lossscale_callbacks.torch._forensics.GradForensics`: :meth:`watch` with
    the model, :meth:`arm` before a traced step's forward, :meth:`fold` when the loss is scaled,
    :meth:`end_step` at the scaler's update, :meth:`read` at the log interval.
    """

    def __init__(self) -> None:
        self._model: weakref.ref[torch.nn.Module] | None = None
        # module -> layer index; weak, so a module of a dead model is never taken for a new one at its address
        self._index: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self.layers: list[str] = []
        self.series_layers: tuple[str, ...] = ()
        self._handle: Any = None
        self._calls: list[tuple[int, int, list[torch.Tensor]]] = []  # (layer, inputs counted, norms)
        self._device: torch.device | None = None
        self._dtype = "float16"
        self._order: list[int] = []  # layer indices in the order the first traced forward finished them
        self._step_rows: list[int] = []  # the steps of the ring's rows (host), oldest first
        self._traced = 0
        self._step_open = False
        self._plans: dict[tuple[tuple[int, int], ...], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------ set-up

    def watch(self, model: torch.nn.Module) -> None:
        """Trace ``model``'s modules from now on (named as the gradient forensics name their layers)."""
        inner, _ = unwrap(model)  # the names are taken inside the wrappers: no prefix to strip
        self._model = weakref.ref(model)
        self._index, self.layers = weakref.WeakKeyDictionary(), []
        for name, module in inner.named_modules():
            if module not in self._index:  # a shared module keeps its first name
                self._index[module] = len(self.layers)
                self.layers.append(name or type(inner).__name__)
        owners = {layer_of(n) if "." in n else type(inner).__name__ for n, _ in inner.named_parameters()}
        self.series_layers = tuple(layer for layer in self.layers if layer in owners)
        self._plans.clear()
        self._device = None
        self._order = []
        self._reset_interval()

    def _ensure(self, device: torch.device) -> None:
        if self._device is not None:
            return
        self._device, n = device, len(self.layers)
        self._step_max = torch.zeros(n, device=device)
        self._ring = torch.zeros(RING, n, device=device)
        self._frozen = torch.zeros(RING, n, device=device)  # the ring when the first producer was seen
        self._first = torch.full((2,), -1.0, device=device)  # the first producer: layer, step index
        self._passed = torch.zeros(n, device=device)  # non-finite layers at that forward
        self._producers = torch.zeros(n, device=device)  # per layer: traced forwards it produced
        self._positions = torch.arange(n, 0, -1, dtype=torch.float32, device=device)

    def _reset_interval(self) -> None:
        self._step_rows, self._traced = [], 0
        if self._device is not None:
            torch._foreach_zero_([self._ring, self._frozen, self._passed, self._producers])
            self._first.fill_(-1.0)

    # ---------------------------------------------------------------------------- the step

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        """Trace the coming forward passes (until :meth:`end_step`).

        The global hook holds the tracer weakly: a scaler dropped (or whose forensics were replaced)
        while armed takes its hook with it at the next module call.
        """
        if self._handle is not None or self._model is None or self._model() is None:
            return
        tracer, handles = weakref.ref(self), []

        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            alive = tracer()
            if alive is None:
                handles[0].remove()
            else:
                alive._hook(module, args, kwargs, output)

        self._handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
        handles.append(self._handle)

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        layer = self._index.get(module)
        if layer is None or not torch.is_grad_enabled():  # another model, or an evaluation pass
            if self._model is None or self._model() is None:  # the model is gone: so is the hook
                self.end_step(0)
            return
        if len(self._calls) >= MAX_CALLS:  # forward passes with no scaler step after them: stop tracing
            self._calls.clear()
            self.end_step(0)
            return
        inputs, outputs = _floats((args, kwargs)), _floats(output)
        if not outputs:
            return
        if not self._calls:
            self._dtype = autocast_dtype_name(outputs[0].device.type, outputs[0].dtype)
        with torch.no_grad():
            norms = torch._foreach_norm([*inputs, *outputs], math.inf, dtype=torch.float32)
        self._calls.append((layer, len(inputs), list(norms)))

    def fold(self) -> None:
        """The forward passes since the last fold into this step's maxima and the interval's producer."""
        calls, self._calls = self._calls, []
        if not calls:
            return
        self._ensure(calls[0][2][0].device)
        if not self._order:
            seen: dict[int, None] = {}
            self._order = list(seen.fromkeys(layer for layer, _, _ in calls))
        target, layers = self._plan(calls)
        with torch.no_grad():
            flat = torch.stack([norm for _, _, norms in calls for norm in norms])
            per_call = torch.zeros(2 * len(calls), device=flat.device)
            per_call = per_call.scatter_reduce_(0, target, flat, "amax").view(len(calls), 2)
            bad_out = torch.isfinite(per_call[:, 1]).logical_not_().float()
            made = torch.isfinite(per_call[:, 0]).float().mul_(bad_out)  # finite in, non-finite out
            positions = self._positions[:len(calls)] if len(calls) <= self._positions.numel() else \
                torch.arange(len(calls), 0, -1, dtype=torch.float32, device=flat.device)
            places = made * positions
            first = places.eq(places.amax()).float().mul_(made)  # one-hot on the first producer, or zeros
            self._step_max.scatter_reduce_(0, layers, per_call[:, 1], "amax")
            self._producers.index_add_(0, layers, first)
            self._note_first(first, layers, bad_out)
        self._step_open = True

    def _plan(self, calls: list[tuple[int, int, list[torch.Tensor]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Index tensors for this forward's structure, made once on the device (no host-to-device copy)."""
        key = tuple((layer, n_in * 1000 + len(norms)) for layer, n_in, norms in calls)
        plan = self._plans.get(key)
        if plan is None:
            target = [2 * i + (j >= n_in) for i, (_, n_in, norms) in enumerate(calls)
                      for j in range(len(norms))]
            assert self._device is not None
            layers = [layer for layer, _, _ in calls]
            plan = (_fill_index(target, self._device), _fill_index(layers, self._device))
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _note_first(self, first: torch.Tensor, layers: torch.Tensor, bad_out: torch.Tensor) -> None:
        """The interval's first producer (layer, traced-step index), the layers it reached, the ring up to it.

        ``torch.where`` on a 0-d condition, not arithmetic: the rows hold Inf and NaN maxima.
        """
        now = self._first[0].lt(0).logical_and_(first.amax().gt(0))  # a first producer is found now
        layer = (first * layers.float()).sum()
        index = torch.full_like(layer, float(len(self._step_rows)))
        self._first.copy_(torch.where(now, torch.stack([layer, index]), self._first))
        reached = torch.zeros_like(self._passed).scatter_reduce_(0, layers, bad_out, "amax")
        self._passed.copy_(torch.where(now, reached, self._passed))
        self._ring[len(self._step_rows) % RING].copy_(self._step_max)  # this step so far, for the freeze
        self._frozen.copy_(torch.where(now, self._ring, self._frozen))

    def end_step(self, step: int) -> None:
        """The optimizer step ``step`` ended: its maxima become the ring's newest row; hooks off."""
        self.fold()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if not self._step_open:
            return
        self._ring[len(self._step_rows) % RING].copy_(self._step_max)
        self._step_rows.append(step)
        self._traced += 1
        self._step_max.zero_()
        self._step_open = False

    # ------------------------------------------------------------------------------- reading

    def read(self) -> ActivationTrace | None:
        """The interval's trace as host numbers (one host read), a fresh interval; ``None``: none traced."""
        if self._device is None or not self._traced:
            return None
        n = len(self.layers)
        host = torch.cat([self._ring.flatten(), self._frozen.flatten(), self._first, self._passed,
                          self._producers]).to(torch.float64).cpu().numpy()
        ring, frozen = host[:RING * n].reshape(RING, n), host[RING * n:2 * RING * n].reshape(RING, n)
        first_layer, first_index = (int(v) for v in host[2 * RING * n:2 * RING * n + 2])
        passed, producers = host[2 * RING * n + 2:2 * RING * n + 2 + n], host[-n:]
        order = self._order + [i for i in range(n) if i not in set(self._order)]
        rows, steps = self._rows(first_index if first_layer >= 0 else None)
        maxima = (frozen if first_layer >= 0 else ring)[rows][:, order]
        producer = self.layers[first_layer] if first_layer >= 0 else None
        after = order[order.index(first_layer) + 1:] if first_layer >= 0 else []
        trace = ActivationTrace(
            layers=tuple(self.layers[i] for i in order), steps=steps, maxima=np.asarray(maxima),
            producer=producer, producer_step=steps[-1] if producer else None,
            passed_on=tuple(self.layers[i] for i in after if passed[i]),
            producer_counts={self.layers[i]: int(c) for i, c in enumerate(producers) if c},
            traced=self._traced, dtype=self._dtype, series_layers=self.series_layers)
        self._reset_interval()
        return trace

    def _rows(self, first_index: int | None) -> tuple[list[int], tuple[int, ...]]:
        """The ring rows to show, oldest first, and their steps: up to the first producer's step if any."""
        count = len(self._step_rows)
        end = count if first_index is None else min(first_index + 1, count)
        kept = list(range(max(0, end - RING), end))
        return [i % RING for i in kept], tuple(self._step_rows[i] for i in kept)
