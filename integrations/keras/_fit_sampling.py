"""JAX's ``fit`` with overflow forensics: the float16 headroom sample decided on the host.

A jitted step that could take the sample holds the gradients in a ``lax.cond`` for it, which costs
XLA a few percent of every step although the sample is one step in ``headroom_every``. So while
:class:`~lossscale_callbacks.keras.LossScaleCallback` drives ``fit`` on JAX, the forensics count the
steps on the host (:meth:`~lossscale_callbacks.keras._forensics_wiring.ForensicsWiring.host_due`) and
``fit`` runs one of two train functions: the ordinary one, whose trace has no sample in it, and a
second one, traced with the sample in it, on the steps due for one. No host read either way.

Example:
    >>> sampling = FitSampling()
    >>> sampling.active
    False
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras


def _while_sampling(function: Callable[..., Any], wiring: Any) -> Callable[..., Any]:
    """``function`` with the forensics' ``sampling`` on while it runs (so while it traces)."""

    def sampled(*args: Any, **kwargs: Any) -> Any:
        wiring.sampling = True
        try:
            return function(*args, **kwargs)
        finally:
            wiring.sampling = False

    return sampled


def _second_train_function(model: Any) -> Any:
    """A second train function of ``model``, with a trace cache of its own: ``jax.jit`` keys its traces on
    the function it compiles, so it compiles a function of its own here, not the bound ``train_step``."""
    ordinary = model.train_function

    def train_step(state: Any, data: Any) -> Any:
        return type(model).train_step(model, state, data)

    model.train_step = train_step  # what make_train_function compiles, for this one call
    try:
        model.make_train_function(force=True)
        return model.train_function
    finally:
        del model.train_step
        model.train_function = ordinary


class FitSampling:
    """The two train functions of one model's ``fit`` and the choice between them, batch by batch."""

    def __init__(self) -> None:
        self._wiring: Any = None
        self._ordinary: Any = None
        self._sampled: Any = None

    @property
    def active(self) -> bool:
        """Whether a ``fit`` on JAX with forensics is being driven."""
        return self._wiring is not None

    def begin(self, optimizer: Any) -> None:
        """At ``on_train_begin``: drive the samples from the host when on JAX with forensics on."""
        wiring = optimizer.forensics
        self._wiring = wiring if keras.backend.backend() == "jax" else None
        if self._wiring is not None:
            self._wiring.host_schedule = True

    def before_batch(self, model: Any) -> None:
        """At ``on_train_batch_begin``: the train function for the next execution of the step."""
        wiring = self._wiring
        if wiring is None:
            return
        if self._ordinary is None or model.train_function not in (self._ordinary, self._sampled):
            self._ordinary = model.train_function  # made afresh (a new optimizer or diagnose setting)
            self._sampled = _while_sampling(_second_train_function(model), wiring)
        steps = int(getattr(model, "steps_per_execution", 1) or 1)
        model.train_function = self._sampled if wiring.host_due(steps) else self._ordinary

    def end(self, model: Any) -> None:
        """At ``on_train_end``: the ordinary train function back, and the device's own schedule."""
        if self._wiring is not None:
            model.train_function = self._ordinary
            self._wiring.host_schedule = False
        self._wiring = None
