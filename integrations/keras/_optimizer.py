"""A Keras 3 ``LossScaleOptimizer`` whose loss scale moves by the core's one update rule.

It subclasses ``keras.optimizers.LossScaleOptimizer`` only so that Keras treats it as a loss scale
optimizer everywhere (``compile()`` under ``mixed_float16`` does not wrap it a second time,
``MultiOptimizer`` refuses it, the TensorBoard callback finds ``inner_optimizer``); all of the
loss-scaling behaviour is its own, built on :mod:`lossscale_callbacks._update`. It runs on the
TensorFlow, JAX and torch backends; TensorFlow is imported only on its backend.

The class is the Keras 3 core (construction, ``scale_loss``, ``apply``/``apply_gradients``,
``stateless_apply``, the state, saving); the rest lives by job beside it: the tf.keras API
(:mod:`~lossscale_callbacks.keras._seed_api`), the arguments (:mod:`~lossscale_callbacks.keras._arguments`),
the state variables and their one host read (:mod:`~lossscale_callbacks.keras._state_variables`), one
step per backend (:mod:`~lossscale_callbacks.keras._backend_steps`), the forensics wiring
(:mod:`~lossscale_callbacks.keras._forensics_wiring`), configs and saved models
(:mod:`~lossscale_callbacks.keras._config`); :func:`wrap` puts it in the place of a model's optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks import DynamicPolicy, LossScaleState
from lossscale_callbacks.integration import (
    STATE_FIELDS,
    IntervalOutcomes,
    Policy,
    check_int,
    check_known,
    validate_state,
)
from lossscale_callbacks.keras import _config as config
from lossscale_callbacks.keras._arguments import (
    check_base_optimizer_kwargs,
    claim_inner_optimizer,
    release_inner_optimizer,
    resolve_policy,
)
from lossscale_callbacks.keras._backend_steps import backend_step
from lossscale_callbacks.keras._forensics_wiring import (
    DiagnoseSettings,
    ForensicsWiring,
    check_diagnose_settings,
)
from lossscale_callbacks.keras._forward_trace import ForwardTrace
from lossscale_callbacks.keras._outcome_ring import DEFAULT_CAPACITY, OutcomeRing
from lossscale_callbacks.keras._seed_api import PendingUnscales, SeedAPI, delegated_hyperparameters
from lossscale_callbacks.keras._state_variables import LossScaleVariables


@config.register_keras_name
@keras.saving.register_keras_serializable(package="lossscale_callbacks")
class LossScaleOptimizer(SeedAPI, keras.optimizers.LossScaleOptimizer):
    """Dynamic (or fixed) loss scaling around any Keras 3 optimizer, on the shared core.

    Works in ``model.compile(optimizer=...)``/``fit()`` (Keras calls :meth:`scale_loss`
    and passes the *scaled* gradients to :meth:`apply_gradients`) and in custom loops,
    either the seed's way (:meth:`get_scaled_loss`, :meth:`get_unscaled_gradients`, then
    :meth:`apply_gradients`) or with :meth:`minimize`. :meth:`apply_gradients` takes *scaled*
    gradients and unscales them itself (Keras 3), unless :meth:`get_unscaled_gradients` was
    called since the last apply of this replica (tf.keras): then it takes them as unscaled.

    Every step checks all gradients for Inf/NaN (reduced across replicas under
    ``tf.distribute``, so every replica decides alike), applies the inner optimizer only
    when they are finite (a skipped step leaves every trainable variable and every variable
    of the inner optimizer bit-identical; state that the forward pass itself updates, such as
    BatchNormalization's moving statistics, still moves, as with any loss scaler), and moves
    the loss scale with the core's ``next_state``. No host synchronisation happens in the step
    on TensorFlow and JAX (torch reads the overflow flag once per step, as Keras' own class
    does there, and the forensics add no read); :meth:`read_state` is the one host read, for
    callbacks at their log interval.

    ``iterations`` is the inner optimizer's counter, so it counts *applied* steps only
    (as in Keras and tf.keras): a skipped step does not advance it, nor a
    ``LearningRateSchedule`` driven by it. The number of attempted steps, skipped ones
    included, is ``state.steps`` (the metrics' step axis).

    Saving: the state lives in non-trainable Keras variables, so every Keras way of saving keeps it,
    and a loaded state is checked whole (see the documentation's "Keras" page).

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap (not a loss scale
            optimizer itself, not wrapped by another of ours; its ``loss_scale_factor`` is cleared).
        dynamic: the seed's switch: dynamic scaling (True) or a fixed ``initial_scale``.
        initial_scale: first loss scale; defaults to ``2**15`` when dynamic, and is
            required (the fixed scale) when ``dynamic=False``.
        dynamic_growth_steps: finite steps between growths (default 2000); only with
            ``dynamic=True``.
        policy: any core policy (hysteresis, min/max scale, factors) instead of the three
            seed arguments.
        name: the optimizer's name.
        diagnose: overflow forensics on every backend (:mod:`lossscale_callbacks.forensics._gradients`):
            ``True`` records on the device why each skipped step was skipped, which layers' gradients
            were non-finite and where the overflow started, and samples the float16 headroom every
            ``headroom_every`` steps (``"every_step"``: every step). Read with :meth:`read_forensics`;
            :meth:`watch` names the layers by the model's layer objects. Not in the config.
        headroom_every: steps between headroom samples.
        outcome_capacity: the skipped steps the device ring of step outcomes keeps between two reads
            (default 64; more are counted, the oldest not listed). Not in the config.

    Raises:
        ValueError: an argument is invalid (named), e.g. an inner optimizer that is already a loss
            scale optimizer, or ``dynamic_growth_steps`` with ``dynamic=False``.

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
        outcome_capacity: int = DEFAULT_CAPACITY,
        **kwargs: Any,
    ) -> None:
        forensics = ForensicsWiring(check_diagnose_settings(diagnose, headroom_every))
        ring = OutcomeRing(check_int("outcome_capacity", outcome_capacity, maximum=2**20))
        step = backend_step()
        check_base_optimizer_kwargs(kwargs)
        resolved = resolve_policy(dynamic, initial_scale, dynamic_growth_steps, policy)
        claim_inner_optimizer(inner_optimizer)  # the last check: from here on the inner one is ours
        # Keras' LossScaleOptimizer.__init__ only stores initial_scale/dynamic_growth_steps,
        # which are properties of the policy here; go straight to the base optimizer.
        super(keras.optimizers.LossScaleOptimizer, self).__init__(learning_rate=0.0, name=name)
        self._policy = resolved
        self._delegated = delegated_hyperparameters(inner_optimizer)
        self._step = step
        self._pending_unscales = PendingUnscales(step.call_site)
        self._forensics_wiring = forensics
        self._forward_trace: ForwardTrace | None = None  # set_forward_trace(model) switches it on
        self.inner_optimizer = inner_optimizer
        # As Keras does: the inner optimizer must not scale the loss a second time.
        inner_optimizer.loss_scale_factor = None
        self._state_variables = LossScaleVariables(self, resolved, step.pack_state)
        self._outcome_ring = ring
        self._state_variables.on_assign = ring.restart  # a state that comes in: the record starts after it
        # An attribute of its own: Keras saves it under optimizer/loss_scale_counters and
        # tf.train.Checkpoint tracks it (see state_variables).
        self.loss_scale_counters = self._state_variables.counters

    # ---- the state ----

    @property
    def policy(self) -> Policy:
        """The core policy this optimizer runs."""
        return self._policy

    @property
    def loss_scale_variables(self) -> LossScaleVariables:
        """The state variables and the operations on them as a whole (read, assign, one rule step)."""
        return self._state_variables

    @property
    def state_variables(self) -> LossScaleState:
        """The five state variables (on the device), as a :class:`LossScaleState`."""
        return self._state_variables.fields

    @property
    def state(self) -> LossScaleState:
        """The current state as tensors (no host read)."""
        return self._state_variables.values()

    @property
    def variables(self) -> list[Any]:
        """Every variable this optimizer steps: its own, the loss-scale counters, the forensics tally (with
        ``diagnose``; never saved), the inner optimizer's."""
        trace = self._forward_trace.variable_list if self._forward_trace is not None else []
        return (self._variables + self.loss_scale_counters.variables + self._outcome_ring.variable_list
                + self._forensics_wiring.variable_list + trace + self.inner_optimizer.variables)

    # Names of Keras' own LossScaleOptimizer, for code written against it.
    @property
    def dynamic_scale(self) -> keras.Variable:
        return self._state_variables.scale

    @property
    def step_counter(self) -> keras.Variable:
        return self._state_variables.growth_counter

    def read_state(self) -> LossScaleState:
        """Copy the state to the host: numpy scalars. **This is a host synchronisation** (one transfer).

        Call it at a log interval, never per step.
        """
        return self._state_variables.read()

    @property
    def outcome_ring(self) -> OutcomeRing:
        """The device ring of step outcomes (see :meth:`read_state_and_outcomes`)."""
        return self._outcome_ring

    def read_state_and_outcomes(self) -> tuple[LossScaleState, IntervalOutcomes]:
        """The state and what happened to the steps since the previous call: **one host transfer**.

        The outcomes (an :class:`~lossscale_callbacks.extend.IntervalOutcomes`) list every step skipped
        since the previous call with its cause (``"overflow"``, or ``"nonfinite"`` at a fixed scale of 1)
        and the scale it used, oldest first, from the device ring each step writes (at most
        ``outcome_capacity`` of them; the counts stay exact). ``LossScaleCallback`` calls it at each log
        interval; call it yourself in a custom loop, at your interval (one reader: each call takes the steps
        since the previous one).

        Example:
            >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
            >>> var = keras.Variable(1.0)
            >>> _ = opt.minimize(lambda: var * float("inf"), var_list=var)
            >>> _ = opt.minimize(lambda: var**2, var_list=var)
            >>> state, outcomes = opt.read_state_and_outcomes()
            >>> [(o.step, o.cause, o.scale) for o in outcomes.outcomes], outcomes.applied
            ([(1, 'overflow', 8.0)], 1)
        """
        ring = self._outcome_ring
        if ring.rows is None:  # not built: no step taken
            state = self.read_state()
            return state, IntervalOutcomes(int(state.steps) + 1, int(state.steps))
        state, flat = self._state_variables.read_with(ring.flat())
        return state, ring.decode(state, flat, self._policy)

    def assign_state(self, state: LossScaleState | dict[str, Any]) -> None:
        """Overwrite (some of) the state; fields missing from a dict keep their value. All or nothing.

        The merged state is checked against the policy first (finite scale inside its bounds,
        non-negative integer counters, ``skipped_steps <= steps``): a ``ValueError`` names the
        field and nothing is assigned. Reads the current state once (a host sync) when a dict
        leaves fields out.
        """
        fields = state._asdict() if isinstance(state, LossScaleState) else dict(state)
        check_known("assign_state", fields, STATE_FIELDS, what="field")
        current = {} if len(fields) == len(STATE_FIELDS) else self.read_state()._asdict()
        checked = validate_state(self._policy, {**current, **fields}, source="assign_state")
        self._state_variables.assign(checked)

    # ---- saving: Keras' own LossScaleOptimizer layout (see state_variables) ----

    def _keras_layout(self) -> list[Any]:
        return self._variables + self.inner_optimizer.variables

    def save_own_variables(self, store: Any) -> None:
        """Keras' own ``LossScaleOptimizer`` list; the other counters are saved by ``loss_scale_counters``."""
        for i, variable in enumerate(self._keras_layout()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        """Stage the saved list; the whole state is checked and assigned with the counters that follow."""
        self._state_variables.stage(store, self._keras_layout(), self.name)

    # ---- building and scaling the loss ----

    def build(self, var_list: Sequence[Any]) -> None:
        # The inner optimizer may already be built (a compiled optimizer that the callback
        # wraps); building it twice would create a second set of slots.
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self._building_base = True
        try:
            super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        finally:
            self._building_base = False
        self._outcome_ring.build()
        self._forensics_wiring.build(self)

    def _scaled(self, loss: Any) -> Any:
        loss = ops.convert_to_tensor(loss)
        if self.forensics is not None:
            loss = self._step.note_loss(loss)  # whether it was finite, for the step's skip cause
        trace = self.forward_trace
        if trace is not None:  # the forward pass just ran: its vector, made only when the step is due
            vector = trace.vector(self._state_variables.fields.steps.value, trace.variable.value)
            if vector is not None:  # None: not traced (torch's host, or fit's ordinary train function)
                loss = self._step.note_trace(trace, loss, vector)
        dtype = keras.backend.standardize_dtype(loss.dtype)
        if dtype in ("float16", "bfloat16"):
            loss, dtype = ops.cast(loss, "float32"), "float32"
        return ops.multiply(loss, ops.cast(self._state_variables.scale.value, dtype))

    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (Keras 3's API). Half-precision losses are promoted to float32 first.

        Keras' trainer calls this in every ``train_step`` and then passes *scaled* gradients to
        :meth:`apply_gradients`; so it also forgets any :meth:`get_unscaled_gradients` call of
        this replica that no apply consumed.
        """
        self._pending_unscales.drop()
        return self._scaled(loss)

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
        decision reads the overflow flag once (see :mod:`~lossscale_callbacks.keras._backend_steps`).

        Args:
            grads: the gradients, *scaled* (Keras 3: ``fit``, or a loop with :meth:`scale_loss`)
                unless ``unscaled``.
            trainable_variables: the variables (required on the first call unless built).
            unscaled: ``True``: the gradients are already divided by the scale (a tf.keras loop
                with :meth:`get_unscaled_gradients`); ``False``: they are scaled; ``None``
                (default): unscaled exactly when :meth:`get_unscaled_gradients` was called from
                this replica and trace since the last apply or :meth:`scale_loss`.
        """
        grads = list(grads)
        noted = self._pending_unscales.take()
        if unscaled is not None and not isinstance(unscaled, bool):
            raise ValueError(f"unscaled must be None, True or False, got {unscaled!r}")
        if not grads:
            return
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
        elif not self.built:
            raise ValueError("pass trainable_variables on the first apply(), or build() the optimizer first")
        self._step.apply(self, grads, trainable_variables, noted if unscaled is None else unscaled)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Keras' functional step (what the JAX trainer jits): new trainable and optimizer values.

        The inner optimizer's ``stateless_apply`` runs in an ``ops.cond`` on the overflow flag, so a
        skipped step returns every trainable and optimizer value unchanged; the state moves by the
        core's rule. ``grads`` are *scaled*, as in ``fit``. No host read. Not on TensorFlow.
        """
        if not self.built:
            raise ValueError(f"To call `stateless_apply`, {type(self).__name__} must be built: call "
                             "optimizer.build(trainable_variables) first")
        return self._step.stateless(self, list(optimizer_variables), list(grads), list(trainable_variables),
                                    unscaled=self._pending_unscales.take())

    # ---- overflow forensics ----

    @property
    def forensics(self) -> ForensicsWiring | None:
        """The forensics wiring while they run (``diagnose`` on and the optimizer built), else ``None``."""
        return self._forensics_wiring if self._forensics_wiring.active else None

    def set_diagnose(self, diagnose: bool | str, headroom_every: int = 1000) -> None:
        """Switch the overflow forensics on or off (see ``diagnose``); retrace the train function after it
        (on JAX the tally is part of ``variables``: ``fit``'s step must be made again)."""
        self._configure_forensics(check_diagnose_settings(diagnose, headroom_every))

    def _configure_forensics(self, settings: DiagnoseSettings) -> None:
        """:meth:`set_diagnose` with the settings checked already (``LossScaleCallback`` checked them)."""
        self._forensics_wiring.configure(settings, self if self.built else None)

    def watch(self, model: Any) -> LossScaleOptimizer:
        """Name the report's layers by the model's layer objects, in the model's order (paths in nested
        models); returns self. Retrace the train function after it, as after :meth:`set_diagnose`."""
        self._forensics_wiring.watch(model, self if self.built else None)
        return self

    def read_forensics(self, state: LossScaleState | None = None) -> Any:
        """The forensics since the last call as an ``IntervalForensics`` (``None`` when off). One host read
        (the packed tally; on JAX in ``fit``, sync the model's state first, as the callback does): call it
        at the log interval; pass the ``state`` just read with :meth:`read_state` to save a second read."""
        if self.forensics is None:
            return None
        return self._forensics_wiring.read(self.read_state() if state is None else state)

    # ---- forward trace ----

    @property
    def forward_trace(self) -> ForwardTrace | None:
        """The forward trace while it runs (see :meth:`set_forward_trace`), else ``None``."""
        trace = self._forward_trace
        return trace if trace is not None and trace.active else None

    def set_forward_trace(self, model: Any, every: int = 100) -> None:
        """Trace ``model``'s forward pass in every ``every``-th step (and the step after a skipped one):
        per layer the largest ``|output|`` and the layer that produced the first non-finite activation,
        on the device (see :mod:`~lossscale_callbacks.keras._forward_trace`). ``model=None`` stops it.
        Retrace the train function after it (the tally is one of ``variables``)."""
        if self._forward_trace is not None:
            self._forward_trace.unwatch()
            self._forward_trace = None
        if model is not None:
            trace = ForwardTrace(every)
            trace.watch(model)
            self._forward_trace = trace

    def read_forward_trace(self) -> dict[str, Any] | None:
        """The forward trace since the last call, as NumPy fields (``None`` when off). One host read (on JAX
        in ``fit``, sync the model's state first): call it at the log interval."""
        trace = self.forward_trace
        return trace.read() if trace is not None else None

    # ---- config ----

    def get_config(self) -> dict[str, Any]:
        """Keras 3's four keys; ``dynamic``, ``policy`` and what loading needs only when they say more.

        A default dynamic policy has exactly the config of Keras' own ``LossScaleOptimizer``, so
        either class can load it (see :mod:`~lossscale_callbacks.keras._config`).
        """
        return config.optimizer_config(self)

    @classmethod
    def from_config(cls, config_dict: dict[str, Any], custom_objects: dict[str, Any] | None = None
                    ) -> LossScaleOptimizer:
        """Rebuild from :meth:`get_config`, from Keras' own ``LossScaleOptimizer`` config (any Keras 3
        release) or from the configs of earlier releases of this class."""
        inner, kwargs = config.constructor_arguments(config_dict, custom_objects)
        return cls(inner, **kwargs)


# ----------------------------------------
# Putting our optimizer in the place of a model's optimizer (``LossScaleCallback`` does it).


def wrap(optimizer: keras.optimizers.Optimizer, policy: Policy | None = None) -> LossScaleOptimizer:
    """Our optimizer around ``optimizer``; Keras' own LossScaleOptimizer is unwrapped and its scale kept.

    The wrapper replaces the previous one in the model, so an inner optimizer that an earlier, discarded
    LossScaleOptimizer of ours wrapped (a recompiled model) is wrapped again. Called by
    :class:`~lossscale_callbacks.keras.LossScaleCallback`; build it inside the model's distribution
    strategy scope.

    Example:
        >>> keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=256.0)
        >>> ours = wrap(keras_lso)
        >>> ours.inner_optimizer is keras_lso.inner_optimizer, ours.initial_scale
        (True, 256.0)
    """
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        release_inner_optimizer(optimizer)
        return LossScaleOptimizer(optimizer, policy=policy)
    keras_lso = optimizer
    if policy is None:
        policy = DynamicPolicy(initial_scale=float(keras_lso.initial_scale),
                               growth_interval=int(keras_lso.dynamic_growth_steps))
    release_inner_optimizer(keras_lso.inner_optimizer)
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
        constants = policy.constants
        ours.assign_state({
            "scale": min(max(scale, constants.min_scale), constants.max_scale),
            "growth_counter": min(counter, constants.growth_interval - 1) if policy.dynamic else 0,
            "steps": applied,
        })
    return ours
