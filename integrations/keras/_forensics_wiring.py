"""How the Keras ``LossScaleOptimizer`` is wired to overflow forensics (``diagnose=``) on every backend.

The wiring holds what was asked for, the model whose layers name the report, the
:class:`~lossscale_callbacks.keras._forensics_layout.ForensicsLayout` (gradients mapped to layers by
variable, layers in forward order) and the tally's variables, and runs the device functions of
:mod:`~lossscale_callbacks.keras._forensics_device` where each backend's step calls it:

- TensorFlow and JAX (:meth:`ForensicsWiring.traced`): inside the traced step, with the skip decision
  made from the per-layer flags (one ``all(isfinite)`` per gradient, as without forensics), a ``cond``
  that counts a skipped step and one that takes the headroom sample every ``headroom_every`` steps,
  both decided on the device. TensorFlow assigns the new tally to the variables; JAX's stateless step
  returns it with the other optimizer variables (the variables are among ``optimizer.variables``, so
  ``fit``'s jitted step threads them, under ``keras.distribution`` too). In JAX's ``fit`` with
  ``LossScaleCallback`` the host decides the samples instead (``host_schedule``, see
  :mod:`~lossscale_callbacks.keras._fit_sampling`): an ordinary step's trace holds no ``cond`` at all.
- torch (:meth:`ForensicsWiring.eager`): the step already reads the skip flag on the host (as Keras' own
  class does), so the forensics run only on skipped and on sampled steps, with no host read of their own.

The tally's variables are outside Keras' tracking and saving: neither a saved model nor a
``tf.train.Checkpoint`` depends on ``diagnose``. :meth:`ForensicsWiring.read` is the one host read, at the
log interval.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from lossscale_callbacks import LossScaleState
from lossscale_callbacks.integration import (
    CAUSES,
    IntervalForensics,
    LayerHeadroom,
    check_diagnose,
    check_int,
    sampled_within,
)
from lossscale_callbacks.keras import _forensics_device as device
from lossscale_callbacks.keras._forensics_layout import ForensicsLayout
from lossscale_callbacks.keras._keras_ops import counter_dtype


class DiagnoseSettings(NamedTuple):
    """``diagnose`` and ``headroom_every``, checked: made by :func:`check_diagnose_settings` at the one
    place each is given (``LossScaleCallback``, ``LossScaleOptimizer`` and its ``set_diagnose``), and
    handed on as they are."""

    mode: bool | str
    headroom_every: int


def check_diagnose_settings(diagnose: Any, headroom_every: Any) -> DiagnoseSettings:
    """``(diagnose, headroom_every)`` checked, or a ``ValueError`` naming the argument.

    Example:
        >>> check_diagnose_settings("every_step", 1000)
        DiagnoseSettings(mode='every_step', headroom_every=1000)
    """
    return DiagnoseSettings(check_diagnose(diagnose), check_int("headroom_every", headroom_every))


def _creation_scope() -> Any:
    """Variables made while a ``tf.function`` traces the first apply must be made eagerly."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


