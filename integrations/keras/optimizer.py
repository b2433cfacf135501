"""A Keras 3 ``LossScaleOptimizer`` whose loss scale moves by the core's one update rule.

It subclasses ``keras.optimizers.LossScaleOptimizer`` only so that Keras treats it as a loss
scale optimizer everywhere (``compile()`` under ``mixed_float16`` does not wrap it a second
time, ``MultiOptimizer`` refuses it, the TensorBoard callback finds ``inner_optimizer``); all
of the loss-scaling behaviour is its own, built on :mod:`lossscale_callbacks.update`.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from lossscale_callbacks.keras.tf_ops import COUNTER_DTYPE, TF_OPS, all_finite, replicas_agree_finite, unscale
from lossscale_callbacks.policy import DynamicPolicy, FixedPolicy, Policy, policy_from_config, rule_constants
from lossscale_callbacks.state import STATE_FIELDS, LossScaleState
from lossscale_callbacks.update import next_state

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer

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


def resolve_policy(dynamic: bool = True, initial_scale: float | None = None,
                   dynamic_growth_steps: int | None = None, policy: Policy | None = None) -> Policy:
    """The core policy behind the seed's ``dynamic``/``initial_scale``/``dynamic_growth_steps``.

    Raises:
        ValueError: for the combinations the seed forbids (a fixed scale without
            ``initial_scale``, ``dynamic_growth_steps`` with ``dynamic=False``), for
            ``policy`` together with the seed arguments, and for an ``initial_scale`` that is
            not a positive finite number or a ``dynamic_growth_steps`` that is not an integer
            >= 1 (each message names the argument).
    """
    if not isinstance(dynamic, bool):
        raise ValueError(f"dynamic must be True or False, got {dynamic!r}")
    # Checked here, not only by the policy, so the error names the argument the caller passed.
    if dynamic_growth_steps is not None and (
        isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, (int, np.integer))
        or dynamic_growth_steps < 1
    ):
        raise ValueError(f"dynamic_growth_steps (the policy's growth_interval) must be an integer >= 1, "
                         f"got {dynamic_growth_steps!r}")
    if initial_scale is not None and (
        isinstance(initial_scale, bool)
        or not isinstance(initial_scale, (int, float, np.integer, np.floating))
        or not 0.0 < initial_scale < math.inf
    ):
        raise ValueError(f"initial_scale must be a positive finite number, got {initial_scale!r}")
    if policy is not None:
        if not isinstance(policy, (DynamicPolicy, FixedPolicy)):
            raise ValueError(f"policy must be a DynamicPolicy or FixedPolicy, got {type(policy).__name__}")
        if initial_scale is not None or dynamic_growth_steps is not None:
            raise ValueError(
                "pass either policy or initial_scale/dynamic_growth_steps, not both; got "
                f"policy={policy!r}, initial_scale={initial_scale!r}, "
                f"dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        if not dynamic and policy.dynamic:
            raise ValueError(f"dynamic=False contradicts policy={policy!r}; pass a FixedPolicy instead")
        return policy
    if dynamic:
        return DynamicPolicy(
            initial_scale=2.0**15 if initial_scale is None else initial_scale,
            growth_interval=2000 if dynamic_growth_steps is None else dynamic_growth_steps,
        )
    if initial_scale is None:
        raise ValueError("initial_scale must be specified when dynamic=False (it is the fixed loss scale)")
    if dynamic_growth_steps is not None:
        raise ValueError(
            f"dynamic_growth_steps can only be specified when dynamic=True, got "
            f"dynamic_growth_steps={dynamic_growth_steps!r} with dynamic=False"
        )
    return FixedPolicy(initial_scale)


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

    Example:
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.25))
        >>> var = tf.Variable(1.0)
        >>> _ = opt.minimize(lambda: var**2, var_list=var)
        >>> float(var.numpy())
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
    ) -> None:
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                f"lossscale_callbacks.keras needs the TensorFlow backend of Keras 3, got "
                f"KERAS_BACKEND={keras.backend.backend()!r}"
            )
        if isinstance(inner_optimizer, _KerasLossScaleOptimizer) or not isinstance(
            inner_optimizer, keras.optimizers.Optimizer
        ):
            raise ValueError(
                "inner_optimizer must be a keras.optimizers.Optimizer that is not itself a loss scale "
                f"optimizer, got {inner_optimizer!r}"
            )
        if inner_optimizer.loss_scale_factor is not None:
            raise ValueError(
                "inner_optimizer.loss_scale_factor must be None (the loss would be scaled twice), got "
                f"{inner_optimizer.loss_scale_factor!r}"
            )
        resolved = resolve_policy(dynamic, initial_scale, dynamic_growth_steps, policy)
        # Keras' LossScaleOptimizer.__init__ only stores initial_scale/dynamic_growth_steps,
        # which are properties of the policy here; go straight to the base optimizer.
        super(_KerasLossScaleOptimizer, self).__init__(learning_rate=0.0, name=name)
        self._policy = resolved
        self._delegated = _delegated_hyperparameters(inner_optimizer)
        self._user_unscaled = threading.local()
        self.inner_optimizer = inner_optimizer
        constants = rule_constants(resolved)
        # "only_first_replica": every replica computes the same new state (the finite flag
        # is all-reduced first), so any replica's value is the right one to keep.
        self._ls_scale = self._state_variable("loss_scale", "float32", resolved.initial_scale)
        self._ls_growth_counter = self._state_variable("growth_counter", "int64", 0)
        self._ls_hysteresis_left = self._state_variable("hysteresis_left", "int64", constants.hysteresis)
        self._ls_skipped_steps = self._state_variable("skipped_steps", "int64", 0)
        self._ls_steps = self._state_variable("steps", "int64", 0)

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
    def loss_scale(self) -> tf.Tensor:
        """The current loss scale, a float32 scalar tensor."""
        return tf.convert_to_tensor(self._ls_scale.value)

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
        values = [np.asarray(v.numpy()) for v in self.state_variables]
        return LossScaleState(*values)

    def assign_state(self, state: LossScaleState | dict[str, Any]) -> None:
        """Overwrite (some of) the state; fields missing from a dict keep their value."""
        fields = state._asdict() if isinstance(state, LossScaleState) else dict(state)
        unknown = sorted(set(fields) - set(STATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown state field(s) {unknown}; allowed: {list(STATE_FIELDS)}")
        for name, var in zip(STATE_FIELDS, self.state_variables, strict=False):
            if name in fields:
                var.assign(tf.cast(fields[name], tf.float32 if name == "scale" else COUNTER_DTYPE))

    # ---- building and loss/gradient scaling ----

    def build(self, var_list: Sequence[Any]) -> None:
        # The inner optimizer may already be built (a compiled optimizer that the callback
        # wraps); building it twice would create a second set of slots.
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super(_KerasLossScaleOptimizer, self).build(var_list)

    def scale_loss(self, loss: Any) -> tf.Tensor:
        """``loss * scale``. Half-precision losses are promoted to float32 first.

        Keras' TensorFlow trainer calls this inside ``train_step``.
        """
        loss = tf.convert_to_tensor(loss)
        if loss.dtype in (tf.float16, tf.bfloat16):
            loss = tf.cast(loss, tf.float32)
        return loss * tf.cast(self._ls_scale.value, loss.dtype)

    def get_scaled_loss(self, loss: Any) -> Any:
        """The seed API: ``loss`` times the loss scale; a callable gives a callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """The seed API: gradients divided by the loss scale (``None`` stays ``None``).

        Calling it marks the next :meth:`apply_gradients` of this thread as receiving
        already-unscaled gradients (the tf.keras custom-loop contract); otherwise
        ``apply_gradients`` takes scaled gradients and unscales them itself (Keras 3 ``fit``).
        """
        scale = self._ls_scale.value
        self._user_unscaled.pending = True
        return [unscale(g, scale) for g in grads]

    def check_finite(self, grads: Iterable[Any]) -> tf.Tensor:
        return all_finite(grads)

    # ---- applying ----

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> keras.Variable:
        grads, variables = zip(*grads_and_vars, strict=False)
        self.apply(grads, variables)
        return self.iterations

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Check, unscale, apply or skip, and update the loss scale. No host read under tf.function."""
        grads = list(grads)
        already_unscaled = getattr(self._user_unscaled, "pending", False)
        self._user_unscaled.pending = False
        if not grads:
            return
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
        elif not self.built:
            raise ValueError("pass trainable_variables on the first apply(), or build() the optimizer first")
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside strategy.run)")

        finite = replicas_agree_finite(all_finite(grads))
        if not already_unscaled:
            scale = self._ls_scale.value
            variables = trainable_variables or self._trainable_variables
            grads = [g if getattr(v, "overwrite_with_gradient", False) else unscale(g, scale)
                     for g, v in zip(grads, variables, strict=False)]

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._apply_or_skip(finite, grads, trainable_variables)
        else:
            # MirroredStrategy/MultiWorkerMirroredStrategy (outside XLA-on-GPU) need the
            # cond in cross-replica context: the inner optimizer's update calls merge_call,
            # which a cond branch in replica context may not.
            tf.distribute.get_replica_context().merge_call(
                self._apply_or_skip_cross_replica, args=(finite, grads, trainable_variables))

    def _apply_or_skip(self, finite: tf.Tensor, grads: list[Any], variables: list[Any] | None) -> None:
        def apply_inner() -> tf.Tensor:
            self.inner_optimizer.apply(grads, variables)
            return tf.constant(True)

        tf.cond(finite, apply_inner, lambda: tf.constant(False))
        self._update_state(finite)

    def _apply_or_skip_cross_replica(self, distribution: tf.distribute.Strategy, finite: Any,
                                     grads: Any, variables: Any) -> None:
        # Every replica holds the same (all-reduced) flag; take the first.
        finite = distribution.experimental_local_results(finite)[0]

        def apply_inner() -> tf.Tensor:
            distribution.extended.call_for_each_replica(self.inner_optimizer.apply, args=(grads, variables))
            return tf.constant(True)

        tf.cond(finite, apply_inner, lambda: tf.constant(False))
        self._update_state(finite)

    def _update_state(self, finite: tf.Tensor) -> None:
        # The core's rule, traced with TensorFlow ops: no growth/backoff logic lives here.
        new = next_state(self._policy, self.state, finite, TF_OPS)
        for var, value in zip(self.state_variables, new, strict=False):
            var.assign(value)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        raise ValueError("stateless_apply is not supported with the TensorFlow backend (tf.distribute needs "
                         "stateful variables)")

    def minimize(self, loss: Any, var_list: Any, tape: tf.GradientTape | None = None) -> keras.Variable:
        """Scale the loss, differentiate, unscale, apply (or skip), and update the scale.

        Args:
            loss: a zero-argument callable returning the loss, or a loss tensor computed
                under ``tape``.
            var_list: a variable, a list of variables, or a callable returning them.
            tape: the ``tf.GradientTape`` that recorded a tensor ``loss``.
        """
        if callable(var_list):
            var_list = var_list()
        if not isinstance(var_list, (list, tuple)):
            var_list = [var_list]
        var_list = list(var_list)
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
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "dynamic": self.dynamic,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "policy": self._policy.to_config(),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
                    ) -> LossScaleOptimizer:
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
    if not isinstance(optimizer, _KerasLossScaleOptimizer):
        return LossScaleOptimizer(optimizer, policy=policy)
    keras_lso = optimizer
    if policy is None:
        policy = DynamicPolicy(initial_scale=float(keras_lso.initial_scale),
                               growth_interval=int(keras_lso.dynamic_growth_steps))
    ours = LossScaleOptimizer(keras_lso.inner_optimizer, policy=policy)
    if not keras_lso.built:
        return ours
    # One host read, once per installation: if Keras' optimizer has trained, carry its running
    # scale and counter over, clipped into the policy's bounds (Keras' scale has neither
    # bound). Untouched, it only holds its initial scale, and the policy's initial scale wins.
    scale = float(keras_lso.dynamic_scale.numpy())
    counter = int(keras_lso.step_counter.numpy())
    applied = int(keras_lso.inner_optimizer.iterations.numpy())
    if applied or counter or scale != float(np.float32(keras_lso.initial_scale)):
        constants = rule_constants(policy)
        ours.assign_state({
            "scale": min(max(scale, constants.min_scale), constants.max_scale),
            "growth_counter": min(counter, constants.growth_interval - 1) if policy.dynamic else 0,
            "steps": applied,
        })
    return ours

