"""One optimizer step of the Keras ``LossScaleOptimizer`` per Keras backend, chosen once per optimizer.

Every step checks the gradients for Inf/NaN, unscales them, applies the inner optimizer only when they
are finite and moves the loss scale by the core's rule (:func:`~lossscale_callbacks.next_state`):

- TensorFlow (:class:`TensorFlowStep`): the rule in TensorFlow ops, the skip a ``tf.cond`` inside the
  traced step, the overflow flag reduced across ``tf.distribute`` replicas; no host read.
- JAX (:class:`JaxStep`): the rule in ``keras.ops`` inside Keras' jitted ``stateless_apply``, the skip a
  ``lax.cond`` (under ``keras.distribution`` the gradients are global arrays, so every device decides
  alike); no host read. A stateful ``apply`` (a custom loop) runs the same stateless step.
- torch (:class:`TorchStep`): the rule in torch's own ops on the device, the finiteness check torch's
  fused kernel, the skip a Python branch on the flag: one host read per step, as in Keras' own
  ``LossScaleOptimizer`` (torch has no traced conditional for Keras' step).

Each step works on a :class:`~lossscale_callbacks.keras.LossScaleOptimizer` (its inner
optimizer, its :class:`~lossscale_callbacks.keras._state_variables.LossScaleVariables`, its forensics).
With ``diagnose`` the skip decision comes from the forensics' per-layer flags (the same reductions) and
each step notes whether the loss was finite where ``scale_loss`` sees it (:meth:`_Step.note_loss`),
for the skip's cause: TensorFlow per replica and trace, JAX through the backward pass of the scaled
loss (``scale_loss`` runs inside Keras' ``value_and_grad``, whose scope keeps no state), torch
lazily, on skipped steps only. TensorFlow is imported only by :class:`TensorFlowStep`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import keras
from keras import ops

from lossscale_callbacks import LossScaleState, next_state
from lossscale_callbacks.keras import _keras_ops as keras_ops
from lossscale_callbacks.keras._forensics_device import Packed

if TYPE_CHECKING:  # the optimizer's modules import this one
    from lossscale_callbacks.integration import Policy
    from lossscale_callbacks.keras._forensics_wiring import ForensicsWiring
    from lossscale_callbacks.keras._outcome_ring import OutcomeRing
    from lossscale_callbacks.keras._state_variables import LossScaleVariables


class StepOptimizer(Protocol):
    """What a backend step calls back into: the ``LossScaleOptimizer`` it steps, as the step sees it."""

    inner_optimizer: keras.optimizers.Optimizer
    _trainable_variables: list[Any]
    _trainable_variables_indices: dict[str, int]

    @property
    def policy(self) -> Policy: ...

    @property
    def loss_scale_variables(self) -> LossScaleVariables: ...

    @property
    def forensics(self) -> ForensicsWiring | None: ...

    @property
    def outcome_ring(self) -> OutcomeRing: ...

    @property
    def variables(self) -> list[Any]: ...

    def scale_loss(self, loss: Any) -> Any: ...

    def _var_key(self, variable: Any) -> str: ...


class _Step:
    """What every backend's step shares: unscaling (every gradient but those that overwrite their variable),
    where a call comes from, a variable's value as a tensor."""

    def tensor(self, value: Any) -> Any:
        """``value`` (a variable's) as a tensor of the backend."""
        return ops.convert_to_tensor(value)

    def unscale(self, grad: Any, scale: Any) -> Any:
        return keras_ops.unscale(grad, scale)

    def unscale_all(self, grads: Sequence[Any], variables: Sequence[Any], scale: Any) -> list[Any]:
        # A variable with overwrite_with_gradient takes the gradient as its new value (Keras' rule).
        return [g if getattr(v, "overwrite_with_gradient", False) else self.unscale(g, scale)
                for g, v in zip(grads, variables, strict=False)]

    def call_site(self) -> tuple[Any, Any]:
        """(the replica, the trace) a call comes from; only TensorFlow has several of either."""
        return None, None

    def agree(self, flags: Any, loss_bad: Any) -> tuple[Any, Any]:
        """The per-layer flags and the loss flag of every replica (one process holds them all but on TF)."""
        return flags, loss_bad

    def note_trace(self, trace: Any, loss: Any, vector: Any) -> Any:
        """Keep the forward trace's vector of this step for the apply (by trace); returns the loss."""
        trace.keep(self.call_site()[1], vector)
        return loss

    def take_trace(self, trace: Any, grads: Sequence[Any]) -> Any:
        """The forward trace's vector of this apply's step (``None``: no traced forward pass preceded)."""
        return trace.take(self.call_site()[1])


