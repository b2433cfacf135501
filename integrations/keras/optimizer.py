"""A Keras 3 ``LossScaleOptimizer`` whose loss scale moves by the core's one update rule.

It subclasses ``keras.optimizers.LossScaleOptimizer`` only so that Keras treats it as a loss
scale optimizer everywhere (``compile()`` under ``mixed_float16`` does not wrap it a second
time, ``MultiOptimizer`` refuses it, the TensorBoard callback finds ``inner_optimizer``); all
of the loss-scaling behaviour is its own, built on :mod:`lossscale_callbacks.update`.

It runs on every Keras 3 backend. TensorFlow: the rule in TensorFlow ops, the skip a ``tf.cond``
inside the traced step, the overflow flag reduced across ``tf.distribute`` replicas. JAX: the
rule in ``keras.ops`` inside Keras' jitted ``stateless_apply``, the skip a ``lax.cond`` (under
``keras.distribution`` the gradients are global arrays, so every device decides alike). torch:
the rule in ``keras.ops`` on the device, the skip a Python branch on the flag, one host read per
step, as in Keras' own ``LossScaleOptimizer`` (torch has no traced conditional for Keras' step).
TensorFlow is imported only on its backend.
"""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks._validation import check_int, check_number, validate_state
from lossscale_callbacks.forensics import check_diagnose
from lossscale_callbacks.keras import keras_ops
from lossscale_callbacks.policy import DynamicPolicy, FixedPolicy, Policy, check_policy, policy_from_config
from lossscale_callbacks.state import STATE_FIELDS, LossScaleState
from lossscale_callbacks.update import next_state

_BACKEND = keras.backend.backend()
if _BACKEND == "tensorflow":
    import tensorflow as tf

    from lossscale_callbacks.keras import tf_ops
else:  # JAX or torch: no TensorFlow needed
    tf = None
    tf_ops = None

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_DIAGNOSE_TF_ONLY = ("diagnose (overflow forensics) is built for the TensorFlow backend of Keras for now, "
                     f"got KERAS_BACKEND={_BACKEND!r}; pass diagnose=False (loss scaling itself runs on "
                     "every backend)")
_DEFAULT_INITIAL_SCALE = 2.0**15
_DEFAULT_GROWTH_STEPS = 2000
# Keras 3 releases up to 3.3 wrote these base-optimizer settings into every LossScaleOptimizer
# config; a saved model still carries them (at these values), so they are accepted and ignored.
_BASE_OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
_EMA_SETTINGS = ("use_ema", "ema_momentum", "ema_overwrite_frequency")
# Set on an inner optimizer once a LossScaleOptimizer wraps it (tf.keras' attribute name).
_WRAPPED_MARK = "_is_wrapped_by_loss_scale_optimizer"

# Constructor arguments of every Keras optimizer that are settings of the optimizer as a
# whole, not coefficients of its update rule; they are never delegated (see
# ``_delegated_hyperparameters``).
_NOT_HYPERPARAMETERS = frozenset({
    "self", "name", "learning_rate", "weight_decay", "clipnorm", "clipvalue", "global_clipnorm",
    "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
    "gradient_accumulation_steps", "kwargs",
})