class ForensicsWiring:
    """The forensics of one optimizer: what was asked for, which model names the layers, the tally.

    Args:
        settings: ``diagnose`` (``False``, ``True`` or ``"every_step"``, see
            :mod:`lossscale_callbacks.forensics._gradients`) and the steps between float16 headroom
            samples, checked (:func:`check_diagnose_settings`).

    Example:
        >>> wiring = ForensicsWiring(check_diagnose_settings(False, 1000))
        >>> wiring.active, wiring.variable_list
        (False, [])
    """

    def __init__(self, settings: DiagnoseSettings) -> None:
        self.settings = settings
        self.model: Any = None
        self.layout: ForensicsLayout | None = None
        self.variables: device.Packed | None = None
        self._ids: dict[tuple[int, ...], tuple[Any, Any]] = {}  # torch: constants made once
        self._host_steps = 0  # torch, and JAX's fit: the sampling schedule, counted on the host
        # JAX's fit (host_scheduled, by LossScaleCallback): the host decides the samples; a trace takes one
        # when ``sampling`` holds while it traces, so an ordinary step's trace has no sample branch at all.
        self.host_schedule = False
        self.sampling = False

    @contextlib.contextmanager
    def host_scheduled(self, sample: bool) -> Iterator[None]:
        """While ``fit`` runs (and so traces) a train function the host chose: the host's schedule, with
        the headroom sample in the step when ``sample``. The device's own schedule again after it."""
        self.host_schedule, self.sampling = True, sample
        try:
            yield
        finally:
            self.host_schedule = self.sampling = False

    @property
    def active(self) -> bool:
        """Whether the forensics run (switched on, and the optimizer built)."""
        return self.variables is not None

    @property
    def variable_list(self) -> list[Any]:
        """The tally's variables (part of ``optimizer.variables``, so stateless steps thread them)."""
        return list(self.variables) if self.variables is not None else []

    @property
    def every(self) -> int:
        mode, every = self.settings
        return 1 if mode == "every_step" else every

    # ---------------------------------------------------------------------------- setting up

    def configure(self, settings: DiagnoseSettings, optimizer: Any) -> None:
        """Switch on or off; a built ``optimizer`` (else ``None``) gets its tally right away."""
        if settings != self.settings or (settings.mode and not self.active):
            self.settings = settings
            self._drop()
            self.build(optimizer)

    def watch(self, model: Any, optimizer: Any) -> None:
        """Name the layers by ``model``'s layer objects, in its order, from now on (a new tally)."""
        self.model = model
        if self.active:
            self._drop()
            self.build(optimizer)

    def _drop(self) -> None:
        self.layout, self.variables, self._ids = None, None, {}

    def build(self, optimizer: Any) -> None:
        """The layout and the tally for ``optimizer``'s variables, when forensics are on and it is built
        (``None``: not built yet)."""
        if not self.settings[0] or optimizer is None or self.active:
            return
        variables = list(optimizer._trainable_variables)
        if not variables:
            return
        self.layout = ForensicsLayout.of(variables, self.model, optimizer._var_key)
        initial = device.zeros(len(self.layout.layers), len(variables))
        with _creation_scope():
            self.variables = device.Packed(*(
                keras.Variable(value, dtype=value.dtype.name, trainable=False,
                               aggregation="only_first_replica", name=f"forensics_{name}")
                for name, value in zip(device.Packed._fields, initial, strict=True)))

    def values(self) -> device.Packed:
        """The tally's current values (tensors on the device)."""
        assert self.variables is not None
        return device.Packed(*(v.value for v in self.variables))

    def assign(self, packed: device.Packed) -> None:
        assert self.variables is not None
        for variable, value in zip(self.variables, packed, strict=True):
            variable.assign(value)

    def split(self, packed: device.Packed) -> device.Tally:
        """``packed`` as a :class:`~lossscale_callbacks.keras._forensics_device.Tally` (views, no copy)."""
        assert self.layout is not None
        return device.split(packed, len(self.layout.layers), len(self.layout.sizes))

    def _constants(self, variables: Sequence[Any]) -> tuple[Any, Any]:
        """The layer id of each variable's gradient and the 0/1 vector of the optimizer variables present."""
        assert self.layout is not None
        layer_ids, indices = self.layout.positions(variables)
        cached = self._ids.get(indices)
        if cached is not None:
            return cached
        seen = np.zeros(len(self.layout.sizes), counter_dtype())
        seen[list(indices)] = 1
        ids = np.asarray(layer_ids, "int64" if keras.backend.backend() == "torch" else "int32")
        made = (ops.convert_to_tensor(ids), ops.convert_to_tensor(seen))
        if keras.backend.backend() == "torch":  # eager: made once; a traced step embeds them as constants
            self._ids[indices] = made
        return made

    # ---------------------------------------------------------------------------- the step

    def traced(self, tally: Callable[[], device.Packed], grads: Sequence[Any], variables: Sequence[Any],
               loss_bad: Any, state: LossScaleState, unscaled: bool,
               agree: Callable[[Any, Any], tuple[Any, Any]]) -> tuple[Any, Any, Callable[[], device.Packed]]:
        """The skip flag of one step and how its tally changes, all on the device (TensorFlow, JAX).

        Args:
            tally: gives the tally's values before the step (called only where the tally changes).
            grads: the gradients (dense), scaled unless ``unscaled``; ``None`` where a variable has none.
            variables: the variable of each gradient.
            loss_bad: whether this step's loss was non-finite (a bool tensor).
            state: the loss-scale state before the step (its scale and steps).
            unscaled: whether ``grads`` are divided by the scale already.
            agree: makes the per-layer flags and ``loss_bad`` global (``tf.distribute``'s all-reduce).

        Returns:
            ``(finite, changed, update)``: whether every gradient is finite, as the step decides it;
            whether the tally changes (a skipped or a sampled step); and the function that makes the new
            tally, for the caller to run in a ``cond`` on ``changed``, so an ordinary step runs none of it.
            Under ``host_schedule`` (JAX's fit) ``changed`` is ``None``: run ``update`` as it is.
        """
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        if not pairs:
            return ops.convert_to_tensor(True), ops.convert_to_tensor(False), tally
        dense = [g for g, _ in pairs]
        ids, seen = self._constants([v for _, v in pairs])
        assert self.layout is not None
        layers = len(self.layout.layers)
        if self.host_schedule:
            return self._host_scheduled(tally, dense, ids, seen, loss_bad, state, unscaled)
        flags, loss_bad = agree(device.layer_flags(device.bad_flags(dense), ids, layers), loss_bad)
        finite = ops.equal(ops.sum(flags), 0.0)
        due = ops.equal(ops.mod(state.steps, self.every), 0)

        def update() -> device.Packed:
            before = tally()

            def count() -> device.Packed:  # a skipped step: its cause, layers and origin
                nan = device.any_nan(dense)
                return device.join(device.fold_skip(self.split(before), flags, loss_bad, nan), before)

            counted = device.Packed(*ops.cond(finite, lambda: before, count))
            factor = state.scale if unscaled else ops.ones((), "float32")
            return device.Packed(*ops.cond(due, lambda: device.join(
                device.sample(self.split(counted), dense, ids, seen, factor, state.scale), before),
                lambda: counted))

        return finite, ops.logical_or(ops.logical_not(finite), due), update

    def _host_scheduled(self, tally: Callable[[], device.Packed], dense: list[Any], ids: Any, seen: Any,
                        loss_bad: Any, state: LossScaleState, unscaled: bool) -> tuple[Any, None, Any]:
        """JAX's fit (:meth:`traced` under ``host_schedule``): one reduction per gradient tells finite, Inf
        and NaN apart, a skipped step is counted without a branch (a few ops on ``L`` values) and the
        sample is in the trace only when ``sampling`` held while tracing: no ``cond`` holds the gradients."""
        assert self.layout is not None
        codes = device.bad_codes(dense)
        flags = device.layer_flags(ops.minimum(codes, 1.0), ids, len(self.layout.layers))
        finite = ops.equal(ops.sum(flags), 0.0)
        nan = ops.equal(ops.max(codes), 2.0)
        sampling = self.sampling

        def update() -> device.Packed:
            before = tally()
            folded = device.join(device.fold_skip(self.split(before), flags, loss_bad, nan), before)
            counted = device.Packed(*(ops.where(finite, b, f) for b, f in zip(before, folded, strict=True)))
            if not sampling:
                return counted
            factor = state.scale if unscaled else ops.ones((), "float32")
            taken = device.sample(self.split(counted), dense, ids, seen, factor, state.scale)
            return device.join(taken, before)

        return finite, None, update

    def host_due(self, steps: int) -> bool:
        """Whether one of the next ``steps`` steps takes the headroom sample, on the host's count (torch's
        step and JAX's fit count here); counts them."""
        first, self._host_steps = self._host_steps, self._host_steps + steps
        return sampled_within(first, steps, self.every)

    def eager(self, grads: Sequence[Any], variables: Sequence[Any], skipped: bool,
              loss_bad: Callable[[], Any], scale: Any, unscaled: bool) -> None:
        """torch: count a step whose skip the host already knows; sample on the host's schedule."""
        due = self.host_due(1)
        if not (skipped or due):  # an ordinary step: nothing to count, not even a pass over the grads
            return
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        if not pairs:
            return
        dense = [g for g, _ in pairs]
        ids, seen = self._constants([v for _, v in pairs])
        before = self.values()
        tally = self.split(before)
        if skipped:
            assert self.layout is not None
            flags = device.layer_flags(device.bad_flags(dense), ids, len(self.layout.layers))
            tally = device.fold_skip(tally, flags, loss_bad(), device.any_nan(dense))
        if due:
            factor = scale if unscaled else ops.ones((), "float32")
            tally = device.sample(tally, dense, ids, seen, factor, scale)
        self.assign(device.join(tally, before))

    # ---------------------------------------------------------------------------- reading

    def read(self, state: LossScaleState) -> IntervalForensics | None:
        """The interval's forensics at the step and scale of ``state`` (host values), and a fresh interval;
        ``None`` when off. One host read (the packed tally): call it at the log interval."""
        if not self.active:
            return None
        assert self.layout is not None and self.variables is not None
        layers = self.layout.layers
        host = np.asarray(ops.convert_to_numpy(device.pack(self.values())))
        tally = device.unpack(host, len(layers), len(self.layout.sizes))
        headroom: tuple[LayerHeadroom, ...] = ()
        histogram = headroom_scale = None
        if tally.sampled[0]:
            totals = self.layout.layer_sizes(tally.sample_seen)
            headroom = tuple(LayerHeadroom(name, float(tally.sample_max[i]), int(tally.sample_under[i]),
                                           totals[name]) for i, name in enumerate(layers) if name in totals)
            histogram = tuple(int(c) for c in tally.histogram)
            headroom_scale = float(tally.sample_scale[0])
        counts = host[:self.variables.counts.shape[0]].astype(self.variables.counts.dtype)
        counts[:device.reset_length(len(layers))] = 0  # the sample stays until the next one replaces it
        self.variables.counts.assign(counts)

        def per_layer(counts: np.ndarray) -> dict[str, int]:
            return {name: int(c) for name, c in zip(layers, counts, strict=True) if c}

        return IntervalForensics(
            step=int(state.steps), scale=float(state.scale),
            causes=dict(zip(CAUSES, map(int, tally.causes), strict=True)),
            layer_skips=per_layer(tally.layer_skips), layer_origins=per_layer(tally.origins),
            layer_order=layers, headroom=headroom, histogram=histogram, headroom_scale=headroom_scale)

