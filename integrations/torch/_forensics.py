"""Overflow forensics for ``LossScaler(diagnose=...)``: device-side accumulators, read at the log interval.

What each step costs (see :mod:`lossscale_callbacks.forensics._gradients` for what is measured). Every figure
is a bounded number of dispatched ops, whatever the number of parameter tensors:

* **Which layers** had non-finite gradients, and whether a skipped step's were **Inf or NaN**: one
  multi-tensor max-norm (``torch._foreach_norm(grads, inf)``) over each optimizer's gradients, then
  one ``stack`` and one ``scatter_reduce`` into per-layer maxima (NaN propagates through both, so
  the maxima tell NaN from Inf for fused optimizers too). Taken only where it can matter: on the
  skipped steps of a non-fused optimizer (whose step reads the skip decision on the host anyway),
  on every step of a fused one (which decides on the device), where it is one more read of the
  gradients (the fused check-and-unscale kernel keeps one flag for all of them), and on every step
  whose gradients the user unscales with ``unscale_`` (clipping may rewrite them before ``step``:
  a clipped Inf is a NaN, every other gradient a zero). On CUDA the norm is
  a multi-tensor kernel (a few launches for any number of tensors); on the CPU torch runs it as one
  op that loops over the tensors inside, so there its time still grows with the number of tensors
  (a few µs per tensor), and it is the 2-norm, not the max-norm, which torch's CPU reduces 30x
  slower (see :meth:`GradForensics._analyse`).
* **Loss non-finite**: three ops on the scaled loss in :meth:`LossScaler.scale` (``0 * loss``, summed
  into a probe that turns NaN once a loss value is Inf or NaN).
* **End of the step**: where the maxima were taken, about 13 ops fold them into the interval's counts
  by cause and 6 more count the step's **origin** (a step the host knew was applied: one reset); with the
  layers in forward order
  (the model's module registration order, from :meth:`GradForensics.watch`), the last flagged layer,
  one-hot.
* **Headroom, underflow, histogram** every ``headroom_every`` optimizer steps (a host counter), or
  every step with ``"every_step"``: the gradients are concatenated per device and dtype in chunks of
  at most :data:`SAMPLE_CHUNK` values (``torch._chunk_cat``) and about 20 ops per chunk compute the
  underflow counts per layer (exact up to 2**24 underflowing values per tensor) and the histogram.
  The number of chunks grows with the model's size (one per 64 MB of float32 gradients), not with
  its number of tensors; the largest temporary is one chunk.

Which parameter belongs to which layer is planned once per optimizer parameter list (at most
:data:`MAX_PLANS` plans are kept, least recently used first out): a parameter without a gradient in a
step (LayerDrop, an expert that got no tokens) takes a zero placeholder, so the plan does not change
from step to step. Plans are built with fills on the device, never with a host-to-device copy.

Everything stays on the device until :meth:`GradForensics.read`, one host read at the log interval.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from collections import OrderedDict
from typing import Any

import torch

from lossscale_callbacks.integration import (
    FP16_MIN_SUBNORMAL,
    HISTOGRAM_EXPONENTS,
    IntervalForensics,
    LayerHeadroom,
    layer_of,
)

_LO, _HI = HISTOGRAM_EXPONENTS
FOLLOW = 3  # steps whose forward pass is traced after a skipped step
SAMPLE_CHUNK = 2**24
MAX_PLANS = 16
# Wrappers whose parameters are their wrapped module's, by class, with the attribute that holds it.
# Recognised by type only: a user's own submodule called ``module`` is a layer like any other.
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("lightning.pytorch.overrides.base", "_LightningModuleWrapperBase", "_forward_module"),
    ("lightning.fabric.wrappers", "_FabricModule", "_forward_module"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "module"),
)


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The user's model inside framework wrappers, and the wrappers' name prefix (``"module."``...).

    Only classes that are wrappers are unwrapped, and only modules already imported are looked at,
    so nothing is imported to find out.

    Example:
        >>> inner = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(inner)) == (inner, "module.")
        True
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.module = torch.nn.Linear(2, 2)  # a layer that happens to be called "module"
        >>> net = Net()
        >>> unwrap(net) == (net, "")
        True
    """
    prefix = ""
    while True:
        for module_name, class_name, attribute in _WRAPPERS:
            cls = getattr(sys.modules.get(module_name), class_name, None)
            inner = getattr(model, attribute, None) if cls is not None and isinstance(model, cls) else None
            if isinstance(inner, torch.nn.Module):
                model, prefix = inner, f"{prefix}{attribute}."
                break
        else:
            return model, prefix


