"""torchao's float8 training watched: per ``Float8Linear`` the input, weight and output-gradient casts,
counted on the device on the counted steps, read at the log interval; eager and under ``torch.compile``.

torchao (``convert_to_float8_training``, recipes ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``)
scales dynamically: every cast takes its scale from the tensor it casts, ``fmt.max / amax`` (per tensor,
or per row with rowwise; rounded down to a power of two where the recipe says so), and keeps no state. So
what there is to watch is what each cast does to its values: the amax, the scale, how many values were
clipped (none should be: the scale is the tensor's own) and how many became subnormal or zero.

:meth:`TorchaoCasts.watch` puts a forward hook on each ``Float8Linear``. On a counted step (the host's
choice: :attr:`TorchaoCasts.counting`, set by the monitor before the step) the hook computes the scales
of the layer's input and weight as torchao's cast does (its own ``amax_to_scale``, the config's dtype,
granularity and rounding) and counts the cast's saturated and underflowed values into a float64 tally on
the device; it wraps the layer's output in an identity whose backward does the same for the output's
gradient, as the layer's ``grad_output`` cast sees it (the bias adds nothing to it). On the other steps the
hook returns at once: no op is added (under ``torch.compile`` the flag is a guard, so the two kinds of
step are two graphs, each compiled once). Per counted step and role: about 20 ops on the tensor and 15
that fold 12 values into the tally (counted in ``tests/test_fp8_torchao.py``); no host read in the step,
:meth:`TorchaoCasts.read` is one, at the interval (and zeroes the tally on the device).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from lossscale_callbacks.integration import E4M3, E5M2, Fp8Format, TensorRead
from lossscale_callbacks.torch._forensics import unwrap

__all__ = ["TorchaoCasts", "float8_linears"]

# (role, the config's cast, the axiswise dim torchao casts that tensor along in its first GEMM)
_CASTS = (("input", "cast_config_input", -1), ("weight", "cast_config_weight", 0),
          ("grad_output", "cast_config_grad_output", -1))
# The tally of one (layer, role): sums over the counted steps, then the last counted step's amax and scales,
# the largest amax, and the first counted step (by its index among them) that saturated.
FIELDS = ("counted", "saturated", "saturated_share", "underflow_share", "saturated_steps", "zero_amax_steps",
          "nonfinite_steps", "amax", "scale", "scale_max", "amax_max", "first_saturated")
_SUMS, _LAST, _MAX, _FIRST = slice(0, 7), slice(7, 10), slice(10, 11), 11


def float8_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every torchao ``Float8Linear`` in ``model`` (wrappers looked through)."""
    linear = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    if linear is None:
        return []
    inner, _ = unwrap(model)
    return [(name, module) for name, module in inner.named_modules() if isinstance(module, linear)]


def _format(dtype: torch.dtype) -> Fp8Format:
    return E5M2 if dtype == torch.float8_e5m2 else E4M3


def _cast_params(config: Any, cast: str, axis: int) -> tuple[torch.dtype, int | None, bool] | None:
    """(dtype, axiswise dim or None, round to a power of two) of a config's cast; ``None``: disabled."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    cast_config = getattr(config, cast)
    if cast_config.scaling_type is ScalingType.DISABLED:
        return None
    dim = axis if cast_config.scaling_granularity is ScalingGranularity.AXISWISE else None
    return cast_config.target_dtype, dim, bool(config.round_scales_to_power_of_2)


@torch.no_grad()
def _count(x: torch.Tensor, params: tuple[torch.dtype, int | None, bool], tally: torch.Tensor) -> None:
    """Cast ``x`` as torchao would (its scale, not its bits) and fold what the cast does into ``tally``."""
    from torchao.float8.float8_utils import amax_to_scale

    dtype, dim, rounded = params
    fmt = _format(dtype)
    a = x.detach().abs()
    amax = a.amax() if dim is None else torch.amax(a, dim=dim, keepdim=True)
    scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=rounded)
    top = amax.float() if dim is None else amax.amax().float()
    # rowwise: the row with the largest amax has the coarsest (smallest) scale
    smallest, largest = (scale, scale) if dim is None else (scale.amin(), scale.amax())
    scaled = a.float() * scale
    saturated = (scaled >= fmt.saturation).sum().float()
    underflow = ((scaled < fmt.min_normal) & (a > 0)).sum().float()
    n = a.numel()
    sums = torch.stack([torch.ones_like(top), saturated, saturated / n, underflow / n,
                        (saturated > 0).float(), (top == 0).float(),
                        ((top * 0) != 0).float()])  # inf * 0 and nan * 0 are NaN
    first = torch.where(saturated > 0, tally[0], torch.full_like(tally[0], math.inf))  # before this step's
    tally[_SUMS].add_(sums.to(tally.dtype))
    tally[_LAST].copy_(torch.stack([top, smallest.float(), largest.float()]))
    torch.maximum(tally[_MAX], top, out=tally[_MAX])
    torch.minimum(tally[_FIRST], first, out=tally[_FIRST])


class _GradProbe(torch.autograd.Function):
    """The identity on a layer's output whose backward counts the output's gradient."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, tally: torch.Tensor, params: Any) -> torch.Tensor:
        ctx.tally, ctx.params = tally, params
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _count(grad, ctx.params, ctx.tally)
        return grad, None, None


