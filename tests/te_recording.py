"""A recording of TransformerEngine's delayed-scaling state: made here, NOT by TransformerEngine.

TransformerEngine needs CUDA and cannot be installed on the machines these tests run on, so its state is
built from the fields and the update rule of its source, read at v2.18:

* ``transformer_engine/pytorch/quantization.py``: ``DelayedScalingRecipeState`` (``scale``: one float32 per
  tensor, ``amax_history``: ``amax_history_len`` rows by one column per tensor), ``_update_amax_history``
  (roll by one row, zero row 0), ``_default_get_amax_and_update_history`` (``max`` over the rows, or row 0
  for ``most_recent``) and ``_default_sf_compute`` (``fp8_max / amax / 2**margin``; the previous scale when
  the amax is zero or not finite; float32's max when the quotient is infinite);
* ``transformer_engine/pytorch/module/base.py``: ``fp8_meta`` with ``"recipe"``, ``"num_gemms"``,
  ``"scaling_fwd"`` (3 tensors per GEMM) and ``"scaling_bwd"`` (2 per GEMM); ``get_extra_state`` /
  ``set_extra_state`` save and load ``scale`` and ``amax_history`` of both;
* ``transformer_engine/pytorch/csrc/common.h``: ``FP8FwdTensors`` (GEMM k's input ``3k``, weight ``3k+1``,
  output ``3k+2``) and ``FP8BwdTensors`` (GEMM k's output gradient ``2k``, input gradient ``2k+1``);
* ``transformer_engine/common/recipe/__init__.py``: ``Format.HYBRID`` (e4m3 forward, max 448; e5m2
  backward, max 57344) and ``DelayedScaling``'s defaults (``amax_history_len=1024``, ``"max"``, margin 0).

A step here writes each tensor's amax into row 0 (as TransformerEngine's cast kernels do) and then updates,
forward then backward, as its ``reduce_and_update_fp8_tensors`` does after each pass.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

FORMATS = {"HYBRID": (448.0, 57344.0), "E4M3": (448.0, 448.0)}


def _state(columns: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(scale=torch.ones(columns, dtype=torch.float32),
                           amax_history=torch.zeros(length, columns, dtype=torch.float32))


def _update(state: SimpleNamespace, fp8_max: float, recipe: SimpleNamespace) -> None:
    history = state.amax_history
    amax = history.max(dim=0).values if recipe.amax_compute_algo == "max" else history[0].clone()
    if history.shape[0] > 1:
        history.copy_(torch.roll(history, -1, 0))
    history[0].fill_(0.0)
    sf = (fp8_max / amax) / (2**recipe.margin)
    sf = torch.where(amax > 0.0, sf, state.scale)
    sf = torch.where(torch.isfinite(amax), sf, state.scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
    state.scale.copy_(sf)


class RecordedTeModule(torch.nn.Module):
    """A module holding TransformerEngine's ``fp8_meta`` as its source lays it out (the module docstring)."""

    def __init__(self, num_gemms: int = 1, amax_history_len: int = 1024, fp8_format: str = "HYBRID",
                 margin: int = 0, amax_compute_algo: str = "max") -> None:
        super().__init__()
        fwd, bwd = FORMATS[fp8_format]
        self.recipe = SimpleNamespace(
            amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo, margin=margin,
            fp8_format=SimpleNamespace(name=fp8_format, value=SimpleNamespace(max_fwd=fwd, max_bwd=bwd)))
        self.fp8_meta = {"recipe": self.recipe, "num_gemms": num_gemms,
                         "fp8_max_fwd": fwd, "fp8_max_bwd": bwd,
                         "scaling_fwd": _state(3 * num_gemms, amax_history_len),
                         "scaling_bwd": _state(2 * num_gemms, amax_history_len)}

    def step(self, inputs: list[float], weights: list[float], grads: list[float]) -> None:
        """One training step: the amaxes each GEMM's casts saw, then the two updates."""
        fwd, bwd = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
        for k, (i, w, g) in enumerate(zip(inputs, weights, grads, strict=True)):
            fwd.amax_history[0, 3 * k] = i
            fwd.amax_history[0, 3 * k + 1] = w
            bwd.amax_history[0, 2 * k] = g
        _update(fwd, self.fp8_meta["fp8_max_fwd"], self.recipe)
        _update(bwd, self.fp8_meta["fp8_max_bwd"], self.recipe)

    def scales(self, gemm: int = 0) -> tuple[float, float, float]:
        """(input, weight, grad_output) scales the next step casts with."""
        fwd, bwd = self.fp8_meta["scaling_fwd"].scale, self.fp8_meta["scaling_bwd"].scale
        return float(fwd[3 * gemm]), float(fwd[3 * gemm + 1]), float(bwd[2 * gemm])

    def extra_state(self) -> dict[str, torch.Tensor]:
        """What ``get_extra_state`` saves of the scaling state."""
        meta = self.fp8_meta
        return {"scale_fwd": meta["scaling_fwd"].scale.clone(),
                "amax_history_fwd": meta["scaling_fwd"].amax_history.clone(),
                "scale_bwd": meta["scaling_bwd"].scale.clone(),
                "amax_history_bwd": meta["scaling_bwd"].amax_history.clone()}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        """What ``set_extra_state`` copies back."""
        meta = self.fp8_meta
        meta["scaling_fwd"].scale.copy_(state["scale_fwd"])
        meta["scaling_fwd"].amax_history.copy_(state["amax_history_fwd"])
        meta["scaling_bwd"].scale.copy_(state["scale_bwd"])
        meta["scaling_bwd"].amax_history.copy_(state["amax_history_bwd"])