def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` after ``model``'s modules, wrappers looked through (see ``watch``)."""
    inner, prefix = unwrap(model)
    names = {}
    for name, param in model.named_parameters():
        name = name[len(prefix):] if name.startswith(prefix) else name
        if "." not in name:  # the model's own parameter (a ViT's cls_token): the model is its layer
            name = f"{type(inner).__name__}.{name}"
        names[id(param)] = name
    return names


def _fill_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` made on ``device`` by fills of equal runs: no host-to-device copy."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    start = 0
    while start < len(values):
        end = start
        while end < len(values) and values[end] == values[start]:
            end += 1
        out[start:end].fill_(values[start])
        start = end
    return out


@dataclasses.dataclass
class _Chunk:
    """Positions (in one optimizer's parameter list) sampled together: one device, one dtype."""

    dense: list[int]  # positions of parameters with at least one dimension, concatenated as they are
    scalars: list[int]  # 0-d parameters, stacked into one 1-d tensor after the others
    layers: torch.Tensor  # layer of each sampled tensor, in that order


@dataclasses.dataclass
class _Plan:
    """One optimizer parameter list mapped onto layers."""

    by_device: list[tuple[torch.device, list[int]]]  # positions per device, for the norms
    layers: torch.Tensor  # layer of each position, in by_device order (on the home device)
    chunks: list[_Chunk]
    layer_names: list[str]  # layer of each position, in parameter-list order