class TensorFlowStep(_Step):
    """The TensorFlow step: ``tf.cond`` skip, replicas agree on the flag, forensics traced in."""

    def __init__(self) -> None:
        import tensorflow as tf

        from lossscale_callbacks.keras import _tf_ops as tf_ops

        self._tf, self._tf_ops = tf, tf_ops
        self._losses: dict[Any, tuple[Any, Any]] = {}

    def note_loss(self, loss: Any) -> Any:
        """``scale_loss`` saw ``loss`` (forensics on): keep whether it was finite for this replica's next
        apply in the same trace; returns the loss to scale."""
        replica, trace = self.call_site()
        self._losses[replica] = (trace, _loss_bad(loss))
        return loss

    def take_loss(self, grads: Sequence[Any]) -> Any:
        """Whether the loss of this apply's step was non-finite (``False`` when no ``scale_loss`` of this
        replica and trace preceded it: a loop that scales its loss another way)."""
        replica, trace = self.call_site()
        noted = self._losses.pop(replica, None)
        return noted[1] if noted is not None and noted[0] == trace else ops.convert_to_tensor(False)

    def agree(self, flags: Any, loss_bad: Any) -> tuple[Any, Any]:
        """All-reduced over ``tf.distribute`` replicas in one collective (the skip flag's own): every replica
        then skips alike and counts the same layers and cause."""
        tf = self._tf
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return flags, loss_bad
        local = tf.concat([flags, [tf.cast(loss_bad, flags.dtype)]], 0)
        both = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
        return tf.minimum(both[:-1], 1.0), both[-1] > 0

    def tensor(self, value: Any) -> Any:
        return self._tf.convert_to_tensor(value)  # keras.ops gives a tf.Variable back as it is

    def pack_state(self, state: LossScaleState) -> Any:
        """The state as one int64 vector: the float32 scale's bits, then the counters (TensorFlow's ops:
        a third of keras.ops' Python cost per read)."""
        tf = self._tf
        return tf.stack([self.scale_bits(state.scale), *state[1:]])

    def scale_bits(self, scale: Any) -> Any:
        """The float32 scale's bits as an int64 (exact both ways)."""
        tf = self._tf
        return tf.cast(tf.bitcast(scale, tf.int32), tf.int64)

    def unscale(self, grad: Any, scale: Any) -> Any:
        return self._tf_ops.unscale(grad, scale)  # also tf.IndexedSlices

    def call_site(self) -> tuple[Any, Any]:
        """(replica id in its sync group or ``None``, a weak reference to the graph being traced or ``None``
        when eager): tf.distribute runs each replica's step in a thread of its own, in one graph."""
        tf = self._tf
        context = tf.distribute.get_replica_context()
        replica = None if context is None else tf.get_static_value(context.replica_id_in_sync_group)
        replica = None if replica is None else int(replica)
        if tf.executing_eagerly():
            return replica, None
        return replica, weakref.ref(tf.compat.v1.get_default_graph())

    def stateless(self, opt: StepOptimizer, optimizer_values: list[Any], grads: list[Any],
                  trainable_values: list[Any], unscaled: bool) -> tuple[list[Any], list[Any]]:
        raise ValueError("stateless_apply is not supported with the TensorFlow backend (tf.distribute "
                         "needs stateful variables); use apply()")

    def apply(self, opt: StepOptimizer, grads: list[Any], variables: list[Any] | None,
              unscaled: bool) -> None:
        """Check, unscale, apply or skip, update the scale; inside ``tf.function`` with no host read."""
        tf, tf_ops = self._tf, self._tf_ops
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside strategy.run)")
        forensics = opt.forensics
        if forensics is None:
            finite = tf_ops.replicas_agree_finite(tf_ops.all_finite(grads))
        else:
            dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
            finite, changed, update = forensics.traced(
                forensics.values, dense, variables or opt._trainable_variables, self.take_loss(grads),
                opt.loss_scale_variables.values(), unscaled, self.agree)

            def commit() -> Any:
                forensics.assign(update())
                return tf.constant(True)

            tf.cond(changed, commit, lambda: tf.constant(False))  # an ordinary step assigns nothing
        trace = opt.forward_trace
        if trace is not None:
            steps = opt.loss_scale_variables.fields.steps.value
            trace.commit_tf(self.take_trace(trace, grads), finite, steps)
        if not unscaled:
            grads = self.unscale_all(grads, variables or opt._trainable_variables,
                                     opt.loss_scale_variables.scale.value)
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._apply_or_skip(opt, finite, lambda: opt.inner_optimizer.apply(grads, variables))
        else:
            # MirroredStrategy/MultiWorkerMirroredStrategy (outside XLA-on-GPU) need the cond in
            # cross-replica context: the inner optimizer's update calls merge_call, which a cond branch
            # in replica context may not.
            tf.distribute.get_replica_context().merge_call(
                self._apply_or_skip_cross_replica, args=(opt, finite, grads, variables))

    def _apply_or_skip(self, opt: StepOptimizer, finite: Any, apply_inner: Callable[[], Any]) -> None:
        tf = self._tf

        def apply() -> Any:
            apply_inner()
            return tf.constant(True)

        tf.cond(finite, apply, lambda: tf.constant(False))
        if opt.outcome_ring.rows is not None:  # before the state moves: the step's number and scale
            state = opt.loss_scale_variables.values()
            opt.outcome_ring.record(state, finite, self.scale_bits(state.scale), self._tf_ops.TF_OPS)
        opt.loss_scale_variables.advance(finite, self._tf_ops.TF_OPS)

    def _apply_or_skip_cross_replica(self, distribution: Any, opt: StepOptimizer, finite: Any, grads: Any,
                                     variables: Any) -> None:
        # Every replica holds the same (all-reduced) flag; take the first.
        finite = distribution.experimental_local_results(finite)[0]
        self._apply_or_skip(opt, finite, lambda: distribution.extended.call_for_each_replica(
            opt.inner_optimizer.apply, args=(grads, variables)))

    def scaled_gradients(self, opt: StepOptimizer, loss: Any, var_list: list[Any], tape: Any) -> list[Any]:
        """Gradients of ``opt.scale_loss(loss)``: a callable ``loss`` under a new tape, or a tensor under
        ``tape``."""
        if callable(loss):
            with self._tf.GradientTape() as tape:
                scaled = opt.scale_loss(loss())
        else:
            if tape is None:
                raise ValueError("tape is required when loss is a tensor rather than a callable")
            with tape:
                scaled = opt.scale_loss(loss)
        return tape.gradient(scaled, var_list)


