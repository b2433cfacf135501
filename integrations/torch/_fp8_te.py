"""TransformerEngine's delayed scaling read from its modules' ``fp8_meta``, by the fields of its source.

Read from TransformerEngine v2.18 (``transformer_engine/pytorch/quantization.py``:
``DelayedScalingRecipeState``, ``_update_amax_history``, ``_default_sf_compute``;
``transformer_engine/pytorch/module/base.py``: ``init_fp8_meta_tensors``, ``get_extra_state``;
``transformer_engine/pytorch/csrc/common.h``: ``FP8FwdTensors``, ``FP8BwdTensors``). A module
(``te.Linear``, ``LayerNormLinear``, ``LayerNormMLP``...) keeps ``fp8_meta`` with ``"recipe"`` (a
``DelayedScaling``: ``amax_history_len``, ``amax_compute_algo``, ``margin``, ``fp8_format``),
``"num_gemms"`` and two states, ``"scaling_fwd"`` and ``"scaling_bwd"``, each with ``scale`` (one
float32 per tensor; values are multiplied by it) and ``amax_history`` (``amax_history_len`` rows, one
column per tensor). The forward state holds three tensors per GEMM (input ``3k``, weight ``3k + 1``,
output ``3k + 2``), the backward two (output gradient ``2k``, input gradient ``2k + 1``). After each
update the history is rolled by one row and row 0 zeroed for the next step's amax, so between steps rows
``1 ... len - 1`` hold the last ``len - 1`` amaxes, oldest first; the scale the next step casts with was
made from the ``len`` amaxes up to the step just done (``lag`` 1), ``fmt.max / amax / 2**margin``.

No GPU here and TransformerEngine needs CUDA: this reader is tested on a recording of that state made by
following those fields and that rule (``tests/te_recording.py``), not on TransformerEngine itself. Nothing
is imported from it: a module is recognised by its ``fp8_meta``.
"""

from __future__ import annotations

from typing import Any

import torch

from lossscale_callbacks.integration import E4M3, E5M2, DelayedHistory, Fp8Format, TensorRead
from lossscale_callbacks.torch._forensics import unwrap

__all__ = ["TeScales", "te_modules"]

LAG = 1


def te_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module of ``model`` holding a delayed-scaling ``fp8_meta``."""
    inner, _ = unwrap(model)
    found = []
    for name, module in inner.named_modules():
        meta = getattr(module, "fp8_meta", None)
        state = meta.get("scaling_fwd") if isinstance(meta, dict) else None
        if state is not None and hasattr(state, "scale") and hasattr(state, "amax_history"):
            found.append((name, module))
    return found


def _formats(recipe: Any) -> tuple[Fp8Format, Fp8Format]:
    """(forward, backward) formats of a recipe: HYBRID is e4m3 forward and e5m2 backward."""
    helper = getattr(getattr(recipe, "fp8_format", None), "value", None)
    by_max = {448.0: E4M3, 57344.0: E5M2}
    forward = by_max.get(float(getattr(helper, "max_fwd", 448.0)), E4M3)
    backward = by_max.get(float(getattr(helper, "max_bwd", 57344.0)), E5M2)
    return forward, backward


class TeScales:
    """The delayed-scaling state of every TransformerEngine module of one model, read at the interval.

    Example:
        >>> scales = TeScales()
        >>> scales.watch(torch.nn.Linear(4, 4)); scales.layers
        ()
    """

    def __init__(self) -> None:
        self._modules: list[tuple[str, torch.nn.Module]] = []
        self._histories: dict[tuple[str, str], DelayedHistory] = {}

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._modules)

    def watch(self, model: torch.nn.Module) -> None:
        self._modules = te_modules(model)
        self._histories = {}

    def _tensors(self, name: str, meta: dict[str, Any]) -> list[tuple[str, str, str, int, Fp8Format]]:
        """(layer, role, state, column, format) of each watched tensor of one module."""
        gemms = int(meta.get("num_gemms", 1))
        forward, backward = _formats(meta.get("recipe"))
        out = []
        for k in range(gemms):
            layer = name if gemms == 1 else f"{name}/gemm{k + 1}"
            out += [(layer, "input", "scaling_fwd", 3 * k, forward),
                    (layer, "weight", "scaling_fwd", 3 * k + 1, forward),
                    (layer, "grad_output", "scaling_bwd", 2 * k, backward)]
        return out

    def read(self, step: int) -> list[TensorRead]:
        """One host read of every module's scales and histories after ``step`` optimizer steps (the first
        read sets the baseline of the per-step rebuild)."""
        out = []
        for name, module in self._modules:
            meta = module.fp8_meta
            recipe = meta.get("recipe")
            margin = float(getattr(recipe, "margin", 0) or 0)
            most_recent = getattr(recipe, "amax_compute_algo", "max") == "most_recent"
            host = {key: (meta[key].scale.detach().double().cpu().numpy(),
                          meta[key].amax_history.detach().double().cpu().numpy())
                    for key in ("scaling_fwd", "scaling_bwd") if key in meta}
            for layer, role, key, column, fmt in self._tensors(name, meta):
                if key not in host or column >= host[key][0].shape[0]:
                    continue
                scales, history = host[key]
                length = history.shape[0]
                tracked = self._histories.get((layer, role))
                if tracked is None:
                    tracked = DelayedHistory(1 if most_recent else length, LAG, fmt, margin)
                    self._histories[layer, role] = tracked
                completed = history[1:, column].tolist()  # row 0 waits for the next step's amax
                view = tracked.observe(step, completed, float(scales[column]))
                last = view.rows[-1] if view.rows else None
                out.append(TensorRead(
                    layer, role, fmt.name, "delayed",
                    amax=last[1] if last else (completed[-1] if completed else None),
                    scale=last[2] if last else float(scales[column]),
                    saturated_steps=len(view.saturated_steps),
                    max_overshoot=max((o for _, o in view.saturated_steps), default=None),
                    first_saturated_step=view.saturated_steps[0][0] if view.saturated_steps else None,
                    history_length=length, history_ratio=view.history_ratio, outlier_step=view.outlier_step,
                    coarse_until=view.coarse_until, stale_ratio=view.stale_ratio,
                    replaced_after=view.replaced_after, rows=view.rows))
        return out