class GradForensics:
    """Per-layer overflow flags, skip causes and sampled headroom, accumulated on the device.

    Made by :class:`~lossscale_callbacks.torch.LossScaler` (``diagnose=True`` or ``"every_step"``);
    its hooks are called by the scaler.

    The forward pass of the watched model is traced too (:mod:`lossscale_callbacks.torch._tracing`)
    at the sampled steps and after skipped ones; ``trace_forward = False`` switches that off.

    Args:
        mode: ``True`` or ``"every_step"``.
        headroom_every: sample the headroom every this many optimizer steps (``True`` mode).
    """

    def __init__(self, mode: bool | str, headroom_every: int) -> None:
        from lossscale_callbacks.torch._tracing import ActivationTracer  # it imports this module's helpers

        self.mode = mode
        self.headroom_every = headroom_every
        self.tracer = ActivationTracer()
        self.trace_forward = True
        self._follow = 0  # steps still to trace after a skipped one
        self._names: dict[int, str] = {}  # id(parameter) -> name, from watch()
        self._watched: weakref.ref[torch.nn.Module] | None = None  # looked at again for a new parameter
        self._anonymous: dict[int, str] = {}  # names given to parameters nobody named
        self._device: torch.device | None = None
        self._steps = 0
        self._sample_now = False
        self._sample: dict[str, Any] | None = None
        self._reset_layers()

    def _reset_layers(self) -> None:
        self._layers: list[str] = []
        self._layer_ids: dict[str, int] = {}
        self._plans: OrderedDict[tuple[int, ...], _Plan] = OrderedDict()
        self._pending: dict[int, tuple[_Plan, list[tuple[torch.Tensor, torch.Tensor | None]]]] = {}
        self._zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._step_max: torch.Tensor | None = None  # this step, per layer: max |scaled gradient|
        self._counts: torch.Tensor | None = None  # this interval, per layer: skipped steps flagged
        self._origins: torch.Tensor | None = None  # this interval, per layer: skipped steps it started
        self._positions: torch.Tensor | None = None  # 1, 2, ... per layer: its place in forward order
        self._analysed = False  # this step's maxima were taken (else no layer can be flagged)
        self._sample = None

    # ------------------------------------------------------------------------------ names

    def watch(self, model: torch.nn.Module) -> None:
        """Name the parameters after ``model``'s modules (``dec.5.attn.weight`` → layer ``dec.5.attn``).

        The layers are numbered in the model's registration order (the order ``named_parameters``
        gives, which is the forward order of a model that defines its layers as it calls them): the
        origin of a skipped step is its last flagged layer in that order. Framework wrappers (DDP,
        ``torch.compile``, Lightning's and Fabric's, DeepSpeed's) are looked through by type
        (:func:`unwrap`); the interval's layer counts start again. A layer added to the model later
        is named when its parameters first reach the scaler (numbered after the others).
        """
        self._watched = weakref.ref(model)
        self._names = _parameter_names(model)
        self._reset_layers()
        for name in self._names.values():
            self._layer_id(layer_of(name))
        self.tracer.watch(model)
        self._arm_tracer()

    def _arm_tracer(self) -> None:
        """Trace the next step's forward pass when it is sampled, or follows a skipped step."""
        if not self.trace_forward:
            return
        if self.mode == "every_step" or self._steps % self.headroom_every == 0 or self._follow > 0:
            self._follow = max(0, self._follow - 1)
            self.tracer.arm()

    def _layer_name(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        model = self._watched() if self._watched is not None else None
        if name is None and model is not None:  # a layer added after watch(): look at the model again
            self._names = _parameter_names(model)
            name = self._names.get(id(param))
        if name is None:  # not watched: named by order of appearance
            return self._anonymous.setdefault(id(param), f"param{len(self._anonymous)}")
        return layer_of(name)

    def _layer_id(self, layer: str) -> int:
        index = self._layer_ids.get(layer)
        if index is None:
            index = self._layer_ids[layer] = len(self._layers)
            self._layers.append(layer)
        return index

    # ------------------------------------------------------------------------------ plans

    def _plan(self, params: list[torch.Tensor]) -> _Plan:
        key = tuple(map(id, params))
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        assert self._device is not None
        names = [self._layer_name(p) for p in params]
        ids = [self._layer_id(n) for n in names]
        self._grow()
        by_device: dict[torch.device, list[int]] = {}
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for position, param in enumerate(params):
            by_device.setdefault(param.device, []).append(position)
            groups.setdefault((param.device, param.dtype), []).append(position)
        order = [i for positions in by_device.values() for i in positions]
        chunks = [self._chunk(part, params, ids) for positions in groups.values()
                  for part in self._split_by_size(positions, params)]
        layers = _fill_index([ids[i] for i in order], self._device)
        plan = _Plan(list(by_device.items()), layers, chunks, names)
        self._plans[key] = plan
        if len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return plan

    @staticmethod
    def _split_by_size(positions: list[int], params: list[torch.Tensor]) -> list[list[int]]:
        parts: list[list[int]] = [[]]
        size = 0
        for position in positions:
            numel = params[position].numel()
            if parts[-1] and size + numel > SAMPLE_CHUNK:
                parts.append([])
                size = 0
            parts[-1].append(position)
            size += numel
        return parts

    def _chunk(self, positions: list[int], params: list[torch.Tensor], ids: list[int]) -> _Chunk:
        dense = [i for i in positions if params[i].dim() > 0]
        scalars = [i for i in positions if params[i].dim() == 0]
        layers = [ids[i] for i in dense] + ([ids[i] for i in scalars] if scalars else [])
        assert self._device is not None
        return _Chunk(dense, scalars, _fill_index(layers, self._device))

    def _grow(self) -> None:
        """Room for every layer known so far in the per-layer accumulators (made on the device)."""
        assert self._device is not None
        n = len(self._layers)
        if self._step_max is not None and self._step_max.numel() >= n:
            return
        capacity = max(n, 2 * (self._step_max.numel() if self._step_max is not None else 4))
        for attr in ("_step_max", "_counts", "_origins"):
            old = getattr(self, attr)
            new = torch.zeros(capacity, dtype=torch.float32, device=self._device)
            if old is not None:
                new[:old.numel()].copy_(old)
            setattr(self, attr, new)
        self._positions = torch.arange(1, capacity + 1, dtype=torch.float32, device=self._device)
        if self._sample is not None:
            self._sample = None  # a sample begun before these layers existed is dropped

    def _ensure(self, device: torch.device) -> None:
        if self._device is None:
            self._device = device
            # Skipped steps; of which with a finite loss; of which with NaN gradients. Separate float32
            # 0-d tensors like the overflow flag: on the CPU an op mixing dtypes or views costs 3-10x.
            self._tally = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(3)]
            # Sum of 0 * every loss value this step: 0 while they are finite, NaN once one is not.
            self._loss_probe = torch.zeros((), dtype=torch.float32, device=device)
            self._one = torch.ones(1, dtype=torch.int64, device=device)
            self._grow()

    def _zero(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A one-value zero gradient standing in for a parameter that has none this step."""
        zero = self._zeros.get((device, dtype))
        if zero is None:
            zero = self._zeros[(device, dtype)] = torch.zeros(1, dtype=dtype, device=device)
        return zero

    # ---------------------------------------------------------------------------- step hooks

    def on_scale(self, outputs: list[torch.Tensor]) -> None:
        """The loss (or outputs) given to ``scaler.scale``: remember whether any was non-finite."""
        self.tracer.fold()  # the forward pass is over
        if not outputs:
            return
        self._ensure(outputs[0].device)
        with torch.no_grad():
            for out in outputs:
                # 0 * x is 0 for a number and NaN for Inf or NaN; a sum of zeros cannot overflow.
                self._loss_probe.add_(out.mul(0.0).sum().to(self._device, torch.float32, non_blocking=True))

    def check(self, key: int, entries: list[tuple[torch.Tensor, torch.Tensor | None]], scale: torch.Tensor, *,
              defer: bool = True) -> None:
        """One optimizer's parameters and (still scaled) gradients, ``None`` where a parameter has none.

        Called by the scaler before its check-and-unscale kernel. On a sampled step (or with
        ``defer=False``: sharded gradients, whose maxima are all-reduced next) the per-layer maxima
        are taken now; otherwise the gradients wait for :meth:`resolve`, so that a step the host
        already knows was applied costs nothing.
        """
        self._ensure(scale.device)
        if not self._sample_now:
            self._sample_now = self.mode == "every_step" or self._steps % self.headroom_every == 0
        plan = self._plan([p for p, _ in entries])
        if self._sample_now or not defer:
            self._analyse(plan, entries, maxima=self._sample_now)
            if self._sample_now:
                self._take_sample(plan, entries, scale)
        else:
            self._pending[key] = (plan, entries)

    def resolve(self, key: int, skipped: bool | None) -> None:
        """What the scaler knows about the step of optimizer ``key``: ``True`` (skipped, read on the host by
        a non-fused step) or ``None`` (decided on the device) take the per-layer maxima now; ``False``
        (applied) drops them: there is nothing to explain."""
        if skipped:
            self._follow = FOLLOW  # a forward overflow would recur: trace the next steps to name it
        pending = self._pending.pop(key, None)
        if pending is not None and skipped is not False:
            self._analyse(*pending)

    def _analyse(self, plan: _Plan, entries: list[tuple[torch.Tensor, torch.Tensor | None]],
                 maxima: bool = False) -> None:
        """One optimizer's per-layer norms into this step's: NaN and Inf propagate through both.

        The max-norm (what the headroom sample needs, ``maxima=True``) or, on the CPU, where torch's
        max reductions run 30x slower than its sums, the 2-norm: it is Inf or NaN exactly where the
        max-norm is, short of finite values above 1.8e19 (whose squares overflow float32), which no
        scaled gradient that float16 could hold comes near.
        """
        vectors = []
        self._analysed = True
        with torch.no_grad():
            for device, positions in plan.by_device:
                grads = [entries[i][1] if entries[i][1] is not None else self._zero(device, torch.float32)
                         for i in positions]
                ord_ = math.inf if maxima or device.type != "cpu" else 2.0
                norms = torch.stack(torch._foreach_norm(grads, ord_, dtype=torch.float32))
                vectors.append(norms.to(self._device, non_blocking=True))
            maxima = vectors[0] if len(vectors) == 1 else torch.cat(vectors)
            assert self._step_max is not None
            self._step_max.scatter_reduce_(0, plan.layers, maxima, "amax")

    def reduce_flags(self, group: Any) -> None:
        """Sharded gradients: every rank's maxima, so all ranks name the same layers (MAX all-reduce)."""
        assert self._step_max is not None
        torch.distributed.all_reduce(self._step_max, op=torch.distributed.ReduceOp.MAX, group=group)

    def _take_sample(self, plan: _Plan, entries: list[tuple[torch.Tensor, torch.Tensor | None]],
                     scale: torch.Tensor) -> None:
        assert self._device is not None and self._step_max is not None
        n = self._step_max.numel()
        sample = self._sample
        if sample is None or not sample["open"]:
            sample = self._sample = {
                "open": True, "scale": scale.detach().clone(),
                "under": torch.zeros(n, dtype=torch.int64, device=self._device),
                "hist": torch.zeros(_HI - _LO + 1, dtype=torch.int64, device=self._device),
                "totals": {},
            }
        for layer, (_, grad) in zip(plan.layer_names, entries, strict=True):
            if grad is not None:
                sample["totals"][layer] = sample["totals"].get(layer, 0) + grad.numel()
        for chunk in plan.chunks:
            self._sample_chunk(chunk, entries, sample)

    def _sample_chunk(self, chunk: _Chunk, entries: list[tuple[torch.Tensor, torch.Tensor | None]],
                      sample: dict[str, Any]) -> None:
        """Underflow per layer and the histogram of one chunk: about 20 ops for any number of tensors."""
        first = entries[(chunk.dense or chunk.scalars)[0]][0]
        tensors = [entries[i][1] if entries[i][1] is not None else self._zero(first.device, first.dtype)
                   for i in chunk.dense]
        if chunk.scalars:
            tensors.append(torch.stack([entries[i][1] if entries[i][1] is not None
                                        else self._zero(first.device, first.dtype).view(())
                                        for i in chunk.scalars]))
        sizes = [t.numel() for t in tensors]
        flat = torch._chunk_cat(tensors, 0, 1).view(-1)
        scaled = flat.abs() if flat.dtype == torch.float32 else flat.float().abs_()
        positive = scaled > 0
        tiny = torch.logical_and(positive, scaled < FP16_MIN_SUBNORMAL).float()
        per_tensor = torch.stack(torch._foreach_norm(torch.split(tiny, sizes), 1))
        sample["under"].index_add_(0, chunk.layers.to(per_tensor.device), per_tensor.to(torch.int64))
        # No boolean indexing and no bincount: both would read the device (their output size depends on
        # the values). Zeros and non-finite values go to an extra bin, dropped when read.
        exponent = torch.frexp(scaled)[1].sub_(1).clamp_(_LO, _HI - 1).sub_(_LO)
        usable = torch.logical_and(positive, torch.isfinite(scaled))
        bins = torch.where(usable, exponent, _HI - _LO).to(self._device, non_blocking=True)
        sample["hist"].index_add_(0, bins, self._one.expand(bins.numel()))

    def on_update(self, found_inf: torch.Tensor) -> None:
        """End of the step: fold the step's per-layer maxima into the interval's counts, by cause.

        About 13 ops on 0-d and per-layer float32 tensors (exact counts up to 2**24 per interval): the
        step's skip (``found_inf``, 0 or 1) is split by products instead of boolean logic. A step whose
        maxima were not taken (the host knew it was applied) has nothing to count: one op, the probe's reset.
        """
        self._steps += 1
        self.tracer.end_step(self._steps)
        self._arm_tracer()
        for pending in self._pending.values():  # checked but never stepped, or stepped by other means
            self._analyse(*pending)
        self._pending.clear()
        if self._device is None or self._step_max is None or self._counts is None:
            return
        if not self._analysed:  # applied, known on the host: every count below would add 0
            self._loss_probe.zero_()
            self._sample_now = False
            return
        skipped = found_inf.to(self._device)
        loss_ok = torch.nan_to_num(self._loss_probe + 1.0, nan=0.0)  # 1 while the loss was finite, else 0
        grad_skip = skipped * loss_ok  # skipped, with a finite loss
        nan = torch.isnan(self._step_max.sum()).float()  # NaN anywhere (the maxima are >= 0, Inf or NaN)
        skips, grad_skips, nan_skips = self._tally
        skips.add_(skipped)
        grad_skips.add_(grad_skip)
        nan_skips.addcmul_(grad_skip, nan)
        # Per layer: + grad_skip where the maximum is Inf or NaN (0 * either is NaN, 0 * a number 0).
        not_finite = torch.nan_to_num(self._step_max * 0.0, nan=1.0)
        self._counts.addcmul_(not_finite, grad_skip)
        self._count_origin(not_finite, grad_skip)
        self._analysed = False
        if self._sample is not None and self._sample["open"]:
            self._sample["max"] = self._step_max.clone()
            self._sample["open"] = False
        self._step_max.zero_()
        self._loss_probe.zero_()
        self._sample_now = False

    def _count_origin(self, not_finite: torch.Tensor, grad_skip: torch.Tensor) -> None:
        """+ ``grad_skip`` for the last flagged layer in forward order (none when no layer is flagged)."""
        assert self._origins is not None and self._positions is not None
        places = not_finite * self._positions  # flagged layers keep their place, the others 0
        last = places.eq(places.amax()).float().mul_(not_finite)  # one-hot; all 0 when nothing is flagged
        self._origins.addcmul_(last, grad_skip)

    # ------------------------------------------------------------------------------- reading

    def read(self, step: int, scale: float) -> IntervalForensics:
        """The interval's forensics as host numbers (one host read), and a fresh interval."""
        order = tuple(self._layers)
        trace = self.tracer.read()
        if self._device is None or self._counts is None:
            return IntervalForensics(step=step, scale=scale, causes={}, layer_order=order, activations=trace)
        n = len(order)
        sample = self._sample if self._sample is not None and "max" in self._sample else None
        assert self._origins is not None
        parts = [torch.stack(self._tally).to(torch.float64), self._counts[:n].to(torch.float64),
                 self._origins[:n].to(torch.float64)]
        if sample is not None:
            parts += [sample["max"][:n].to(torch.float64), sample["under"][:n].to(torch.float64),
                      sample["hist"][:-1].to(torch.float64), sample["scale"].reshape(1).to(torch.float64)]
        host = torch.cat(parts).cpu().tolist()  # the one host read
        skips, grad_skips, nan_skips = (int(v) for v in host[:3])
        causes = {"loss_nonfinite": skips - grad_skips, "grad_inf": grad_skips - nan_skips,
                  "grad_nan": nan_skips, "grad_nonfinite": 0}
        layer_skips = {layer: int(count) for layer, count in zip(order, host[3:3 + n], strict=True) if count}
        layer_origins = {layer: int(count) for layer, count in zip(order, host[3 + n:3 + 2 * n], strict=True)
                         if count}
        headroom: tuple[LayerHeadroom, ...] = ()
        histogram = headroom_scale = None
        if sample is not None:
            rest = host[3 + 2 * n:]
            maxes, unders, hist = rest[:n], rest[n:2 * n], rest[2 * n:2 * n + (_HI - _LO)]
            headroom = tuple(LayerHeadroom(layer, float(maxes[i]), int(unders[i]), sample["totals"][layer])
                             for i, layer in enumerate(order) if layer in sample["totals"])
            histogram, headroom_scale = tuple(int(c) for c in hist), float(rest[-1])
            self._sample = None
        self._counts.zero_()
        self._origins.zero_()
        torch._foreach_zero_(self._tally)
        if causes["loss_nonfinite"] and (trace is None or trace.producer is None) and self.trace_forward:
            self._follow = FOLLOW  # a fused optimizer's skips are not seen on the host: trace from here
            self._arm_tracer()
        return IntervalForensics(step=step, scale=scale, causes=causes, layer_skips=layer_skips,
                                 layer_origins=layer_origins, layer_order=order, headroom=headroom,
                                 histogram=histogram, headroom_scale=headroom_scale, activations=trace)