class _KerasOpsStep(_Step):
    """JAX and torch: Keras' stateless step in ``keras.ops``; gradients of a callable loss with the backend's
    own autodiff (``_gradients``)."""

    _gradients: Callable[[Callable[[], Any], list[Any]], list[Any]]

    def scaled_gradients(self, opt: StepOptimizer, loss: Any, var_list: list[Any], tape: Any) -> list[Any]:
        """Gradients of ``opt.scale_loss(loss())`` with respect to ``var_list``; ``loss`` must be callable."""
        if not callable(loss) or tape is not None:
            raise ValueError(f"loss must be a zero-argument callable (and no tape) on the "
                             f"{keras.backend.backend()} backend; a loss tensor with a tape is "
                             "TensorFlow's form")
        return self._gradients(lambda: opt.scale_loss(loss()), var_list)

    def branch(self, flag: Any, if_true: Callable[[], Any], if_false: Callable[[], Any]) -> Any:
        """``if_true()`` where the device flag holds, else ``if_false()`` (their results alike in structure):
        ``ops.cond``."""
        return ops.cond(flag, if_true, if_false)

    def stateless(self, opt: StepOptimizer, optimizer_values: list[Any], grads: list[Any],
                  trainable_values: list[Any], unscaled: bool) -> tuple[list[Any], list[Any]]:
        """Keras' functional step: new trainable values and new values of ``opt.variables``. No host read.

        The inner optimizer's ``stateless_apply`` runs in a :meth:`branch` on the overflow flag, so a
        skipped step returns every trainable and optimizer value unchanged.
        """
        variables, inner = opt.variables, opt.inner_optimizer
        if len(optimizer_values) != len(variables):
            raise ValueError(f"optimizer_variables: expected {len(variables)} values (this optimizer's "
                             f"`variables`), got {len(optimizer_values)}")
        if len(trainable_values) != len(opt._trainable_variables):
            # Keras' own optimizers refuse this too: JAX's fit passes the values of the trainable
            # variables only, so a layer frozen after the build changes the count.
            raise ValueError(f"trainable_variables: expected {len(opt._trainable_variables)} values (the "
                             f"variables this optimizer was built with), got {len(trainable_values)}; "
                             "after freezing layers, compile with a new optimizer")
        own = variables[:len(variables) - len(inner.variables)]
        own_values, inner_values = optimizer_values[:len(own)], optimizer_values[len(own):]
        by_variable = {id(v): value for v, value in zip(own, own_values, strict=True)}
        fields = opt.loss_scale_variables.fields
        state = LossScaleState(*(by_variable[id(v)] for v in fields))
        forensics = opt.forensics
        if forensics is None:
            finite = keras_ops.all_finite(grads)
        else:
            tally = Packed(*(by_variable[id(v)] for v in forensics.variables))
            finite, changed, update = forensics.traced(lambda: tally, grads, opt._trainable_variables,
                                                       self.take_loss(grads), state, unscaled, self.agree)
            tally = update() if changed is None else Packed(*self.branch(changed, update, lambda: tally))
            by_variable.update({id(v): value for v, value in zip(forensics.variables, tally, strict=True)})
        trace = opt.forward_trace
        if trace is not None:
            key = id(trace.variable)
            vector = self.take_trace(trace, grads)
            by_variable[key] = trace.fold(by_variable[key], vector, finite, state.steps)
        if not unscaled:
            grads = self.unscale_all(grads, opt._trainable_variables, state.scale)

        def apply_inner() -> tuple[list[Any], list[Any]]:
            new = inner.stateless_apply(inner_values, grads, trainable_values)
            return list(new[0]), list(new[1])

        def skip() -> tuple[list[Any], list[Any]]:
            return list(trainable_values), list(inner_values)

        new_trainable, new_inner = self.branch(finite, apply_inner, skip)
        ring = opt.outcome_ring
        if ring.rows is not None:  # the step's outcome into the device ring (before the state moves)
            rows, written = ring.next_values(by_variable[id(ring.rows)], by_variable[id(ring.written)],
                                             state.steps, self.scale_bits(state.scale), finite,
                                             keras_ops.KERAS_OPS)
            by_variable[id(ring.rows)], by_variable[id(ring.written)] = rows, written
        new_state = next_state(opt.policy, state, finite, keras_ops.KERAS_OPS)
        for var, value in zip(fields, new_state, strict=True):
            by_variable[id(var)] = ops.cast(value, var.dtype)
        return new_trainable, [by_variable[id(v)] for v in own] + new_inner


