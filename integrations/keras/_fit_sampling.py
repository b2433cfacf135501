"""``fit`` with the sampled parts decided on the host: JAX's float16 headroom sample, and the forward trace
on TensorFlow and JAX.

A jitted step that could take the headroom sample holds the gradients in a ``lax.cond`` for it, which costs
XLA a few percent of every step although the sample is one step in ``headroom_every``; a step that could
trace its forward pass carries the due check and two ``cond``s (7 % of a small model's step). So while
:class:`~lossscale_callbacks.keras.LossScaleCallback` drives ``fit``, the host counts the steps
(``ForensicsWiring.host_due``, ``ForwardTrace.host_due``) and ``fit`` runs one of a few train functions:
the ordinary one, whose trace has neither in it, and others, each traced with the sample or the forward
trace (scheduled, or armed by a loss that turned non-finite) in it, made when first needed. No host read
either way: the loss that arms the trace is the one Keras has read back for the batch-end callbacks.
The host's schedule holds only while one of these functions runs (so while it traces): a custom loop, a
``train_on_batch`` or a ``fit`` cut short by an exception keep the device's own schedule.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import keras

__all__ = ["FitSampling"]


def _with_flags(function: Callable[..., Any], wiring: Any, trace: Any,
                key: tuple[bool, float]) -> Callable[..., Any]:
    """``function`` run under the host's schedule, with the forensics' ``sampling`` and the trace's
    ``recording``/``kind`` set as ``key`` says (so while it traces); everything restored after."""
    sample, kind = key
    nothing = contextlib.nullcontext()

    def flagged(*args: Any, **kwargs: Any) -> Any:
        with (wiring.host_scheduled(sample) if wiring is not None else nothing), \
                (trace.host_scheduled(kind) if trace is not None else nothing):
            return function(*args, **kwargs)

    return flagged


def _second_train_function(model: Any) -> Any:
    """Another train function of ``model``, with a trace cache of its own: ``jax.jit`` keys its traces on
    the function it compiles, so it compiles a function of its own here, not the bound ``train_step``."""
    ordinary = model.train_function
    own = model.__dict__.get("train_step")  # a user's instance-level train_step, kept and used
    step = own if own is not None else functools.partial(type(model).train_step, model)

    if keras.backend.backend() == "jax":
        def train_step(state: Any, data: Any) -> Any:
            return step(state, data)
    else:  # TensorFlow's tf.function is a new one at each make_train_function: this keeps the signature
        def train_step(data: Any) -> Any:
            return step(data)

    model.train_step = train_step  # what make_train_function compiles, for this one call
    try:
        model.make_train_function(force=True)
        return model.train_function
    finally:
        if own is not None:
            model.train_step = own
        else:
            del model.train_step
        model.train_function = ordinary


class FitSampling:
    """The train functions of one model's ``fit`` and the choice between them, batch by batch."""

    def __init__(self) -> None:
        self._wiring: Any = None
        self._trace: Any = None
        self._ordinary: Any = None
        self._variants: dict[tuple[bool, float], Any] = {}
        self._armed = False
        self._loss_finite = True

    @property
    def active(self) -> bool:
        """Whether a ``fit`` is being driven (JAX with forensics, or the forward trace on TF or JAX)."""
        return self._wiring is not None or self._trace is not None

    def begin(self, optimizer: Any, model: Any) -> None:
        """At ``on_train_begin`` of a ``fit``: drive the samples from the host where a compiled step would
        carry them. Not with ``steps_per_execution > 1`` for the trace (one execution runs several steps,
        which the device schedules), nor under several TensorFlow replicas (nothing is traced there)."""
        backend = keras.backend.backend()
        self._wiring = optimizer.forensics if backend == "jax" else None
        trace = optimizer.forward_trace if backend in ("tensorflow", "jax") else None
        several_steps = int(getattr(model, "steps_per_execution", 1) or 1) > 1
        strategy = getattr(model, "distribute_strategy", None) if backend == "tensorflow" else None
        replicas = int(getattr(strategy, "num_replicas_in_sync", 1) or 1)
        self._trace = None if several_steps or replicas > 1 else trace
        self._armed, self._loss_finite = False, True

    def before_batch(self, model: Any) -> None:
        """At ``on_train_batch_begin``: the train function for the next execution of the step."""
        if not self.active:
            return
        current = model.train_function
        known = current is self._ordinary or current in self._variants.values()
        if self._ordinary is None or not known:
            self._ordinary, self._variants = current, {}  # made afresh (a new optimizer or diagnose setting)
        steps = int(getattr(model, "steps_per_execution", 1) or 1)
        sample = self._wiring.host_due(steps) if self._wiring is not None else False
        kind = 0.0
        if self._trace is not None:
            due = self._trace.host_due(steps)
            kind, self._armed = (2.0 if self._armed else 1.0 if due else 0.0), False
        key = (sample, kind)
        if key not in self._variants:
            if key == (False, 0.0):
                made = self._ordinary
            else:
                # On JAX, fit keeps the variables in its own state during an epoch; making a train function
                # reads them (a distribution's sharding), so they are synced back first (once per function).
                sync = getattr(model, "jax_state_sync", None)
                if keras.backend.backend() == "jax" and callable(sync):
                    sync()
                model.train_function = self._ordinary
                made = _second_train_function(model)
            self._variants[key] = _with_flags(made, self._wiring, self._trace, key)
        model.train_function = self._variants[key]

    def after_batch(self, logs: dict[str, Any] | None) -> None:
        """At ``on_train_batch_end``: a loss that turned non-finite arms a trace of the next step. Keras'
        ``loss`` is the epoch's running mean: it turns once and stays until the epoch ends, so this arms once
        per epoch (the scheduled traces name an overflow that persists)."""
        if self._trace is None or not logs or "loss" not in logs:
            return
        try:
            finite = math.isfinite(float(logs["loss"]))
        except (TypeError, ValueError):
            return
        self._armed = self._armed or (self._loss_finite and not finite)
        self._loss_finite = finite

    def new_epoch(self) -> None:
        """At ``on_epoch_begin``: Keras starts the running mean of the loss afresh."""
        self._loss_finite = True

    def end(self, model: Any) -> None:
        """At ``on_train_end``: the ordinary train function back (Keras' own, outside the host's schedule)."""
        if self.active and self._ordinary is not None:
            model.train_function = self._ordinary
        self._wiring = self._trace = None
