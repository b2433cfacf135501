"""The core's :class:`~lossscale_callbacks.extend.Ops` in ``keras.ops``: one backend for TF, JAX and torch.

With these ops the core's update rule runs wherever Keras runs: inside ``jax.jit`` (Keras'
``stateless_apply`` path), eagerly or compiled on torch, and in ``tf.function``. Every method is one
``keras.ops`` call on scalar tensors; nothing reads a value back to the host.

Counters are int64, except on JAX without ``jax_enable_x64`` (JAX's default), where int64 does not
exist and they are int32 (values are the same up to 2**31 steps). The scale is float32 everywhere,
so the rule is bit-identical to the NumPy reference on every backend (``tests/test_keras_backends.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
from keras import ops

SCALE_DTYPE = "float32"
_HALF = ("float16", "bfloat16")


def counter_dtype() -> str:
    """``"int64"``, or ``"int32"`` on JAX without x64 (which would truncate int64 with a warning)."""
    if keras.backend.backend() == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            return "int32"
    return "int64"


class KerasOps:
    """The core's ``Ops`` with ``keras.ops``: float32 scale, integer counters, 0-d tensors.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy, initial_state, next_state
        >>> policy = DynamicPolicy(initial_scale=8.0, growth_interval=2)
        >>> state = next_state(policy, initial_state(policy, KERAS_OPS), False, KERAS_OPS)
        >>> float(state.scale), int(state.skipped_steps)
        (4.0, 1)
    """

    name = "keras"

    def scale(self, value: float) -> Any:
        # Every backend rounds a Python float to the nearest float32, as NumPy does.
        return ops.convert_to_tensor(value, dtype=SCALE_DTYPE)

    def count(self, value: int) -> Any:
        return ops.convert_to_tensor(value, dtype=counter_dtype())

    def as_bool(self, value: Any) -> Any:
        value = ops.convert_to_tensor(value)
        if keras.backend.standardize_dtype(value.dtype) == "bool":
            return value
        return ops.not_equal(value, 0)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return ops.where(condition, x, y)

    def minimum(self, x: Any, y: Any) -> Any:
        return ops.minimum(x, y)

    def maximum(self, x: Any, y: Any) -> Any:
        return ops.maximum(x, y)

    def logical_and(self, x: Any, y: Any) -> Any:
        return ops.logical_and(x, y)

    def logical_not(self, x: Any) -> Any:
        return ops.logical_not(x)


KERAS_OPS = KerasOps()


def _torch_found_inf(tensors: list[Any]) -> Any:
    """torch: 1.0 if any tensor holds an Inf/NaN, else 0.0, from torch's fused multi-tensor check.

    ``_amp_foreach_non_finite_check_and_unscale_`` (GradScaler's kernel) is one pass over all the
    tensors, ~15x faster on the CPU than an ``isfinite().all()`` per tensor. It multiplies them in
    place by its factor, here exactly 1.0: every value, signed zeros and NaNs included, stays as it
    was.
    """
    import torch

    found = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    one = torch.ones((), dtype=torch.float32, device=tensors[0].device)
    by_device: dict[Any, list[Any]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for device, group in by_device.items():
            if device == found.device:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
            else:
                other = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(group, other, one.to(device))
                found = torch.maximum(found, other.to(found.device))
    return found


def all_finite(grads: Iterable[Any]) -> Any:
    """A scalar bool tensor: True when every element of every gradient is finite. ``None`` is ignored.

    One reduction per gradient and one over the flags (on torch, one fused multi-tensor pass); no
    host read.
    """
    grads = [g for g in grads if g is not None]
    if grads and keras.backend.backend() == "torch":
        return ops.equal(_torch_found_inf(grads), 0.0)
    checks = [ops.all(ops.isfinite(g)) for g in grads]
    if not checks:
        return ops.convert_to_tensor(True)
    if len(checks) == 1:
        return checks[0]
    return ops.all(ops.stack(checks))


def check_and_unscale(grads: list[Any], scale: Any, keep: Iterable[int] = ()) -> tuple[Any, list[Any]]:
    """``(all finite, grads / scale)`` in one go; the gradients at the indices in ``keep`` stay as they are.

    The same values as :func:`all_finite` and :func:`unscale` of each gradient. On torch, the float32
    gradients are divided by one ``torch._foreach_div`` (new tensors: the caller's gradients are not
    modified) and the flag comes from one fused pass; no host read anywhere.
    """
    keep = set(keep)
    if keras.backend.backend() != "torch":
        out = [g if i in keep else unscale(g, scale) for i, g in enumerate(grads)]
        return all_finite(grads), out
    import torch

    out = list(grads)
    fast = [i for i, g in enumerate(grads) if g is not None and i not in keep and g.dtype == torch.float32]
    if fast:
        for i, divided in zip(fast, torch._foreach_div([grads[i] for i in fast], scale), strict=True):
            out[i] = divided
    fast_set = set(fast)
    for i, g in enumerate(grads):
        if g is not None and i not in keep and i not in fast_set:
            out[i] = unscale(g, scale)
    # Checked after dividing: an Inf or NaN stays one, and a value that the division itself turns
    # into an Inf (a scale below 1) must not be applied either.
    checked = [t for t in out if t is not None]
    finite = ops.equal(_torch_found_inf(checked), 0.0) if checked else ops.convert_to_tensor(True)
    return finite, out


def unscale(grad: Any, scale: Any) -> Any:
    """``grad / scale`` in the gradient's dtype; half-precision gradients are divided in float32.

    float64 gradients use the exact float64 value of the float32 scale.
    """
    if grad is None:
        return None
    dtype = keras.backend.standardize_dtype(grad.dtype)
    if dtype == SCALE_DTYPE:
        return ops.divide(grad, scale)
    if dtype == "float64":
        return ops.divide(grad, ops.cast(scale, "float64"))
    if dtype in _HALF:
        return ops.cast(ops.divide(ops.cast(grad, SCALE_DTYPE), scale), dtype)
    return ops.divide(grad, ops.cast(scale, dtype))