def _loss_bad(loss: Any) -> Any:
    return ops.logical_not(ops.all(ops.isfinite(ops.cast(loss, "float32"))))


def _jax_loss_probe(keep: Callable[[Any], None]) -> Callable[[Any], Any]:
    """The identity on the loss, whose backward pass hands ``keep`` whether the loss was finite.

    Keras' JAX trainer scales the loss inside ``value_and_grad`` and a ``StatelessScope`` that keeps no
    state; the flag computed there would be a tracer of the inner transformation. A ``custom_vjp``
    residual is a value of the step's own trace: the backward pass of the same ``jit`` sees it, and so
    does ``stateless_apply`` after it. The gradients are bit-identical (the cotangent passes through).
    """
    import jax

    @jax.custom_vjp
    def probe(loss: Any) -> Any:
        return loss

    def forward(loss: Any) -> tuple[Any, Any]:
        return loss, _loss_bad(loss)

    def backward(bad: Any, cotangent: Any) -> tuple[Any]:
        keep(bad)
        return (cotangent,)

    probe.defvjp(forward, backward)
    return probe


def _same_trace(value: Any, grads: Sequence[Any]) -> bool:
    """Whether ``value`` belongs to the computation that made ``grads`` (the same ``jit`` trace, or both
    concrete): a flag left by another trace must not leak in."""
    import jax

    grad = next((g for g in grads if g is not None), None)
    if isinstance(value, jax.core.Tracer) != isinstance(grad, jax.core.Tracer):
        return False
    return not isinstance(value, jax.core.Tracer) or value._trace is grad._trace