def _delegated_hyperparameters(inner: keras.optimizers.Optimizer) -> frozenset[str]:
    """The names ``LossScaleOptimizer`` reads and writes on its inner optimizer.

    Keras 3 has no ``_set_hyper``; the seed's rule ("``beta_1`` is a hyperparameter,
    ``epsilon`` is not") is reproduced as: a numeric (non-bool) constructor argument of
    the inner optimizer's class that is a coefficient of its update rule. Numerical
    stability constants (``epsilon`` and the like) and the base optimizer's settings
    (clipping, EMA, weight decay, ...) are not delegated; ``learning_rate`` has its own
    property.
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


class LossScaleOptimizerArgumentError(ValueError, TypeError):
    """A bad argument to :class:`LossScaleOptimizer`.

    Both a ``ValueError`` (this project's convention, and Keras 3's) and a ``TypeError`` (what
    tf.keras raises for a non-bool ``dynamic``, a nested or a non-optimizer ``inner_optimizer``),
    so code written against either catches it.
    """


def resolve_policy(dynamic: bool = True, initial_scale: float | None = None,
                   dynamic_growth_steps: int | None = None, policy: Policy | None = None) -> Policy:
    """The core policy behind the seed's ``dynamic``/``initial_scale``/``dynamic_growth_steps``.

    ``dynamic_growth_steps`` may be an integral float (``2.0``), as tf.keras accepts.

    Raises:
        LossScaleOptimizerArgumentError: for the combinations the seed forbids (a fixed scale
            without ``initial_scale``, ``dynamic_growth_steps`` with ``dynamic=False``), a non-bool
            ``dynamic``, ``policy`` together with the seed arguments, an ``initial_scale`` that is
            not a positive finite number or a ``dynamic_growth_steps`` that is not an integer >= 1
            (each message names the argument).
    """
    if not isinstance(dynamic, bool):
        # tf.keras' wording: a float or string here usually meant LossScaleOptimizerV1's loss_scale.
        raise LossScaleOptimizerArgumentError(
            f'"dynamic" argument to LossScaleOptimizer.__init__ must be a bool, but got: {dynamic!r} '
            "(pass initial_scale and dynamic_growth_steps by keyword)")
    try:
        if dynamic_growth_steps is not None:
            dynamic_growth_steps = check_int("dynamic_growth_steps", dynamic_growth_steps, 1, 2**31 - 1,
                                             allow_integral_float=True)
        if initial_scale is not None:
            initial_scale = check_number("initial_scale", initial_scale, 0.0, math.inf, low_open=True)
        check_policy("policy", policy)
    except ValueError as exc:
        raise LossScaleOptimizerArgumentError(str(exc)) from None
    if policy is not None:
        if initial_scale is not None or dynamic_growth_steps is not None:
            raise LossScaleOptimizerArgumentError(
                "pass either policy or initial_scale/dynamic_growth_steps, not both; got "
                f"policy={policy!r}, initial_scale={initial_scale!r}, "
                f"dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        if not dynamic and policy.dynamic:
            raise LossScaleOptimizerArgumentError(
                f"dynamic=False contradicts policy={policy!r}; pass a FixedPolicy instead")
        return policy
    if dynamic:
        return DynamicPolicy(
            initial_scale=_DEFAULT_INITIAL_SCALE if initial_scale is None else initial_scale,
            growth_interval=_DEFAULT_GROWTH_STEPS if dynamic_growth_steps is None else dynamic_growth_steps,
        )
    if initial_scale is None:
        raise LossScaleOptimizerArgumentError(
            '"initial_scale" must be specified if "dynamic" is False (it is the fixed loss scale); or leave '
            "loss scaling to the inner optimizer: set `loss_scale_factor` on it instead")
    if dynamic_growth_steps is not None:
        raise LossScaleOptimizerArgumentError(
            f'"dynamic_growth_steps" must be None if "dynamic" is False, but got: {dynamic_growth_steps}')
    return FixedPolicy(initial_scale)


_NO_MARK = object()


def _current_context() -> Any:
    """Where code runs now: ``None`` when eager, else (a weak reference to) the graph being traced.

    Only TensorFlow traces graphs that an eager call could leak into; elsewhere ``None``.
    """
    if tf is None or tf.executing_eagerly():
        return None
    return weakref.ref(tf.compat.v1.get_default_graph())


def _gradients_of_callable(fn: Any, variables: list[Any]) -> list[Any]:
    """Gradients of ``fn()`` (a scalar) with respect to Keras ``variables``, on JAX or torch."""
    if _BACKEND == "jax":
        import jax

        def of_values(values: list[Any]) -> Any:
            with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
                return fn()

        return list(jax.grad(of_values)([v.value for v in variables]))
    if _BACKEND == "torch":
        import torch

        values = [v.value for v in variables]
        return list(torch.autograd.grad(fn(), values, allow_unused=True))
    raise ValueError(f"minimize() is not supported on the {_BACKEND!r} Keras backend; compute the gradients "
                     "of get_scaled_loss(loss) yourself and call apply_gradients()")


def _unscale(grad: Any, scale: Any) -> Any:
    return tf_ops.unscale(grad, scale) if tf is not None else keras_ops.unscale(grad, scale)


def _check_base_optimizer_kwargs(kwargs: dict[str, Any]) -> None:
    """Keras 3's rule: base-optimizer arguments only at their defaults (old configs carry them)."""
    for name, default in _BASE_OPTIMIZER_DEFAULTS.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value != default or (default is None and value is not None):
            raise LossScaleOptimizerArgumentError(
                f"LossScaleOptimizer does not support `{name}`. Instead, set `{name}` on the "
                "`inner_optimizer`.")
    if kwargs:
        raise LossScaleOptimizerArgumentError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. It takes "
            "inner_optimizer, dynamic, initial_scale, dynamic_growth_steps, policy and name; settings of "
            "the update (learning rate, clipping, EMA, weight decay...) belong on the `inner_optimizer`.")