class TorchaoCasts:
    """The ``Float8Linear`` layers of one model, watched (see the module docstring).

    Example:
        >>> casts = TorchaoCasts()
        >>> casts.watch(torch.nn.Linear(4, 4)); casts.layers
        ()
    """

    def __init__(self) -> None:
        self.counting = False
        self._layers: list[tuple[str, torch.nn.Module, list[Any]]] = []
        self._handles: list[Any] = []
        self._tally: torch.Tensor | None = None
        self._counted_steps: list[int] = []

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self._layers)

    def watch(self, model: torch.nn.Module) -> None:
        """A forward hook on every ``Float8Linear`` of ``model`` (the old hooks are taken off first)."""
        self.unwatch()
        found = float8_linears(model)
        if not found:
            return
        device = next((p.device for _, m in found for p in m.parameters()), torch.device("cpu"))
        self._tally = torch.zeros(len(found), len(_CASTS), len(FIELDS), dtype=torch.float64, device=device)
        self._tally[..., _FIRST] = math.inf
        for index, (name, module) in enumerate(found):
            params = [_cast_params(module.config, cast, axis) for _, cast, axis in _CASTS]
            self._layers.append((name, module, params))
            self._handles.append(module.register_forward_hook(self._hook(index, params)))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._layers, self._tally = [], [], None

    def _hook(self, index: int, params: list[Any]) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            if not self.counting or not torch.is_grad_enabled():
                return None
            tally = self._tally
            assert tally is not None
            x = args[0]
            if torch.is_autocast_enabled():  # Float8Linear casts its input to the autocast dtype first
                x = x.to(torch.get_autocast_gpu_dtype())
            if params[0] is not None:
                _count(x, params[0], tally[index, 0])
            if params[1] is not None:
                _count(module.weight.t(), params[1], tally[index, 1])
            if params[2] is None or not output.requires_grad:
                return None
            return _GradProbe.apply(output, tally[index, 2], params[2])
        return hook

    def note_step(self, step: int) -> None:
        """The host's record that optimizer step ``step`` was counted (the tally knows only how many)."""
        self._counted_steps.append(int(step))

    def read(self, step: int) -> list[TensorRead]:
        """One host read: every layer's roles over the counted steps since the last read; the tally is
        zeroed on the device."""
        if self._tally is None:
            return []
        host = self._tally.tolist()  # the one copy to the host
        self._tally.zero_()
        self._tally[..., _FIRST] = math.inf
        counted_steps, self._counted_steps = self._counted_steps, []
        out = []
        for (name, _, params), rows in zip(self._layers, host, strict=True):
            for (role, _, _), param, row in zip(_CASTS, params, rows, strict=True):
                if param is None:
                    continue
                f = dict(zip(FIELDS, row, strict=True))
                counted = int(f["counted"])
                first = f["first_saturated"]
                first_step = (counted_steps[int(first)] if math.isfinite(first) and first < len(counted_steps)
                              else None)
                out.append(TensorRead(
                    name, role, _format(param[0]).name, "dynamic",
                    amax=f["amax"] if counted else None, scale=f["scale"] if counted else None,
                    saturated=int(f["saturated"]) if counted else None,
                    saturated_share=f["saturated_share"] / counted if counted else None,
                    underflow_share=f["underflow_share"] / counted if counted else None,
                    saturated_steps=int(f["saturated_steps"]), first_saturated_step=first_step))
        return out