def _jax_gradients(fn: Callable[[], Any], variables: list[Any]) -> list[Any]:
    import jax

    def of_values(values: list[Any]) -> Any:
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
            return fn()

    return list(jax.grad(of_values)([v.value for v in variables]))


def _jax_pack(scale: Any, *counters: Any) -> Any:
    import jax
    import jax.numpy as jnp

    bits = jax.lax.bitcast_convert_type(scale, jnp.int32).astype(counters[0].dtype)
    return jnp.stack([bits, *counters])


def _torch_gradients(fn: Callable[[], Any], variables: list[Any]) -> list[Any]:
    import torch

    return list(torch.autograd.grad(fn(), [v.value for v in variables], allow_unused=True))


class JaxStep(_KerasOpsStep):
    """JAX: one stateless step for ``fit`` and custom loops alike."""

    _gradients = staticmethod(_jax_gradients)

    def __init__(self) -> None:
        import jax

        self._pack = jax.jit(_jax_pack)
        self._loss_flag: Any = None
        self._probe = _jax_loss_probe(self._keep_loss_flag)

    def _keep_loss_flag(self, bad: Any) -> None:
        self._loss_flag = bad

    def note_loss(self, loss: Any) -> Any:
        """The loss through the probe: its backward pass keeps whether it was finite (see
        :func:`_jax_loss_probe`)."""
        self._loss_flag = None
        return self._probe(loss)

    def take_loss(self, grads: Sequence[Any]) -> Any:
        """Whether the loss whose gradients these are was non-finite (``False`` when unknown)."""
        flag, self._loss_flag = self._loss_flag, None
        return flag if flag is not None and _same_trace(flag, grads) else ops.convert_to_tensor(False)

    def note_trace(self, trace: Any, loss: Any, vector: Any) -> Any:
        """The loss through the trace's carrier: its backward pass keeps the vector (``_forward_trace``)."""
        return trace.carry(loss, vector)

    def branch(self, flag: Any, if_true: Callable[[], Any], if_false: Callable[[], Any]) -> Any:
        """Under ``jit`` (``fit``, a jitted loop): ``ops.cond``. Outside it (a custom loop calling
        ``apply``/``minimize`` eagerly) both run op by op and the flag selects, on the device: ``lax.cond``
        called eagerly compiles its branches again at every call, since they are new closures each step
        (0.15 s a step for a small model on the CPU, 90 % of it)."""
        import jax
        import jax.numpy as jnp

        if isinstance(flag, jax.core.Tracer):
            return ops.cond(flag, if_true, if_false)
        return jax.tree.map(lambda yes, no: jnp.where(flag, yes, no), if_true(), if_false())

    def take_trace(self, trace: Any, grads: Sequence[Any]) -> Any:
        vector = trace.take_jax()
        return vector if vector is not None and _same_trace(vector, grads) else None

    def pack_state(self, state: LossScaleState) -> Any:
        """The state as one integer vector: the float32 scale's bits, then the counters (one jitted call)."""
        return self._pack(*state)

    def scale_bits(self, scale: Any) -> Any:
        """The float32 scale's bits in the counters' dtype (exact both ways)."""
        import jax
        import jax.numpy as jnp

        return jax.lax.bitcast_convert_type(scale, jnp.int32).astype(keras_ops.counter_dtype())

    def apply(self, opt: StepOptimizer, grads: list[Any], variables: list[Any] | None,
              unscaled: bool) -> None:
        """The stateless step on the current values, written back to the variables.

        The gradients are matched to the optimizer's variables by identity (``variables`` in any order,
        or only some of them: the others are left as they are, as by Keras' own ``apply``).
        """
        own = opt._trainable_variables
        if variables is not None:
            grads = _in_optimizer_order(opt, grads, variables)
        with warnings.catch_warnings():
            # A subset leaves the other gradients None: Keras' apply drops them, and would warn.
            warnings.filterwarnings("ignore", message="Gradients do not exist for variables")
            new_trainable, new_optimizer = self.stateless(
                opt, [v.value for v in opt.variables], grads, [v.value for v in own], unscaled)
        for var, value in zip(own, new_trainable, strict=True):
            var.assign(value)
        for var, value in zip(opt.variables, new_optimizer, strict=True):
            var.assign(value)