@keras.saving.register_keras_serializable(package="lossscale_callbacks")
class LossScaleOptimizer(_KerasLossScaleOptimizer):
    """Dynamic (or fixed) loss scaling around any Keras 3 optimizer, on the shared core.

    Works in ``model.compile(optimizer=...)``/``fit()`` (Keras calls :meth:`scale_loss`
    and passes the *scaled* gradients to :meth:`apply_gradients`) and in custom loops,
    either the seed's way (:meth:`get_scaled_loss`, :meth:`get_unscaled_gradients`, then
    :meth:`apply_gradients`) or with :meth:`minimize`. :meth:`apply_gradients` takes *scaled*
    gradients and unscales them itself (Keras 3), unless :meth:`get_unscaled_gradients` was
    called since the last apply in this thread (tf.keras): then it takes them as unscaled.

    Every step checks all gradients for Inf/NaN (reduced across replicas under
    ``tf.distribute``, so every replica decides alike), applies the inner optimizer only
    when they are finite (a ``tf.cond``: a skipped step leaves every trainable variable and
    every variable of the inner optimizer bit-identical; state that the forward pass itself
    updates, such as BatchNormalization's moving statistics, still moves, as with any loss
    scaler), and moves the loss scale with the core's ``next_state``. No host
    synchronisation happens in the step inside ``tf.function``;
    :meth:`read_state` is the one host read, for callbacks at their log interval.

    ``iterations`` is the inner optimizer's counter, so it counts *applied* steps only
    (as in Keras and tf.keras): a skipped step does not advance it, nor a
    ``LearningRateSchedule`` driven by it. The number of attempted steps, skipped ones
    included, is ``state.steps`` (the metrics' step axis).

    The state (scale float32, growth counter, hysteresis left, skipped steps, steps;
    counters int64) lives in non-trainable Keras variables of this optimizer, so
    ``model.save()``/``keras.models.load_model()``, ``model.save_weights()``,
    ``tf.train.Checkpoint`` and ``keras.callbacks.BackupAndRestore`` restore it. As for any
    Keras 3 optimizer, ``load_weights()`` restores it only once it is built
    (``optimizer.build(model.trainable_variables)``); Keras skips it with a warning otherwise.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap (not a loss scale
            optimizer itself, and with ``loss_scale_factor=None``).
        dynamic: the seed's switch: dynamic scaling (True) or a fixed ``initial_scale``.
        initial_scale: first loss scale; defaults to ``2**15`` when dynamic, and is
            required (the fixed scale) when ``dynamic=False``.
        dynamic_growth_steps: finite steps between growths (default 2000); only with
            ``dynamic=True``.
        policy: any core policy (hysteresis, min/max scale, factors) instead of the three
            seed arguments.
        name: the optimizer's name.
        diagnose: overflow forensics (TensorFlow backend; see :mod:`lossscale_callbacks.forensics`):
            ``True`` records on the device why each skipped step was skipped and which layers'
            gradients were non-finite, and samples the float16 headroom every ``headroom_every``
            steps; ``"every_step"`` samples every step. Read with :meth:`read_forensics`;
            :meth:`watch` names the layers by the model's layer objects. Not in the config.
        headroom_every: steps between headroom samples.

    Example:
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.25))
        >>> var = keras.Variable(1.0)
        >>> _ = opt.minimize(lambda: var**2, var_list=var)
        >>> float(keras.ops.convert_to_numpy(var))
        0.5
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        policy: Policy | None = None,
        name: str | None = None,
        *,
        diagnose: bool | str = False,
        headroom_every: int = 1000,
        **kwargs: Any,
    ) -> None:
        check_diagnose(diagnose)
        check_int("headroom_every", headroom_every)
        if diagnose and tf is None:
            raise ValueError(_DIAGNOSE_TF_ONLY)
        if isinstance(inner_optimizer, _KerasLossScaleOptimizer):
            raise LossScaleOptimizerArgumentError(
                f"LossScaleOptimizer cannot wrap another LossScaleOptimizer, but got: {inner_optimizer!r}")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise LossScaleOptimizerArgumentError(
                '"inner_optimizer" must be an instance of `keras.optimizers.Optimizer`, but got: '
                f"{inner_optimizer!r}")
        replacing = kwargs.pop("_replacing", False)
        _check_base_optimizer_kwargs(dict(kwargs))
        resolved = resolve_policy(dynamic, initial_scale, dynamic_growth_steps, policy)
        if getattr(inner_optimizer, _WRAPPED_MARK, False) and not replacing:
            # Both would step and checkpoint the same slots.
            raise LossScaleOptimizerArgumentError(
                '"inner_optimizer" is already wrapped by a LossScaleOptimizer. An optimizer can only be '
                "wrapped by a single LossScaleOptimizer")
        # Keras' LossScaleOptimizer.__init__ only stores initial_scale/dynamic_growth_steps,
        # which are properties of the policy here; go straight to the base optimizer.
        super(_KerasLossScaleOptimizer, self).__init__(learning_rate=0.0, name=name)
        self._policy = resolved
        self._delegated = _delegated_hyperparameters(inner_optimizer)
        self._unscaled_marks = threading.local()
        self.inner_optimizer = inner_optimizer
        # As Keras does: the inner optimizer must not scale the loss a second time.
        inner_optimizer.loss_scale_factor = None
        object.__setattr__(inner_optimizer, _WRAPPED_MARK, True)
        constants = resolved.constants
        # "only_first_replica": every replica computes the same new state (the finite flag
        # is all-reduced first), so any replica's value is the right one to keep.
        # int64 counters, int32 on JAX without x64 (see keras_ops.counter_dtype).
        counter = "int64" if tf is not None else keras_ops.counter_dtype()
        self._ls_scale = self._state_variable("loss_scale", "float32", resolved.initial_scale)
        self._ls_growth_counter = self._state_variable("growth_counter", counter, 0)
        self._ls_hysteresis_left = self._state_variable("hysteresis_left", counter, constants.hysteresis)
        self._ls_skipped_steps = self._state_variable("skipped_steps", counter, 0)
        self._ls_steps = self._state_variable("steps", counter, 0)
        # Overflow forensics: settings here, variables at build (outside Keras' tracking, so a saved
        # model does not depend on them).
        self.__dict__["_diagnose"] = (diagnose, headroom_every)
        self.__dict__["_forensics"] = None
        self.__dict__["_forensics_model"] = None

    def _state_variable(self, name: str, dtype: str, value: float) -> keras.Variable:
        return self.add_variable(shape=(), dtype=dtype, initializer=keras.initializers.Constant(value),
                                 aggregation="only_first_replica", name=name)

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
        if inner is None or self.__dict__.get("_building_own_variables"):
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

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """The inner optimizer's: with ``use_ema=True`` it writes the moving averages into the model."""
        self.inner_optimizer.finalize_variable_values(var_list)

    # ---- the seed's read-only API ----

    @property
    def policy(self) -> Policy:
        """The core policy this optimizer runs."""
        return self._policy

    @property
    def dynamic(self) -> bool:
        return self._policy.dynamic

    @property
    def initial_scale(self) -> float:
        return self._policy.initial_scale

    @property
    def dynamic_growth_steps(self) -> int | None:
        return self._policy.growth_interval if self._policy.dynamic else None

    @property
    def dynamic_counter(self) -> keras.Variable | None:
        """Consecutive finite steps since the last growth or overflow (None when fixed)."""
        return self._ls_growth_counter if self._policy.dynamic else None

    @property
    def loss_scale(self) -> Any:
        """The current loss scale, a float32 scalar tensor (not the variable)."""
        if tf is not None:
            return tf.convert_to_tensor(self._ls_scale.value)
        return ops.convert_to_tensor(self._ls_scale.value)

    # Names of Keras' own LossScaleOptimizer, for code written against it.
    @property
    def dynamic_scale(self) -> keras.Variable:
        return self._ls_scale

    @property
    def step_counter(self) -> keras.Variable:
        return self._ls_growth_counter

    @property
    def state_variables(self) -> LossScaleState:
        """The five state variables (on the device), as a :class:`LossScaleState`."""
        return LossScaleState(self._ls_scale, self._ls_growth_counter, self._ls_hysteresis_left,
                              self._ls_skipped_steps, self._ls_steps)

    @property
    def state(self) -> LossScaleState:
        """The current state as tensors (no host read)."""
        return LossScaleState(*(v.value for v in self.state_variables))

    def read_state(self) -> LossScaleState:
        """Copy the state to the host: numpy scalars. **This is a host synchronisation**.

        Call it at a log interval, never per step.
        """
        # Variable.numpy() on every backend (also a tf.distribute MirroredVariable's).
        values = [np.asarray(v.numpy()) for v in self.state_variables]
        return LossScaleState(*values)

    def assign_state(self, state: LossScaleState | dict[str, Any]) -> None:
        """Overwrite (some of) the state; fields missing from a dict keep their value. All or nothing.

        The merged state is checked against the policy first (finite scale inside its bounds,
        non-negative integer counters, ``skipped_steps <= steps``): a ``ValueError`` names the
        field and nothing is assigned. Reads the current state once (a host sync) when a dict
        leaves fields out.
        """
        fields = state._asdict() if isinstance(state, LossScaleState) else dict(state)
        unknown = sorted(set(fields) - set(STATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown state field(s) {unknown}; allowed: {list(STATE_FIELDS)}")
        current = {} if len(fields) == len(STATE_FIELDS) else self.read_state()._asdict()
        checked = validate_state(self._policy, {**current, **fields}, source="assign_state")
        for value, var in zip(checked, self.state_variables, strict=True):
            var.assign(ops.cast(value, var.dtype))

    # ---- building and loss/gradient scaling ----

    def build(self, var_list: Sequence[Any]) -> None:
        # The inner optimizer may already be built (a compiled optimizer that the callback
        # wraps); building it twice would create a second set of slots.
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self.__dict__["_building_own_variables"] = True
        try:
            super(_KerasLossScaleOptimizer, self).build(var_list)
        finally:
            self.__dict__["_building_own_variables"] = False
        self._build_forensics()

    # ---- overflow forensics (TensorFlow) ----

    @property
    def forensics(self) -> Any:
        """The forensics accumulators (``KerasForensics``); ``None`` with ``diagnose=False`` or unbuilt."""
        return self.__dict__.get("_forensics")

    def set_diagnose(self, diagnose: bool | str, headroom_every: int = 1000) -> None:
        """Switch the overflow forensics on or off (see ``diagnose``); retrace the train function after it."""
        check_diagnose(diagnose)
        check_int("headroom_every", headroom_every)
        if diagnose and tf is None:
            raise ValueError(_DIAGNOSE_TF_ONLY)
        if self.__dict__["_diagnose"] != (diagnose, headroom_every) or (diagnose and self.forensics is None):
            self.__dict__["_diagnose"] = (diagnose, headroom_every)
            self.__dict__["_forensics"] = None
            if self.built:
                self._build_forensics()

    def watch(self, model: Any) -> LossScaleOptimizer:
        """Name the report's layers by the model's layer objects (paths in nested models); returns self."""
        self.__dict__["_forensics_model"] = model
        if self.forensics is not None:
            self.__dict__["_forensics"] = None
            self._build_forensics()
        return self

    def _build_forensics(self) -> None:
        mode, every = self.__dict__.get("_diagnose", (False, 1000))
        if not mode or tf is None or self.forensics is not None:
            return
        from lossscale_callbacks.keras.tf_forensics import KerasForensics, variable_layers

        variables = list(self._trainable_variables)
        names = variable_layers(variables, self.__dict__.get("_forensics_model"))
        sizes = [int(np.prod(v.shape)) for v in variables]
        # Variables made while a tf.function traces the first apply must be made eagerly.
        with tf.init_scope():
            self.__dict__["_forensics"] = KerasForensics(mode, every, names, sizes)

    def read_forensics(self) -> Any:
        """The forensics since the last call as an ``IntervalForensics`` (``None`` when off). Host reads:
        call it at the log interval."""
        forensics = self.forensics
        if forensics is None:
            return None
        state = self.read_state()
        return forensics.read(int(state.steps), float(state.scale))

    def _scaled(self, loss: Any) -> Any:
        loss = ops.convert_to_tensor(loss)
        if self.forensics is not None:
            self.forensics.on_loss(loss)
        dtype = keras.backend.standardize_dtype(loss.dtype)
        if dtype in ("float16", "bfloat16"):
            loss, dtype = ops.cast(loss, "float32"), "float32"
        return ops.multiply(loss, ops.cast(self._ls_scale.value, dtype))

    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (Keras 3's API). Half-precision losses are promoted to float32 first.

        Keras' trainer calls this in every ``train_step`` and then passes *scaled* gradients to
        :meth:`apply_gradients`; so it also forgets any :meth:`get_unscaled_gradients` call of
        this thread that no apply consumed.
        """
        self._unscaled_marks.context = _NO_MARK
        return self._scaled(loss)

    def get_scaled_loss(self, loss: Any) -> Any:
        """The seed (tf.keras) API: ``loss`` times the loss scale; a callable gives a callable."""
        if callable(loss):
            return lambda: self._scaled(loss())
        return self._scaled(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """The seed (tf.keras) API: gradients divided by the loss scale (``None`` stays ``None``).

        The next :meth:`apply_gradients` *in the same context* (the same ``tf.function`` trace,
        or eager code) of this thread then takes its gradients as already unscaled, the tf.keras
        custom-loop contract, also when you clip or otherwise transform them in between. The mark
        never outlives that one apply, is not seen by an apply in another trace (so a stray eager
        call cannot leak into ``fit``'s traced step) and is forgotten by :meth:`scale_loss` (so it
        cannot leak into an eager ``fit`` either). Pass ``unscaled=`` to :meth:`apply_gradients`
        to say it explicitly instead.
        """
        scale = self._ls_scale.value
        self._unscaled_marks.context = _current_context()
        return [_unscale(g, scale) for g in grads]

    def _take_unscaled_mark(self) -> bool:
        mark = getattr(self._unscaled_marks, "context", _NO_MARK)
        self._unscaled_marks.context = _NO_MARK
        return mark is not _NO_MARK and mark == _current_context()

    def check_finite(self, grads: Iterable[Any]) -> Any:
        """A scalar bool tensor: every gradient finite (this replica's only; no host read)."""
        return tf_ops.all_finite(grads) if tf is not None else keras_ops.all_finite(list(grads))

    # ---- applying ----

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], *,
                        unscaled: bool | None = None) -> keras.Variable:
        """Apply (or skip) one step; see :meth:`apply` for ``unscaled``."""
        grads, variables = zip(*grads_and_vars, strict=False)
        self.apply(grads, variables, unscaled=unscaled)
        return self.iterations

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None, *,
              unscaled: bool | None = None) -> None:
        """Check, unscale, apply or skip, and update the loss scale.

        No host read under ``tf.function`` (TensorFlow) or ``jax.jit`` (JAX); on torch the skip
        decision reads the overflow flag once (see the module docstring).

        Args:
            grads: the gradients, *scaled* (Keras 3: ``fit``, or a loop with :meth:`scale_loss`)
                unless ``unscaled``.
            trainable_variables: the variables (required on the first call unless built).
            unscaled: ``True``: the gradients are already divided by the scale (a tf.keras loop
                with :meth:`get_unscaled_gradients`); ``False``: they are scaled; ``None``
                (default): unscaled exactly when :meth:`get_unscaled_gradients` was called in this
                context since the last apply or :meth:`scale_loss`.
        """
        grads = list(grads)
        marked = self._take_unscaled_mark()
        if unscaled is not None and not isinstance(unscaled, bool):
            raise ValueError(f"unscaled must be None, True or False, got {unscaled!r}")
        already_unscaled = marked if unscaled is None else unscaled
        if not grads:
            return
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
        elif not self.built:
            raise ValueError("pass trainable_variables on the first apply(), or build() the optimizer first")
        if tf is None:
            self._apply_keras_backend(grads, trainable_variables, already_unscaled)
            return
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside strategy.run)")

        forensics = self.forensics
        if forensics is None:
            finite = tf_ops.replicas_agree_finite(tf_ops.all_finite(grads))
        else:
            per_grad = tf_ops.finite_flags(grads)
            finite = tf_ops.replicas_agree_finite(tf.reduce_all(per_grad))
            state = self.state
            forensics.on_step(grads, per_grad, finite, state.scale, state.steps, already_unscaled)
        if not already_unscaled:
            grads = self._unscaled_grads(grads, trainable_variables)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._apply_or_skip(finite, grads, trainable_variables)
        else:
            # MirroredStrategy/MultiWorkerMirroredStrategy (outside XLA-on-GPU) need the
            # cond in cross-replica context: the inner optimizer's update calls merge_call,
            # which a cond branch in replica context may not.
            tf.distribute.get_replica_context().merge_call(
                self._apply_or_skip_cross_replica, args=(finite, grads, trainable_variables))

    def _unscaled_grads(self, grads: list[Any], variables: list[Any] | None) -> list[Any]:
        scale = self._ls_scale.value
        variables = variables or self._trainable_variables
        return [g if getattr(v, "overwrite_with_gradient", False) else _unscale(g, scale)
                for g, v in zip(grads, variables, strict=False)]

    def _apply_or_skip(self, finite: Any, grads: list[Any], variables: list[Any] | None) -> None:
        def apply_inner() -> Any:
            self.inner_optimizer.apply(grads, variables)
            return tf.constant(True)

        tf.cond(finite, apply_inner, lambda: tf.constant(False))
        self._update_state(finite)

    def _apply_or_skip_cross_replica(self, distribution: Any, finite: Any, grads: Any,
                                     variables: Any) -> None:
        # Every replica holds the same (all-reduced) flag; take the first.
        finite = distribution.experimental_local_results(finite)[0]

        def apply_inner() -> Any:
            distribution.extended.call_for_each_replica(self.inner_optimizer.apply, args=(grads, variables))
            return tf.constant(True)

        tf.cond(finite, apply_inner, lambda: tf.constant(False))
        self._update_state(finite)

    def _rule_ops(self) -> Any:
        """The ops the core's rule runs with: TensorFlow's, torch's own (5x fewer Python calls than
        ``keras.ops`` per step, the same bits), or ``keras.ops`` (JAX, traced once)."""
        if tf is not None:
            return tf_ops.TF_OPS
        if _BACKEND == "torch":
            cached = self.__dict__.get("_torch_ops")
            device = self._ls_scale.value.device
            if cached is None or cached.device != device:
                from lossscale_callbacks.torch.ops import TorchOps

                cached = self.__dict__["_torch_ops"] = TorchOps(device)
            return cached
        return keras_ops.KERAS_OPS

    def _update_state(self, finite: Any) -> None:
        # The core's rule, traced with the backend's ops: no growth/backoff logic lives here.
        new = next_state(self._policy, self.state, finite, self._rule_ops())
        for var, value in zip(self.state_variables, new, strict=False):
            var.assign(value)

    def _apply_keras_backend(self, grads: list[Any], variables: list[Any] | None,
                             already_unscaled: bool) -> None:
        """JAX and torch, stateful (a custom loop, or Keras' torch trainer)."""
        if _BACKEND == "jax":
            # One code path for JAX: the stateless step, on the current values, written back.
            variables = variables or self._trainable_variables
            new_trainable, new_optimizer = self._stateless_step(
                [v.value for v in self.variables], grads, [v.value for v in variables], already_unscaled)
            for var, value in zip(variables, new_trainable, strict=True):
                var.assign(value)
            for var, value in zip(self.variables, new_optimizer, strict=True):
                var.assign(value)
            return
        variables = variables or self._trainable_variables
        keep = range(len(grads)) if already_unscaled else [
            i for i, v in enumerate(variables) if getattr(v, "overwrite_with_gradient", False)]
        finite, grads = keras_ops.check_and_unscale(grads, self._ls_scale.value, keep)
        # torch: the branch reads the flag (one host sync), as Keras' own LossScaleOptimizer does.
        ops.cond(finite, lambda: self.inner_optimizer.apply(grads, variables), lambda: None)
        self._update_state(finite)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Keras' functional step (what the JAX trainer jits): new trainable and optimizer values.

        The inner optimizer's ``stateless_apply`` runs in a ``lax.cond`` on the overflow flag, so a
        skipped step returns every trainable and optimizer value unchanged; the state moves by the
        core's rule. ``grads`` are *scaled*, as in ``fit``. No host read.
        """
        if tf is not None:
            raise ValueError("stateless_apply is not supported with the TensorFlow backend (tf.distribute "
                             "needs stateful variables); use apply()")
        if not self.built:
            raise ValueError(f"To call `stateless_apply`, {type(self).__name__} must be built: call "
                             "optimizer.build(trainable_variables) first")
        return self._stateless_step(list(optimizer_variables), list(grads), list(trainable_variables),
                                    already_unscaled=self._take_unscaled_mark())

    def _stateless_step(self, optimizer_values: list[Any], grads: list[Any], trainable_values: list[Any],
                        already_unscaled: bool) -> tuple[list[Any], list[Any]]:
        own = self._variables
        if len(optimizer_values) != len(self.variables):
            raise ValueError(f"optimizer_variables: expected {len(self.variables)} values (this optimizer's "
                             f"`variables`), got {len(optimizer_values)}")
        own_values, inner_values = optimizer_values[:len(own)], optimizer_values[len(own):]
        by_variable = {id(v): value for v, value in zip(own, own_values, strict=True)}
        state = LossScaleState(*(by_variable[id(v)] for v in self.state_variables))
        finite = keras_ops.all_finite(grads)
        if not already_unscaled:
            variables = self._trainable_variables
            grads = [g if getattr(v, "overwrite_with_gradient", False) else keras_ops.unscale(g, state.scale)
                     for g, v in zip(grads, variables, strict=False)]

        def apply_inner() -> tuple[list[Any], list[Any]]:
            new = self.inner_optimizer.stateless_apply(inner_values, grads, trainable_values)
            return list(new[0]), list(new[1])

        def skip() -> tuple[list[Any], list[Any]]:
            return list(trainable_values), list(inner_values)

        new_trainable, new_inner = ops.cond(finite, apply_inner, skip)
        new_state = next_state(self._policy, state, finite, keras_ops.KERAS_OPS)
        for var, value in zip(self.state_variables, new_state, strict=True):
            by_variable[id(var)] = ops.cast(value, var.dtype)
        return new_trainable, [by_variable[id(v)] for v in own] + new_inner

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
        if tf is None:
            if not callable(loss):
                raise ValueError(f"loss must be a zero-argument callable on the {_BACKEND} backend (a loss "
                                 "tensor with a tape is TensorFlow's form)")
            grads = _gradients_of_callable(lambda: self.scale_loss(loss()), var_list)
            return self.apply_gradients(zip(grads, var_list, strict=True))
        if callable(loss):
            with tf.GradientTape() as tape:
                scaled = self.scale_loss(loss())
        else:
            if tape is None:
                raise ValueError("tape is required when loss is a tensor rather than a callable")
            with tape:
                scaled = self.scale_loss(loss)
        grads = tape.gradient(scaled, var_list)
        return self.apply_gradients(zip(grads, var_list, strict=False))

    # ---- config ----

    def get_config(self) -> dict[str, Any]:
        """Keras 3's four keys; ``dynamic`` and ``policy`` only when they say more than those.

        A default dynamic policy has exactly the config of Keras' own ``LossScaleOptimizer``, so
        either class can load it.
        """
        config: dict[str, Any] = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }
        if not self.dynamic:
            config["dynamic"] = False
        if self._policy != resolve_policy(self.dynamic, self.initial_scale, self.dynamic_growth_steps):
            config["policy"] = self._policy.to_config()
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
                    ) -> LossScaleOptimizer:
        """Rebuild from :meth:`get_config`, from Keras' own ``LossScaleOptimizer`` config (any Keras 3
        release, whose older configs carry the base optimizer's settings at their defaults) or from
        the configs of earlier releases of this class."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        policy_config = config.pop("policy", None)
        if policy_config is not None:
            # The seed keys are informative copies of the policy.
            for key in ("dynamic", "initial_scale", "dynamic_growth_steps"):
                config.pop(key, None)
            return cls(inner, policy=policy_from_config(policy_config), **config)
        return cls(inner, **config)


