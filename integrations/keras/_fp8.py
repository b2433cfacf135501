"""Keras' fp8 layers watched: every step's amax and scale from their own histories, the casts' saturated and
underflowed values counted on the device, one host read at the log interval; every Keras backend.

A layer quantized with ``model.quantize("float8")`` (or built under ``dtype="float8_from_float32"``:
``Dense``, ``EinsumDense``) keeps, per role, a scale and an amax history (``inputs_*``, ``kernel_*``,
``outputs_grad_*``; 1,024 steps unless the dtype policy's ``amax_history_length`` says otherwise).
Keras overwrites both with the step's own "gradients": the scale a step divides by is made from the
history read at the step before it, so from amaxes up to two steps earlier (``lag`` 2 in
:mod:`lossscale_callbacks.fp8._delayed`). One read of the histories every ``K <= length - 2`` steps
rebuilds every step's amax and scale, and the steps that saturated (an amax beyond what the scale held).

How many values a cast clipped or flushed is counted on the device on the counted steps (every
``count_every``-th, chosen on the host): :meth:`Fp8Layers.watch` gives each layer one more variable (its
**tally**, 10 float32 values, not saved with the layer's weights) and wraps its ``quantized_call``:

* the input and the kernel are counted in the forward pass against the scales the layer casts with;
* the output gradient is counted in the backward pass by a ``custom_gradient`` identity put before the
  layer's activation (where Keras casts that gradient), which returns the new tally as the tally's
  gradient; the tally, like Keras' own fp8 variables, has ``overwrite_with_gradient``, so the optimizer
  stores it. On JAX the same identity, without counting, runs on the other steps: JAX would otherwise
  give the tally a zero gradient there, and it passes the tally on unchanged (a copy of 10 values). On
  TensorFlow and torch the other steps run the layer as it is: the tally gets no gradient, so the
  optimizer leaves it (measured on TensorFlow, the identity and the tally's store cost 1.1 % of a step
  of this benchmark's model: ``benchmarks/fp8_overhead.py``).

Which steps count is the host's choice: :class:`~lossscale_callbacks.keras.Fp8ScaleCallback` runs ``fit``
with one train function for the counted steps (traced while :attr:`Fp8Layers.counting` holds) and the
ordinary one for the others. No host read in the step; :meth:`Fp8Layers.read` is one, at the interval.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks.integration import (
    E4M3,
    E5M2,
    DelayedHistory,
    Fp8Format,
    Fp8Read,
    TensorRead,
    observe_together,
)
from lossscale_callbacks.keras._forward_trace import traced_layers
from lossscale_callbacks.keras._variable_reads import LiveVariables, host_values

__all__ = ["LAG", "TALLY", "Fp8Layers", "fp8_layers"]

LAG = 2  # Keras casts with the scale made from the history read one step before (amaxes up to t - 2)
# Whether an ordinary step must pass the tally on: JAX differentiates every trainable variable, so an
# unconnected tally gets a zero gradient, which the optimizer would store. TensorFlow and torch give it
# none: the optimizer leaves it as it is (and warns, once a trace on TensorFlow: the filter below).
_JAX = keras.backend.backend() == "jax"
_PASS_ON = _JAX
TALLY = "fp8_scale_tally"
_NO_GRADIENT_TALLIES = rf"Gradients do not exist for variables \[('[^']*/{TALLY}'(, )?)+\] when minimizing"
# The tally: the counted steps, then per role (input, kernel, output gradient) the saturated values, the
# sum of the steps' saturated shares and the sum of their underflow shares.
_ROLES = (("input", "inputs", E4M3), ("weight", "kernel", E4M3), ("grad_output", "outputs_grad", E5M2))
TALLY_SIZE = 1 + 3 * len(_ROLES)
# A read's variables of one layer, before its tally: each role's scale, then its amax history.
_READ = tuple(name for _, prefix, _ in _ROLES for name in (f"{prefix}_scale", f"{prefix}_amax_history"))


def fp8_layers(model: Any) -> list[tuple[str, Any]]:
    """``(path, layer)`` of every layer of ``model`` that casts in fp8 (``quantization_mode == "float8"``)."""
    return [(path, layer) for path, layer in traced_layers(model)
            if getattr(layer, "quantization_mode", None) == "float8"
            and hasattr(layer, "inputs_amax_history")]


def _counts(x: Any, scale: Any, fmt: Fp8Format) -> Any:
    """``[saturated values, saturated share, underflow share]`` of ``x`` cast as ``x / scale`` (float32).

    The counts are float32 sums of 0/1 values: exact while a count stays under 2**24 (the tally that
    adds them up is float32 either way), and a third of an int32 sum's time in XLA on the CPU. On JAX
    the operands pass an optimization barrier first: without it XLA fused the two counts of a kernel
    into the step's own fusions and a counted step of 3 fp8 ``Dense`` of 1,024 took 2.1 times an
    ordinary one instead of 1.15 (``benchmarks/fp8_overhead.py``)."""
    if _JAX:
        import jax

        x, scale = jax.lax.optimization_barrier((x, scale))
    a = ops.abs(ops.cast(x, "float32"))
    scale = ops.cast(scale, "float32")
    total = ops.cast(ops.size(a), "float32")
    saturated = ops.sum(ops.cast(a >= fmt.saturation * scale, "float32"))
    small = ops.logical_and(a < fmt.min_normal * scale, a > 0)
    underflow = ops.sum(ops.cast(small, "float32"))
    return ops.stack([saturated, saturated / total, underflow / total])


def _kernel(layer: Any) -> Any:
    return getattr(layer, "_kernel", None) if getattr(layer, "_kernel", None) is not None else layer.kernel


@dataclasses.dataclass
class _Watched:
    path: str
    layer: Any
    tally: Any
    original: Any
    histories: dict[str, DelayedHistory]


class Fp8Layers:
    """The fp8 layers of one model, watched (see the module docstring).

    Args:
        count_every: optimizer steps between counted steps (informs the host's choice only).

    Example:
        >>> Fp8Layers(count_every=10).layers
        ()
    """

    def __init__(self, count_every: int = 10) -> None:
        self.count_every = int(count_every)
        self.counting = False  # set while the counting train function runs (torch) or traces (TF, JAX)
        self.counting_enabled = True  # False: the optimizer cannot store the tallies (see Fp8ScaleCallback)
        self._watched: list[_Watched] = []
        self._live = LiveVariables()

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(w.path for w in self._watched)

    @property
    def history_length(self) -> int | None:
        """The shortest amax history of the watched layers (the longest interval the rebuild allows is this
        minus 2)."""
        lengths = [int(w.layer.inputs_amax_history.shape[0]) for w in self._watched]
        return min(lengths) if lengths else None

    # ------------------------------------------------------------------ watching

    def watch(self, model: Any) -> None:
        """Give each fp8 layer of ``model`` its tally and wrap its ``quantized_call`` (again: the old
        wrappers are taken off first). Call it before the train function is made."""
        self.unwatch()
        if not _PASS_ON:
            # Keras' warning for variables without a gradient, when the tallies are all it names (an
            # ordinary step's, by design); a user's own variable in the list keeps the warning.
            warnings.filterwarnings("ignore", message=_NO_GRADIENT_TALLIES, category=UserWarning)
        for path, layer in fp8_layers(model):
            tally = getattr(layer, TALLY, None)
            if tally is None:
                tracker = getattr(layer, "_tracker", None)
                if tracker is not None:
                    tracker.unlock()  # as Keras' own quantize() does on a built layer
                try:
                    tally = layer.add_weight(name=TALLY, shape=(TALLY_SIZE,), initializer="zeros",
                                             dtype="float32", trainable=True, autocast=False)
                finally:
                    if tracker is not None:
                        tracker.lock()
                tally.overwrite_with_gradient = True
                object.__setattr__(layer, TALLY, tally)
                # Loading checks the stored variables' count against the layer's: the tally (never saved:
                # Dense and EinsumDense save their variables by name) is out of the list while it loads.
                object.__setattr__(layer, "load_own_variables",
                                   functools.partial(_load_without, layer, tally, layer.load_own_variables))
            length = int(layer.inputs_amax_history.shape[0])
            histories = {role: DelayedHistory(length, LAG, fmt) for role, _, fmt in _ROLES}
            watched = _Watched(path, layer, tally, layer.quantized_call, histories)
            object.__setattr__(layer, "quantized_call", functools.partial(self._call, watched))
            self._watched.append(watched)

    def unwatch(self) -> None:
        """Take the wrappers off (the tallies stay, untouched)."""
        for w in self._watched:
            w.layer.__dict__.pop("quantized_call", None)
        self._watched = []
        self._live.forget()

    def new_fit(self) -> None:
        """A ``fit`` starts: the model's variables are indexed again at its first live read."""
        self._live.forget()

    def _call(self, w: _Watched, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        counting = self.counting
        if not kwargs.get("training") or not (counting or _PASS_ON):
            return w.original(inputs, *args, **kwargs)
        layer = w.layer
        tally = ops.convert_to_tensor(w.tally)
        if counting:
            forward = ops.concatenate([
                _counts(inputs, ops.convert_to_tensor(layer.inputs_scale), E4M3),
                _counts(ops.convert_to_tensor(_kernel(layer)), ops.convert_to_tensor(layer.kernel_scale),
                        E4M3)])
            grad_scale = ops.convert_to_tensor(layer.outputs_grad_scale)
        else:
            forward = grad_scale = None
        activation = layer.activation
        probe = _probe(counting)

        def probed(z: Any) -> Any:
            if counting:
                z = probe(z, forward, tally, grad_scale)
            else:
                z = probe(z, tally)
            return activation(z)

        object.__setattr__(layer, "activation", probed)  # past Keras' tracking: restored at once
        try:
            return w.original(inputs, *args, **kwargs)
        finally:
            object.__setattr__(layer, "activation", activation)

    # ------------------------------------------------------------------ reading

    def read(self, step: int, model: Any = None) -> Fp8Read:
        """One host read after ``step`` optimizer steps: every layer's scales, histories and tally; the
        tallies start again from zero. The first read only sets the baseline of the histories. During
        JAX's ``fit`` the trainer's live state is lent to these variables (see
        :mod:`lossscale_callbacks.keras._variable_reads`): no sync of every variable."""
        watched = self._watched
        variables = [v for w in watched for v in (*(getattr(w.layer, n) for n in _READ), w.tally)]
        with self._live.lent(model, variables):
            values = host_values(variables)
            for w in watched:
                self._live.zero(w.tally)
        per_layer = len(_READ) + 1
        tallies = values[per_layer - 1::per_layer]
        # Every layer's three histories and scales in _READ's order (a role's scale, then its history).
        rings = [values[at * per_layer + 2 * r + 1] for at in range(len(watched)) for r in range(len(_ROLES))]
        scales = [_multiplier(float(values[at * per_layer + 2 * r]))
                  for at in range(len(watched)) for r in range(len(_ROLES))]
        histories = [w.histories[role] for w in watched for role, _, _ in _ROLES]
        if len({len(ring) for ring in rings}) == 1:
            amaxes: Any = np.roll(np.stack(rings), -1, axis=1)  # Keras writes the newest at index 0
        else:
            amaxes = [np.roll(ring, -1) for ring in rings]
        views = observe_together(histories, step, amaxes, scales)  # every layer and role at once
        tensors = []
        for at, (w, tally) in enumerate(zip(watched, tallies, strict=True)):
            calls = int(tally[0])
            counted = tally[1:].tolist()
            for index, (role, _, fmt) in enumerate(_ROLES):
                ring, view = rings[at * len(_ROLES) + index], views[at * len(_ROLES) + index]
                sat, sat_share, und_share = counted[3 * index: 3 * index + 3]
                last = view.rows[-1] if view.rows else None
                tensors.append(TensorRead(
                    w.path, role, fmt.name, "delayed",
                    amax=last[1] if last else float(ring[0]),
                    scale=last[2] if last else None,
                    saturated=int(sat) if calls else None,
                    saturated_share=sat_share / calls if calls else None,
                    underflow_share=und_share / calls if calls else None,
                    saturated_steps=len(view.saturated_steps),
                    max_overshoot=max((o for _, o in view.saturated_steps), default=None),
                    first_saturated_step=view.saturated_steps[0][0] if view.saturated_steps else None,
                    history_length=len(ring), history_ratio=view.history_ratio,
                    outlier_step=view.outlier_step, coarse_until=view.coarse_until,
                    stale_ratio=view.stale_ratio, replaced_after=view.replaced_after, rows=view.rows))
        return Fp8Read(int(step), tuple(tensors))

    def tallies(self) -> Iterator[tuple[str, np.ndarray]]:
        """Each layer's tally as it stands (tests)."""
        for w in self._watched:
            yield w.path, np.asarray(ops.convert_to_numpy(w.tally), "float64")


def _load_without(layer: Any, tally: Any, load: Any, store: Any) -> None:
    """``layer.load_own_variables(store)`` with ``tally`` out of the layer's variables while it runs."""
    listed = layer._trainable_variables
    at = next((i for i, v in enumerate(listed) if v is tally), None)
    if at is not None:
        listed.pop(at)
    try:
        load(store)
    finally:
        if at is not None:
            listed.insert(at, tally)


def _multiplier(keras_scale: float) -> float:
    """Keras keeps the reciprocal of the scale (values are divided by it)."""
    return 1.0 / keras_scale if keras_scale > 0 and math.isfinite(keras_scale) else math.nan


@functools.lru_cache(maxsize=2)
def _probe(counting: bool) -> Any:
    """The identity before a layer's activation whose gradient carries the tally (the module docstring)."""
    if counting:
        @ops.custom_gradient
        def counted(z: Any, forward: Any, tally: Any, grad_scale: Any) -> Any:
            def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
                if upstream is None:
                    (upstream,) = args
                step = ops.concatenate([ops.ones((1,), "float32"), forward,
                                        _counts(upstream, grad_scale, E5M2)])
                return upstream, ops.zeros_like(forward), tally + step, ops.zeros_like(grad_scale)
            return z, grad
        return counted

    @ops.custom_gradient
    def passed(z: Any, tally: Any) -> Any:
        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            return upstream, tally
        return z, grad
    return passed