def _in_optimizer_order(opt: StepOptimizer, grads: list[Any], variables: list[Any]) -> list[Any]:
    """``grads`` rearranged into the order of the variables ``opt`` was built with (``None`` where a
    variable got no gradient), matched by identity."""
    out: list[Any] = [None] * len(opt._trainable_variables)
    for grad, variable in zip(grads, variables, strict=True):
        index = opt._trainable_variables_indices.get(opt._var_key(variable))
        if index is None:
            raise ValueError(f"Unknown variable: {variable}. This optimizer can only be called for the "
                             "variables it was originally built with.")
        out[index] = grad
    return out



class TorchStep(_KerasOpsStep):
    """torch: fused finiteness check and unscale, a Python branch on the flag, torch's ops for the rule."""

    _gradients = staticmethod(_torch_gradients)

    def __init__(self) -> None:
        self._rule_ops: Any = None
        self._loss: Any = None

    def note_loss(self, loss: Any) -> Any:
        """Keep the loss (detached): whether it was finite is computed only if the step is skipped."""
        self._loss = loss.detach()
        return loss

    def take_loss(self, grads: Sequence[Any]) -> Any:
        """Whether the loss noted for this step was non-finite (``False`` when none was)."""
        loss, self._loss = self._loss, None
        return ops.convert_to_tensor(False) if loss is None else _loss_bad(loss)

    def pack_state(self, state: LossScaleState) -> Any:
        """The state as one int64 vector: the float32 scale's bits, then the counters (torch's own ops)."""
        import torch

        return torch.stack([self.scale_bits(state.scale), *state[1:]])

    def scale_bits(self, scale: Any) -> Any:
        """The float32 scale's bits as an int64 (exact both ways)."""
        import torch

        return scale.view(torch.int32).to(torch.int64)

    def apply(self, opt: StepOptimizer, grads: list[Any], variables: list[Any] | None,
              unscaled: bool) -> None:
        """One host read (the branch on the overflow flag), as Keras' own LossScaleOptimizer on torch."""
        state_vars = opt.loss_scale_variables
        trainable = variables or opt._trainable_variables
        keep = range(len(grads)) if unscaled else [
            i for i, v in enumerate(trainable) if getattr(v, "overwrite_with_gradient", False)]
        finite, unscaled_grads = keras_ops.check_and_unscale(grads, state_vars.scale.value, keep)
        applied = bool(finite)  # the step's one host read
        forensics = opt.forensics
        if forensics is not None:  # before the state moves: the sample is taken at this step's scale
            forensics.eager(grads, trainable, not applied, lambda: self.take_loss(grads),
                            state_vars.scale.value, unscaled)
        self._loss = None
        trace = opt.forward_trace
        if trace is not None:  # the host knows both the schedule and the skip: fold only when either says so
            trace.host_fold(self.take_trace(trace, grads), applied, state_vars.fields.steps.value)
        if applied:
            opt.inner_optimizer.apply(unscaled_grads, variables)
        rule_ops = self._ops_on(state_vars.scale.value.device)
        if opt.outcome_ring.rows is not None:  # device ops only: the step's outcome into the ring
            opt.outcome_ring.record_torch(state_vars.values(), finite, rule_ops)
        state_vars.advance(finite, rule_ops)

    def _ops_on(self, device: Any) -> Any:
        # torch's own ops: 5x fewer Python calls than keras.ops per step, the same bits.
        if self._rule_ops is None or self._rule_ops.device != device:
            from lossscale_callbacks.torch.integration import TorchOps

            self._rule_ops = TorchOps(device)
        return self._rule_ops



def backend_step() -> TensorFlowStep | JaxStep | TorchStep:
    """The step for the Keras backend of this process (Keras fixes it at import).

    Example:
        >>> type(backend_step()).__name__ in ("TensorFlowStep", "JaxStep", "TorchStep")
        True
    """
    backend = keras.backend.backend()
    steps: dict[str, Callable[[], Any]] = {"tensorflow": TensorFlowStep, "jax": JaxStep, "torch": TorchStep}
    if backend not in steps:
        raise ValueError(f"LossScaleOptimizer runs on the tensorflow, jax and torch Keras backends, "
                         f"got KERAS_BACKEND={backend!r}")
    return steps[backend]()
