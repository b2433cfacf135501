"""The concepts page's pictures, drawn at the start of every build (so they follow the code they show).

- ``trajectory.png``: the loss scale over 2,000 steps as the core's own update rule
  (:func:`~lossscale_callbacks.next_state`) moves it, for a run whose largest gradient varies from step to
  step: a step overflows when the scale times that gradient is above float16's 65504. Two policies, one
  without hysteresis and one with ``hysteresis=2``.
- ``ranges.png``: float16's and bfloat16's ranges against the values of a real training step: the weights,
  activations and gradients of a 10-layer MLP (PyTorch's default initialisation, one cross-entropy step in
  float32), and the gradients once multiplied by a loss scale of 2^16.

Written into ``docs/_generated/`` (not in git), only when their bytes change. Run it alone to look at them:

    python docs/_ext/lsc_figures.py OUT_DIR
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

FP16_MAX = 65504.0
FIGURES = ("trajectory.png", "ranges.png")


def gradient_maxima(steps: int, seed: int = 0) -> np.ndarray:
    """The largest |gradient| of each step of a made-up run: log2 normal around 2^-2 (sd 0.6)."""
    return 2.0 ** np.random.default_rng(seed).normal(-2.0, 0.6, steps)


def trajectory(policy: Any, maxima: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(scale before each step, whether the step was skipped)`` under the core's update rule."""
    from lossscale_callbacks import initial_state, next_state

    state = initial_state(policy)
    scales, skipped = [], []
    for largest in maxima:
        scale = float(state.scale)
        finite = scale * largest <= FP16_MAX
        scales.append(scale)
        skipped.append(not finite)
        state = next_state(policy, state, finite=finite)
    return np.array(scales), np.array(skipped)


def draw_trajectory() -> Any:
    import matplotlib.pyplot as plt

    from lossscale_callbacks import DynamicPolicy

    maxima = gradient_maxima(2000)
    cases = [("growth_interval=200, backoff_factor=0.5, hysteresis=1",
              DynamicPolicy(initial_scale=2.0**24, growth_interval=200)),
             ("the same with hysteresis=2", DynamicPolicy(initial_scale=2.0**24, growth_interval=200,
                                                          hysteresis=2))]
    figure, axes = plt.subplots(2, 1, figsize=(9, 5.6), sharex=True, constrained_layout=True)
    ceiling = np.log2(FP16_MAX / maxima)
    for axis, (title, policy) in zip(axes, cases, strict=True):
        scales, skipped = trajectory(policy, maxima)
        steps = np.arange(1, len(scales) + 1)
        axis.plot(steps, ceiling, color="lightgrey", linewidth=0.6,
                  label="largest scale this step fits: 65504 / max |gradient|")
        axis.step(steps, np.log2(scales), where="post", color="tab:blue", label="log2(scale)")
        axis.plot(steps[skipped], np.log2(scales[skipped]), "x", color="tab:red", markersize=6,
                  label=f"skipped step ({int(skipped.sum())} of {len(steps)})")
        axis.set_title(title, fontsize=10, loc="left")
        axis.set_ylabel("log2(scale)")
        axis.set_ylim(14, 25)
        axis.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("optimizer step")
    figure.suptitle("DynamicPolicy(initial_scale=2**24, ...): the core's update rule, step by step",
                    fontsize=11)
    return figure


def training_values() -> dict[str, np.ndarray]:
    """log2 |value| of a 10-layer MLP's weights, activations and gradients at its first step (float32)."""
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 256), torch.nn.GELU()]
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))
    outputs: list[torch.Tensor] = []
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda m, i, out: outputs.append(out.detach().flatten()))
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    torch.nn.functional.cross_entropy(model(x), y).backward()

    def log2(values: torch.Tensor) -> np.ndarray:
        values = values.abs()
        return values[values > 0].log2().numpy()

    return {"weights": log2(torch.cat([p.detach().flatten() for p in model.parameters()])),
            "activations": log2(torch.cat(outputs)),
            "gradients": log2(torch.cat([p.grad.flatten() for p in model.parameters()]))}


def draw_ranges() -> Any:
    import matplotlib.pyplot as plt

    values = training_values()
    rows = [("weights", values["weights"], "tab:green"),
            ("activations (outputs of the Linear layers)", values["activations"], "tab:purple"),
            ("gradients", values["gradients"], "tab:red"),
            ("gradients x 2^16 (the loss scaled)", values["gradients"] + 16, "tab:blue")]
    figure, axes = plt.subplots(len(rows), 1, figsize=(9, 6.4), sharex=True, constrained_layout=True)
    bins = np.arange(-50, 22, 1.0)
    for axis, (name, data, color) in zip(axes, rows, strict=True):
        axis.axvspan(-24, -14, color="#f3d9a6", label="float16 subnormal: precision lost")
        axis.axvspan(-14, math.log2(FP16_MAX), color="#cfe8cf", label="float16 normal")
        axis.axvspan(math.log2(FP16_MAX), 22, color="#f4c2c2", label="above float16's 65504: Inf")
        axis.hist(np.clip(data, -50, 21.5), bins=bins, color=color, alpha=0.85)
        lost = float(np.mean(data < -24)) * 100
        axis.set_title(f"{name}: {lost:.0f}% below 2^-24, zero in float16", fontsize=9, loc="left")
        axis.set_yticks([])
    axes[0].legend(loc="upper left", fontsize=7, ncols=3)
    axes[-1].set_xlabel("log2 |value|   (bfloat16 and float32 reach 2^-133 and 2^128: the whole axis fits)")
    figure.suptitle("One training step of a 10-layer MLP (float32), against float16's range", fontsize=11)
    return figure


def _png(figure: Any) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    return buffer.getvalue()


def write_figures(out: Path) -> list[Path]:
    """Draw every figure into ``out``; a file whose bytes are unchanged is left alone. Returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in zip(FIGURES, (draw_trajectory, draw_ranges), strict=True):
        data, path = _png(draw()), out / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
        written.append(path)
    return written


def _on_builder_inited(app: Any) -> None:
    write_figures(Path(app.srcdir) / "_generated")


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for figure_path in write_figures(Path(sys.argv[1] if len(sys.argv) > 1 else "figures")):
        print(figure_path)