def wrap(optimizer: keras.optimizers.Optimizer, policy: Policy | None = None) -> LossScaleOptimizer:
    """Our optimizer around ``optimizer``; Keras' own LossScaleOptimizer is unwrapped and its scale kept.

    Called by :class:`~lossscale_callbacks.keras.LossScaleCallback`; build it inside the
    model's distribution strategy scope.
    """
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    # The callback replaces the previous optimizer in the model, so an inner optimizer that an
    # earlier, discarded LossScaleOptimizer wrapped (a recompiled model) may be wrapped again.
    if not isinstance(optimizer, _KerasLossScaleOptimizer):
        return LossScaleOptimizer(optimizer, policy=policy, _replacing=True)
    keras_lso = optimizer
    if policy is None:
        policy = DynamicPolicy(initial_scale=float(keras_lso.initial_scale),
                               growth_interval=int(keras_lso.dynamic_growth_steps))
    ours = LossScaleOptimizer(keras_lso.inner_optimizer, policy=policy, _replacing=True)
    if not keras_lso.built:
        return ours
    # One host read, once per installation: if Keras' optimizer has trained, carry its running
    # scale and counter over, clipped into the policy's bounds (Keras' scale has neither
    # bound). Untouched, it only holds its initial scale, and the policy's initial scale wins.
    scale = float(keras_lso.dynamic_scale.numpy())
    counter = int(keras_lso.step_counter.numpy())
    applied = int(keras_lso.inner_optimizer.iterations.numpy())
    if applied or counter or scale != float(np.float32(keras_lso.initial_scale)):
        constants = policy.constants
        ours.assign_state({
            "scale": min(max(scale, constants.min_scale), constants.max_scale),
            "growth_counter": min(counter, constants.growth_interval - 1) if policy.dynamic else 0,
            "steps": applied,
        })
    return ours

