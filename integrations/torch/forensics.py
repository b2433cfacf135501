"""Overflow forensics for ``LossScaler(diagnose=...)``: device-side accumulators, read at the log interval.

What each step costs (see :mod:`lossscale_callbacks.forensics` for what is measured):

* **Which parameters** had non-finite gradients: free of extra passes. The scaler's fused
  check-and-unscale kernel (``_amp_foreach_non_finite_check_and_unscale_``) runs once per parameter
  instead of once per dtype group, each call writing its own flag; it is the same single pass over
  the gradients, with one kernel launch per parameter. The step's overflow flag is the max of the
  flags (under FSDP the flags are all-reduced instead of the single flag: one collective either way).
* **Loss non-finite**: one ``isfinite`` on the scaled loss in :meth:`LossScaler.scale`.
* **Inf or NaN**: one more pass, only on steps known to be skipped: a non-fused optimizer's step
  already reads the skip decision on the host, so the kind is checked then, on the rare skipped
  step. A fused optimizer decides on the device; its skipped steps count as ``grad_nonfinite``
  unless ``diagnose="every_step"``, which checks every step.
* **Headroom, underflow, histogram**: a few passes over the gradients every ``headroom_every``
  optimizer steps (a host counter, no read), or every step with ``"every_step"``.

Everything stays on the device until :meth:`GradForensics.read`, one host read at the log interval.
"""

from __future__ import annotations

from typing import Any

import torch

from lossscale_callbacks.forensics import (
    FP16_MIN_SUBNORMAL,
    HISTOGRAM_EXPONENTS,
    IntervalForensics,
    LayerHeadroom,
    layer_of,
)

_LO, _HI = HISTOGRAM_EXPONENTS
_WRAPPER_PREFIXES = ("module", "_forward_module", "_orig_mod")


