"""The tf.keras ("seed") API of the Keras ``LossScaleOptimizer``, apart from its Keras 3 core.

tf.keras users wrote custom loops as ``get_scaled_loss`` → gradients → ``get_unscaled_gradients`` →
``apply_gradients``, read ``dynamic``, ``initial_scale``, ``dynamic_growth_steps``, ``dynamic_counter`` and
``loss_scale``, and set hyperparameters such as ``beta_1`` on the loss scale optimizer itself. Keras 3's
``apply_gradients`` takes *scaled* gradients instead; :class:`PendingUnscales` is how one optimizer
speaks both (see there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

# Constructor arguments of every Keras optimizer that are settings of the optimizer as a whole, not
# coefficients of its update rule; they are never delegated (see ``delegated_hyperparameters``).
_NOT_HYPERPARAMETERS = frozenset({
    "self", "name", "learning_rate", "weight_decay", "clipnorm", "clipvalue", "global_clipnorm",
    "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
    "gradient_accumulation_steps", "kwargs",
})


def delegated_hyperparameters(inner: keras.optimizers.Optimizer) -> frozenset[str]:
    """The names a ``LossScaleOptimizer`` reads and writes on its inner optimizer.

    Keras 3 has no ``_set_hyper``; the seed's rule ("``beta_1`` is a hyperparameter, ``epsilon`` is
    not") is reproduced as: a numeric (non-bool) constructor argument of the inner optimizer's class
    that is a coefficient of its update rule. Numerical stability constants (``epsilon`` and the like)
    and the base optimizer's settings (clipping, EMA, weight decay, ...) are not delegated;
    ``learning_rate`` has its own property.

    Example:
        >>> sorted(delegated_hyperparameters(keras.optimizers.Adam()))
        ['beta_1', 'beta_2']
    """
    names = set()
    for cls in type(inner).__mro__:
        if cls is keras.optimizers.Optimizer or not issubclass(cls, keras.optimizers.Optimizer):
            continue
        names.update(inspect.signature(cls.__init__).parameters)
    delegated = set()
    for name in names - _NOT_HYPERPARAMETERS:
        if "epsilon" in name:
            continue
        value = getattr(inner, name, None)
        if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
            delegated.add(name)
    return frozenset(delegated)


class PendingUnscales:
    """tf.keras' custom-loop contract, held explicitly: ``get_unscaled_gradients`` calls no apply took yet.

    ``get_unscaled_gradients`` notes where it was called: the replica (``tf.distribute`` runs each
    replica's step in a thread of its own) and the trace (a ``tf.function`` graph, or eager). The next
    apply from the same replica takes the note, and takes its gradients as already unscaled only when
    it runs in the same trace; so a stray eager call cannot leak into ``fit``'s traced step, and a note
    never outlives one apply. ``scale_loss`` (a Keras 3 step beginning) drops the replica's note.

    Args:
        call_site: returns ``(replica, trace)`` for the current call (the backend step's ``call_site``).

    Example:
        >>> pending = PendingUnscales(lambda: (None, None))
        >>> pending.note()
        >>> pending.take(), pending.take()
        (True, False)
    """

    def __init__(self, call_site: Callable[[], tuple[Any, Any]]) -> None:
        self._call_site = call_site
        self._notes: dict[Any, Any] = {}

    def note(self) -> None:
        replica, trace = self._call_site()
        self._notes[replica] = trace

    def take(self) -> bool:
        """Whether this apply's gradients were unscaled by ``get_unscaled_gradients``; forgets the note."""
        replica, trace = self._call_site()
        if replica not in self._notes:
            return False
        return self._notes.pop(replica) == trace

    def drop(self) -> None:
        replica, _ = self._call_site()
        self._notes.pop(replica, None)


class SeedAPI:
    """The tf.keras ``LossScaleOptimizer`` API, mixed into our Keras 3 ``LossScaleOptimizer``.

    It relies on the optimizer's ``inner_optimizer``, ``policy``, ``loss_scale_variables``, its backend
    step (``_step``), its :class:`PendingUnscales` (``_pending_unscales``) and its Keras 3 methods.
    """

    # ---- attribute delegation (seed: beta_1 is delegated, epsilon is not) ----

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails.
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None and name in self.__dict__.get("_delegated", ()):
            return getattr(inner, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None and name in self.__dict__.get("_delegated", ()):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    # ---- EMA: the inner optimizer's (it keeps the moving averages) ----

    def _ema_setting(self, name: str, default: Any) -> Any:
        inner = self.__dict__.get("inner_optimizer")
        # While our own base class builds, it must not create a second set of averages.
        if inner is None or self.__dict__.get("_building_base", False):
            return default
        return getattr(inner, name)

    def _set_ema_setting(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:  # before that, the base constructor stores its defaults: nothing to keep
            setattr(inner, name, value)

    use_ema = property(lambda self: self._ema_setting("use_ema", False),
                       lambda self, v: self._set_ema_setting("use_ema", v),
                       doc="The inner optimizer's ``use_ema`` (it keeps the moving averages).")
    ema_momentum = property(lambda self: self._ema_setting("ema_momentum", 0.99),
                            lambda self, v: self._set_ema_setting("ema_momentum", v),
                            doc="The inner optimizer's ``ema_momentum``.")
    ema_overwrite_frequency = property(lambda self: self._ema_setting("ema_overwrite_frequency", None),
                                       lambda self, v: self._set_ema_setting("ema_overwrite_frequency", v),
                                       doc="The inner optimizer's ``ema_overwrite_frequency``.")

    def finalize_variable_values(self, var_list: Any) -> None:
        """The inner optimizer's: with ``use_ema=True`` it writes the moving averages into the model."""
        self.inner_optimizer.finalize_variable_values(var_list)

    # ---- the seed's read-only settings ----

    @property
    def dynamic(self) -> bool:
        """Whether the scale moves (a ``DynamicPolicy``) or stays fixed."""
        return self.policy.dynamic

    @property
    def initial_scale(self) -> float:
        return self.policy.initial_scale

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Finite steps between growths; ``None`` with a fixed scale."""
        return self.policy.growth_interval if self.policy.dynamic else None

    @property
    def dynamic_counter(self) -> keras.Variable | None:
        """Consecutive finite steps since the last growth or overflow (None when fixed)."""
        return self.loss_scale_variables.growth_counter if self.policy.dynamic else None

    @property
    def loss_scale(self) -> Any:
        """The current loss scale, a float32 scalar tensor (not the variable)."""
        return self._step.tensor(self.loss_scale_variables.scale.value)

    # ---- the seed's custom loop ----

    def get_scaled_loss(self, loss: Any) -> Any:
        """``loss`` times the loss scale; a callable gives a callable."""
        if callable(loss):
            return lambda: self._scaled(loss())
        return self._scaled(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Gradients divided by the loss scale (``None`` stays ``None``).

        The next :meth:`apply_gradients` *from the same replica and trace* (the same ``tf.function``
        trace, or eager code) then takes its gradients as already unscaled, the tf.keras custom-loop
        contract, also when you clip or otherwise transform them in between (see :class:`PendingUnscales`).
        Pass ``unscaled=`` to :meth:`apply_gradients` to say it explicitly instead.
        """
        scale = self.loss_scale_variables.scale.value
        self._pending_unscales.note()
        return [self._step.unscale(g, scale) for g in grads]

    def minimize(self, loss: Any, var_list: Any, tape: Any = None) -> keras.Variable:
        """Scale the loss, differentiate, unscale, apply (or skip), and update the scale.

        On every backend with a callable ``loss`` (TensorFlow: ``tf.GradientTape``; torch:
        ``torch.autograd``; JAX: ``jax.grad`` of the loss with the variables as its inputs).

        Args:
            loss: a zero-argument callable returning the loss, or (TensorFlow) a loss tensor
                computed under ``tape``.
            var_list: a variable, a list of variables, or a callable returning them.
            tape: the ``tf.GradientTape`` that recorded a tensor ``loss`` (TensorFlow only).
        """
        if callable(var_list):
            var_list = var_list()
        if not isinstance(var_list, (list, tuple)):
            var_list = [var_list]
        var_list = list(var_list)
        grads = self._step.scaled_gradients(self, loss, var_list, tape)
        return self.apply_gradients(zip(grads, var_list, strict=True))