class GradForensics:
    """Per-parameter overflow flags, skip causes and sampled headroom, accumulated on ``device``.

    Made by :class:`~lossscale_callbacks.torch.LossScaler` (``diagnose=True`` or ``"every_step"``);
    its hooks are called by the scaler.

    Args:
        mode: ``True`` or ``"every_step"``.
        headroom_every: sample the headroom every this many optimizer steps (``True`` mode).
    """

    def __init__(self, mode: bool | str, headroom_every: int) -> None:
        self.mode = mode
        self.headroom_every = headroom_every
        self._names: dict[int, str] = {}
        self._index: dict[int, int] = {}
        self._param_names: list[str] = []
        self._numel: list[int] = []
        self._device: torch.device | None = None
        self._flags: torch.Tensor | None = None  # this step, per parameter
        self._counts: torch.Tensor | None = None  # skipped steps per layer, this interval
        self._layer_ids: torch.Tensor | None = None  # parameter -> layer
        self._slot_ids: dict[tuple[int, ...], torch.Tensor] = {}
        self._causes: torch.Tensor | None = None  # loss_nonfinite, grad_inf, grad_nan, grad_nonfinite
        self._loss_bad: torch.Tensor | None = None
        self._nan_step: torch.Tensor | None = None
        self._kind_known = False
        self._steps = 0
        self._sample: dict[str, Any] | None = None
        self._sample_now = False

    # ------------------------------------------------------------------------------ names

    def watch(self, model: torch.nn.Module) -> None:
        """Name the parameters after ``model``'s modules (``dec.5.attn.weight`` → layer ``dec.5.attn``)."""
        inner = model
        while any(isinstance(getattr(inner, a, None), torch.nn.Module) for a in _WRAPPER_PREFIXES):
            inner = next(getattr(inner, a) for a in _WRAPPER_PREFIXES
                         if isinstance(getattr(inner, a, None), torch.nn.Module))
        for name, param in model.named_parameters():
            # The wrappers' own prefixes (DDP's module., Lightning's _forward_module., compile's
            # _orig_mod.) are not layers of the user's model.
            while name.split(".", 1)[0] in _WRAPPER_PREFIXES and "." in name:
                name = name.split(".", 1)[1]
            if "." not in name:  # the model's own parameter (a ViT's cls_token): the model is its layer
                name = f"{type(inner).__name__}.{name}"
            self._names[id(param)] = name
        for pid, index in self._index.items():
            if pid in self._names:
                self._param_names[index] = self._names[pid]
        self._layer_ids = None  # layers are renamed: rebuilt at the next step
        if self._counts is not None:
            self._counts = None
            self._grow()

    def _slot(self, param: torch.Tensor, grad: torch.Tensor) -> int:
        index = self._index.get(id(param))
        if index is None:
            index = self._index[id(param)] = len(self._param_names)
            self._param_names.append(self._names.get(id(param), f"param{index}"))
            self._numel.append(int(grad.numel()))
            self._grow()
        return index

    @property
    def _layers(self) -> list[str]:
        return list(dict.fromkeys(layer_of(n) for n in self._param_names))

    def _grow(self) -> None:
        if self._device is None:
            return
        sizes = {"_flags": len(self._param_names), "_counts": len(self._layers)}
        for attr, n in sizes.items():
            old = getattr(self, attr)
            if old is None or old.numel() < n:
                new = torch.zeros(n, dtype=torch.float32, device=self._device)
                if old is not None:
                    new[:old.numel()] = old
                setattr(self, attr, new)
        self._layer_ids = None

    def _layer_index(self) -> torch.Tensor:
        if self._layer_ids is None:
            position = {name: i for i, name in enumerate(self._layers)}
            ids = [position[layer_of(n)] for n in self._param_names]
            self._layer_ids = torch.tensor(ids, dtype=torch.int64, device=self._device)
        return self._layer_ids

    def _ensure(self, device: torch.device) -> None:
        if self._device is None:
            self._device = device
            self._causes = torch.zeros(4, dtype=torch.int64, device=device)
            self._loss_bad = torch.zeros((), dtype=torch.bool, device=device)
            self._nan_step = torch.zeros((), dtype=torch.bool, device=device)
        self._grow()

    # ---------------------------------------------------------------------------- step hooks

    def on_scale(self, outputs: list[torch.Tensor]) -> None:
        """The loss (or outputs) given to ``scaler.scale``: remember whether any was non-finite."""
        if not outputs:
            return
        self._ensure(outputs[0].device)
        assert self._loss_bad is not None
        for out in outputs:
            bad = torch.logical_not(torch.isfinite(out.detach()).all()).to(self._device, non_blocking=True)
            self._loss_bad.logical_or_(bad)

    def check(self, params_grads: list[tuple[torch.Tensor, torch.Tensor]], inv_scale: torch.Tensor,
              found_inf: torch.Tensor, scale: torch.Tensor, unscaling: bool) -> None:
        """The scaler's check(+unscale) pass, one kernel call per parameter; ``found_inf`` gets the max."""
        self._ensure(found_inf.device)
        if not self._sample_now:
            self._sample_now = self.mode == "every_step" or self._steps % self.headroom_every == 0
        slots = [self._slot(p, g) for p, g in params_grads]
        flags = self._flags
        assert flags is not None
        home = found_inf.device
        for (_, grad), index in zip(params_grads, slots, strict=True):
            if grad.device == home:
                torch._amp_foreach_non_finite_check_and_unscale_([grad], flags[index], inv_scale)
            else:
                local = torch.zeros((), dtype=torch.float32, device=grad.device)
                torch._amp_foreach_non_finite_check_and_unscale_([grad], local, inv_scale.to(grad.device))
                flags[index].copy_(torch.maximum(flags[index], local.to(home)))
        key = tuple(slots)
        ids = self._slot_ids.get(key)
        if ids is None:  # once per optimizer: a host-to-device copy of its parameter indices
            ids = self._slot_ids[key] = torch.tensor(slots, dtype=torch.int64, device=home)
        if slots:  # this optimizer's own flags only: each optimizer skips on its own gradients
            torch.maximum(found_inf, flags.index_select(0, ids).max(), out=found_inf)
        if self.mode == "every_step" and params_grads:
            self._mark_nan([g for _, g in params_grads])
            self._kind_known = True
        if self._sample_now and params_grads:
            # Scaled values: the gradients were just divided by the scale when unscaling.
            self._take_sample(params_grads, slots, scale if unscaling else torch.ones_like(scale), scale)

    def reduce_flags(self, group: Any) -> None:
        """Sharded gradients: every rank's flags, so all ranks name the same layers (MAX all-reduce)."""
        assert self._flags is not None
        torch.distributed.all_reduce(self._flags, op=torch.distributed.ReduceOp.MAX, group=group)

    def on_host_skip(self, grads: list[torch.Tensor]) -> None:
        """A step the host knows was skipped (a non-fused optimizer): tell Inf from NaN, one pass."""
        if grads and not self._kind_known:
            self._mark_nan(grads)
        self._kind_known = True

    def on_host_applied(self) -> None:
        """A step the host knows was applied: nothing to classify."""
        self._kind_known = True

    def _mark_nan(self, grads: list[torch.Tensor]) -> None:
        assert self._nan_step is not None
        for grad in grads:
            self._nan_step.logical_or_(torch.isnan(grad).any().to(self._device))

    def _take_sample(self, params_grads: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int],
                     factor: torch.Tensor, scale: torch.Tensor) -> None:
        sample = self._sample if self._sample is not None and self._sample.get("open") else None
        if sample is None:
            n = len(self._param_names)
            sample = self._sample = {
                "open": True, "scale": scale.detach().clone(),
                "max": torch.zeros(n, dtype=torch.float32, device=self._device),
                "under": torch.zeros(n, dtype=torch.int64, device=self._device),
                "hist": torch.zeros(_HI - _LO, dtype=torch.int64, device=self._device),
                "seen": set(),
            }
        with torch.no_grad():
            for (_, grad), index in zip(params_grads, slots, strict=True):
                if index >= sample["max"].numel():
                    continue  # a parameter first seen after the sample began: in the next sample
                scaled = grad.detach().float().abs().mul(factor.to(grad.device))
                sample["max"][index] = scaled.max().to(self._device) if scaled.numel() else 0.0
                tiny = torch.logical_and(scaled > 0, scaled < FP16_MIN_SUBNORMAL)
                sample["under"][index] = tiny.sum().to(self._device)
                # No boolean indexing and no bincount: both would read the device (their output size
                # depends on the values). Zeros and non-finite values go to an extra, dropped bin.
                usable = torch.logical_and(scaled > 0, torch.isfinite(scaled)).reshape(-1)
                exponent = torch.frexp(scaled.reshape(-1))[1].to(torch.int64) - 1
                bins = torch.where(usable, exponent.clamp(_LO, _HI - 1) - _LO, _HI - _LO)
                counts = torch.zeros(_HI - _LO + 1, dtype=torch.int64, device=bins.device)
                counts.scatter_add_(0, bins, torch.ones_like(bins))
                sample["hist"] += counts[:-1].to(self._device)
                sample["seen"].add(index)

    def on_update(self, found_inf: torch.Tensor) -> None:
        """End of the step: fold this step's flags into the interval's counts, by cause."""
        self._steps += 1
        if self._device is None:
            return
        assert self._flags is not None and self._counts is not None and self._causes is not None
        assert self._loss_bad is not None and self._nan_step is not None
        skipped = (found_inf.to(self._device) > 0)
        loss_bad = torch.logical_and(skipped, self._loss_bad)
        grad_skip = torch.logical_and(skipped, torch.logical_not(self._loss_bad))
        if self._kind_known:
            nan = torch.logical_and(grad_skip, self._nan_step)
            inf = torch.logical_and(grad_skip, torch.logical_not(self._nan_step))
            unknown = torch.zeros_like(grad_skip)
        else:
            nan = inf = torch.zeros_like(grad_skip)
            unknown = grad_skip
        self._causes += torch.stack([loss_bad, inf, nan, unknown]).to(torch.int64)
        layer_flags = torch.zeros_like(self._counts).scatter_reduce_(
            0, self._layer_index(), self._flags, "amax", include_self=True)
        self._counts += layer_flags * grad_skip.to(torch.float32)
        self._flags.zero_()
        self._loss_bad.zero_()
        self._nan_step.zero_()
        self._kind_known = False
        if self._sample is not None:
            self._sample["open"] = False
        self._sample_now = False

    # ------------------------------------------------------------------------------- reading

    def read(self, step: int, scale: float) -> IntervalForensics:
        """The interval's forensics as host numbers (one host read), and a fresh interval."""
        layers = [layer_of(n) for n in self._param_names]
        order = tuple(self._layers)
        if self._device is None or self._counts is None or self._causes is None:
            return IntervalForensics(step=step, scale=scale, causes={}, layer_order=order)
        parts = [self._causes.to(torch.float64), self._counts[:len(order)].to(torch.float64)]
        sample = self._sample
        if sample is not None:
            parts += [sample["max"].to(torch.float64), sample["under"].to(torch.float64),
                      sample["hist"].to(torch.float64), sample["scale"].reshape(1).to(torch.float64)]
        host = torch.cat(parts).cpu().tolist()  # the one host read
        causes = dict(zip(("loss_nonfinite", "grad_inf", "grad_nan", "grad_nonfinite"),
                          (int(v) for v in host[:4]), strict=True))
        counts = host[4:4 + len(order)]
        layer_skips = {layer: int(count) for layer, count in zip(order, counts, strict=True) if count}
        headroom: tuple[LayerHeadroom, ...] = ()
        histogram = None
        headroom_scale = None
        if sample is not None:
            n = sample["max"].numel()
            rest = host[4 + len(order):]
            maxes, unders, hist = rest[:n], rest[n:2 * n], rest[2 * n:2 * n + (_HI - _LO)]
            headroom_scale = float(rest[-1])
            by_layer: dict[str, list[float]] = {}
            for index in sorted(sample["seen"]):
                entry = by_layer.setdefault(layers[index], [0.0, 0, 0])
                big = maxes[index]
                entry[0] = big if big != big or big > entry[0] else entry[0]  # NaN wins
                entry[1] += int(unders[index])
                entry[2] += self._numel[index]
            headroom = tuple(LayerHeadroom(layer, float(v[0]), int(v[1]), int(v[2]))
                             for layer, v in by_layer.items())
            histogram = tuple(int(c) for c in hist)
            self._sample = None
        self._counts.zero_()
        self._causes.zero_()
        return IntervalForensics(step=step, scale=scale, causes=causes, layer_skips=layer_skips,
                                 layer_order=order, headroom=headroom, histogram=histogram,
                                 headroom_scale=headroom_scale)
