"""The forward trace of a live ``fit``: per layer the largest ``|output|``, and the layer that produced the
first non-finite activation, on the device (TensorFlow, JAX, torch); read at the log interval.

:meth:`ForwardTrace.watch` wraps the ``call`` of the model and of each of its layers (every layer, nested
ones by path, named as the gradient forensics name them: ``encoder/dense``). A call of the model starts a
forward pass; each layer call that finishes inside it is an event (its outputs, and its inputs: the
output of an earlier event, by identity, or a tensor of its own). Nothing is computed there: the optimizer's
``scale_loss`` (which every train step calls right after the forward pass) asks :meth:`ForwardTrace.vector`
for the step's vector, made in a ``cond`` on whether the step is due (every ``every`` steps, or the step
after one that was skipped untraced, so a forward overflow at an unsampled step is still named), and
the optimizer's apply folds it into the tally (:func:`~._forward_device.fold`), again in a ``cond``.

While :class:`~lossscale_callbacks.keras.LossScaleCallback` drives ``fit`` on TensorFlow or JAX the host
decides instead (``host_schedule``): ``fit`` runs one of several train functions, chosen batch by batch
(``_fit_sampling.FitSampling``), and only the one traced with ``recording`` on holds the trace; the ordinary
step has no wrapper's event, no due check and no ``cond`` in it (they cost 7 % of a small model's step).
The step after a batch whose loss turned non-finite is traced too (``kind`` 2.0), decided from the loss
in ``fit``'s logs, which Keras has already read back for every batch-end callback.

How the vector reaches the apply: TensorFlow and torch keep it here, by graph; JAX's ``scale_loss``
runs inside ``value_and_grad``, so the vector leaves through the backward pass of a ``custom_vjp``
identity on the loss (as the loss flag of the forensics does), and the tally is one of the optimizer's
variables, which ``fit``'s jitted step threads. torch decides ``due`` on the host (its step reads the
skip flag anyway). No host read in the step; :meth:`ForwardTrace.read` is one, at the log interval.
Under ``tf.distribute`` with several replicas nothing is traced (their forward passes run in threads of
their own); the gradient forensics work there as before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

from lossscale_callbacks.integration import check_int, sampled_within
from lossscale_callbacks.keras import _forward_device as device


def traced_layers(model: Any) -> list[tuple[str, Any]]:
    """``(path, layer)`` for every layer of ``model``, nested ones depth first after their parent, named
    as :func:`~lossscale_callbacks.keras._forensics_layout.model_layer_paths` names them."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(layer: Any, prefix: str) -> None:
        for sub in getattr(layer, "_layers", None) or getattr(layer, "layers", None) or ():
            if id(sub) in seen or isinstance(sub, keras.layers.InputLayer):
                continue
            seen.add(id(sub))
            found.append((f"{prefix}{sub.name}", sub))
            visit(sub, f"{prefix}{sub.name}/")

    visit(model, "")
    return found


def _floats(value: Any) -> list[Any]:
    """The floating-point tensors in a (nested) value; none for symbolic or meta tensors (a build)."""
    out = []
    for item in keras.tree.flatten(value):
        if isinstance(item, keras.KerasTensor) or not hasattr(item, "dtype") or not hasattr(item, "shape"):
            continue
        if "float" not in keras.backend.standardize_dtype(item.dtype):
            continue
        if getattr(getattr(item, "device", None), "type", None) == "meta":
            return []
        out.append(item)
    return out


class _Forward:
    """The events of one forward pass (identities of their outputs, so a later input is matched)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, list[Any], list[Any]]] = []
        self.produced: dict[int, int] = {}
        self.keep: list[Any] = []  # the tensors, so that an id is not reused while the pass lives

    def record(self, layer: int, args: Any, outputs: Any) -> None:
        outs = _floats(outputs)
        if not outs:
            return
        ins: list[Any] = [self.produced.get(id(t), t) for t in _floats(args)]
        index = len(self.events)
        self.events.append((layer, outs, ins))
        for tensor in outs:
            self.produced[id(tensor)] = index
        self.keep.extend(outs)


class ForwardTrace:
    """The forward trace of one optimizer (see the module docstring).

    Args:
        every: optimizer steps between traced steps (``1``: every step).

    Example:
        >>> trace = ForwardTrace(100)
        >>> trace.active
        False
    """

    def __init__(self, every: int) -> None:
        self.every = check_int("trace_every", every)
        self.layers: tuple[str, ...] = ()
        self.dtypes: tuple[str, ...] = ()
        self.variable: Any = None
        self.layout: device.Layout | None = None
        self._patched: list[Any] = []
        self._forward: _Forward | None = None
        self._finished: _Forward | None = None
        self._vectors: dict[Any, Any] = {}  # TensorFlow and torch: the step's vector, by graph
        self._host_steps = 0  # torch, and fit under host_schedule: the schedule on the host
        self._host_armed = False
        # fit on TensorFlow and JAX (host_scheduled, by LossScaleCallback): the host picks the traced steps;
        # a train function holds the trace when ``recording`` held while it was traced, with this ``kind``.
        self.host_schedule = False
        self.recording = False
        self.kind = 1.0
        self._jax_vector: Any = None
        self._probe: Any = None

    @contextlib.contextmanager
    def host_scheduled(self, kind: float) -> Iterator[None]:
        """While ``fit`` runs (and so traces) a train function the host chose: the host's schedule, the
        step traced when ``kind`` is ``1.0`` (scheduled) or ``2.0`` (armed by a non-finite loss), not
        when ``0.0``. The device's own schedule again after it."""
        self.host_schedule, self.recording, self.kind = True, kind > 0, kind or 1.0
        try:
            yield
        finally:
            self.host_schedule = self.recording = False

    @property
    def active(self) -> bool:
        """Whether a model is watched and the tally exists."""
        return self.variable is not None

    @property
    def variable_list(self) -> list[Any]:
        return [self.variable] if self.variable is not None else []

    # ------------------------------------------------------------------ watching a model

    def watch(self, model: Any) -> None:
        """Wrap the ``call`` of ``model`` and of its layers (again: the old wrappers are taken off first)."""
        self.unwatch()
        found = traced_layers(model)
        self.layers = tuple(path for path, _ in found)
        self.dtypes = tuple(keras.backend.standardize_dtype(layer.compute_dtype) for _, layer in found)
        for index, (_, layer) in enumerate(found):
            self._wrap(layer, functools.partial(self._finish_call, index))
        self._wrap(model, None)
        self.layout = device.Layout(len(self.layers))
        with _creation_scope():
            self.variable = keras.Variable(self.layout.zeros(), dtype="float32", trainable=False,
                                           aggregation="only_first_replica", name="forward_trace")

    def unwatch(self) -> None:
        """Take the wrappers off (the layers' own ``call`` again) and drop the tally."""
        for layer in self._patched:
            with contextlib.suppress(AttributeError):
                del layer.call
        self._patched, self.variable, self.layout = [], None, None

    def _wrap(self, layer: Any, finish: Callable[[Any, Any], None] | None) -> None:
        original = layer.call
        trace = self

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if finish is None:  # the model: a forward pass starts, unless it is nested in one
                with trace._pass():
                    return original(*args, **kwargs)
            outputs = original(*args, **kwargs)
            finish((args, kwargs), outputs)
            return outputs

        layer.call = call
        self._patched.append(layer)

    def _records(self) -> bool:
        """Whether the forward pass starting now is recorded: not on a step that will not be traced."""
        if self.host_schedule:
            return self.recording
        if keras.backend.backend() == "torch":  # eager: the host knows before the pass whether it is due
            return self._torch_due()
        return True  # a compiled step decides on the device, after the pass

    def host_due(self, steps: int) -> bool:
        """Under ``host_schedule``: whether one of the next ``steps`` steps is due for a scheduled trace (the
        host's count of ``fit``'s steps); counts them."""
        first, self._host_steps = self._host_steps, self._host_steps + steps
        return sampled_within(first, steps, self.every)

    def _torch_due(self) -> bool:
        """torch's eager step: whether the step now starting is traced (armed by a skip, or scheduled)."""
        return self._host_armed or sampled_within(self._host_steps, 1, self.every)

    @contextlib.contextmanager
    def _pass(self) -> Iterator[None]:
        if self._forward is not None:
            yield
            return
        if not self._records():
            self._finished = None
            yield
            return
        self._forward = _Forward()
        try:
            yield
        finally:
            self._finished, self._forward = self._forward, None

    def _finish_call(self, index: int, inputs: Any, outputs: Any) -> None:
        if self._forward is not None:
            self._forward.record(index, inputs, outputs)

    # ------------------------------------------------------------------ the step

    def _armed(self, tally: Any) -> Any:
        assert self.layout is not None
        start, _ = self.layout.fields()["armed"]
        return tally[start] > 0

    def vector(self, steps: Any, tally: Any) -> Any:
        """The step's vector (see :func:`~._forward_device.step_vector`) from the forward pass just run, made
        only when the step is due (a ``cond`` on TensorFlow and JAX; on torch the host decides). Under
        ``host_schedule``: made without a ``cond`` in a train function traced while ``recording``, ``None``
        (no op at all) in the others."""
        assert self.layout is not None
        forward, self._finished = self._finished, None
        events = forward.events if forward is not None else []
        layers = self.layout.layers
        backend = keras.backend.backend()
        if self.host_schedule and backend != "torch":
            return self._host_vector(events, layers, backend)
        if backend == "torch":
            due = self._torch_due()
            self._host_steps += 1
            if not due:
                return None
            with _no_grad():
                return device.step_vector(events, layers, 2.0 if self._host_armed else 1.0)
        if backend == "tensorflow" and _replicas() > 1:
            # tf.distribute runs each replica's forward pass in a thread of its own: the events of one
            # pass are not told apart from another's, so nothing is traced (the gradient forensics still are).
            return ops.convert_to_tensor(device.not_traced(layers))
        if backend == "jax":
            events = [(i, [ops.stop_gradient(t) for t in outs], [j if isinstance(j, int) else
                                                                   ops.stop_gradient(j) for j in ins])
                      for i, outs, ins in events]
        armed = self._armed(tally)
        due = ops.logical_or(ops.equal(ops.mod(steps, self.every), 0), armed)
        kind = ops.where(armed, 2.0, 1.0)
        return ops.cond(due, lambda: device.step_vector(events, layers, kind),
                        lambda: ops.convert_to_tensor(device.not_traced(layers)))

    def _host_vector(self, events: list[Any], layers: int, backend: str) -> Any:
        """Under ``host_schedule``: the vector of a step traced by choice, with no ``cond``; ``None`` (no op
        at all) in a train function traced without ``recording``."""
        self._vectors, self._jax_vector = {}, None  # nothing of another trace is picked up by this one
        if not self.recording:
            return None
        if backend == "tensorflow" and _replicas() > 1:
            return None  # as without host_schedule: nothing traced under several replicas
        if backend == "jax":
            events = [(i, [ops.stop_gradient(t) for t in outs], [j if isinstance(j, int) else
                                                                   ops.stop_gradient(j) for j in ins])
                      for i, outs, ins in events]
        return device.step_vector(events, layers, self.kind)

    def fold(self, tally: Any, vector: Any, finite: Any, steps: Any) -> Any:
        """The new tally after a step (in a ``cond``: a step neither traced nor skipped changes nothing;
        under ``host_schedule`` a step without a vector is left out, a traced one folds unconditionally)."""
        assert self.layout is not None
        layout = self.layout
        if self.host_schedule:
            return tally if vector is None else device.fold(tally, vector, finite, steps, layout)
        if vector is None:
            vector = ops.convert_to_tensor(device.not_traced(layout.layers))
        changed = ops.logical_or(vector[0] > 0, ops.logical_not(finite))
        return ops.cond(changed, lambda: device.fold(tally, vector, finite, steps, layout), lambda: tally)

    def commit_tf(self, vector: Any, finite: Any, steps: Any) -> None:
        """TensorFlow: assign the new tally in a ``tf.cond``, so an ordinary step assigns nothing (under
        ``host_schedule``: unconditionally when the step was traced, else nothing at all)."""
        import tensorflow as tf

        assert self.layout is not None
        layout = self.layout
        if self.host_schedule:
            if vector is not None:
                self.variable.assign(device.fold(self.variable.value, vector, finite, steps, layout))
            return
        if vector is None:
            vector = tf.constant(device.not_traced(layout.layers))

        def commit() -> Any:
            self.variable.assign(device.fold(self.variable.value, vector, finite, steps, layout))
            return tf.constant(True)

        tf.cond(tf.logical_or(vector[0] > 0, tf.logical_not(finite)), commit, lambda: tf.constant(False))

    def host_fold(self, vector: Any, applied: bool, steps: Any) -> None:
        """torch: fold eagerly, only on a traced or a skipped step (both known on the host)."""
        self._host_armed = not applied and vector is None
        if vector is None and applied:
            return
        assert self.layout is not None
        with _no_grad():
            if vector is None:
                vector = ops.convert_to_tensor(device.not_traced(self.layout.layers))
            self.variable.assign(device.fold(self.variable.value, vector, ops.convert_to_tensor(applied),
                                             steps, self.layout))

    # TensorFlow and torch: the vector kept from scale_loss to apply, by graph (TensorFlow traces).
    def keep(self, key: Any, vector: Any) -> None:
        self._vectors = {key: vector}

    def take(self, key: Any) -> Any:
        return self._vectors.pop(key, None)

    # JAX: the vector leaves value_and_grad through the backward pass of a custom_vjp identity.
    def carry(self, loss: Any, vector: Any) -> Any:
        if self._probe is None:
            self._probe = _jax_carrier(self._keep_jax)
        self._jax_vector = None
        return self._probe(loss, vector)

    def _keep_jax(self, vector: Any) -> None:
        self._jax_vector = vector

    def take_jax(self) -> Any:
        vector, self._jax_vector = self._jax_vector, None
        return vector

    # ------------------------------------------------------------------ reading

    def read(self) -> dict[str, Any] | None:
        """The interval's trace as NumPy fields (see :func:`~._forward_device.decode`) plus ``layers`` and
        ``dtypes``; the interval's fields start afresh. One host read; ``None`` when off."""
        if not self.active:
            return None
        assert self.layout is not None
        host = np.asarray(ops.convert_to_numpy(self.variable.value), "float32")
        fresh = self.layout.zeros()
        kept = host.copy()
        kept[:self.layout.reset_until] = fresh[:self.layout.reset_until]
        self.variable.assign(kept)
        fields = device.decode(host, self.layout)
        fields["layers"], fields["dtypes"] = self.layers, self.dtypes
        return fields


def _replicas() -> int:
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    return 1 if context is None else int(context.num_replicas_in_sync)


def _creation_scope() -> Any:
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


def _no_grad() -> Any:
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _jax_carrier(keep: Callable[[Any], None]) -> Callable[[Any, Any], Any]:
    """``carrier(loss, vector) == loss``; its backward pass hands ``keep`` the vector (a value of the step's
    own trace, see ``backend_steps._jax_loss_probe``) and passes the cotangent through unchanged."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def carrier(loss: Any, vector: Any) -> Any:
        return loss

    def forward(loss: Any, vector: Any) -> tuple[Any, Any]:
        return loss, vector

    def backward(vector: Any, cotangent: Any) -> tuple[Any, Any]:
        keep(vector)
        return cotangent, jnp.zeros_like(vector)

    carrier.defvjp(forward, backward)
    return carrier


def judged_dtype(dtypes: tuple[str, ...]) -> str:
    """The half type the activations are judged against: ``bfloat16`` when the layers compute in it, else
    ``float16`` (also for a float32 model: the question is then whether float16 would fit)."""
    return "bfloat16" if "bfloat16" in dtypes and "float16" not in dtypes else "float16"


def activation_arguments(fields: dict[str, Any]) -> dict[str, Any]:
    """:meth:`ForwardTrace.read`'s fields as the arguments of the core's ``ActivationTrace``: the ring of
    the last traced steps (oldest first); when the interval saw a non-finite activation, the ring as it
    stood before the first such step and that step, its producer and the layers that passed it on."""
    layers = tuple(fields["layers"])
    producer_index = int(fields["first_producer"][0])
    if fields["nonfinite"][0] > 0:
        ring, ring_steps = fields["first_ring"], fields["first_ring_steps"]
        extra_steps, extra = [int(fields["first_step"][0])], [fields["first_max"]]
    else:
        ring, ring_steps, extra_steps, extra = fields["ring"], fields["ring_steps"], [], []
    order = [i for i in np.argsort(ring_steps, kind="stable") if ring_steps[i] >= 0]
    steps = tuple(int(ring_steps[i]) for i in order) + tuple(extra_steps)
    rows = [ring[i] for i in order] + extra
    maxima = np.asarray(rows, "float64").reshape(len(steps), len(layers))
    called = [i for i in range(len(layers)) if not (maxima[:, i] < 0).all() or not len(steps)]
    if len(called) < len(layers):  # layers never called (a fused path inside their parent) are left out
        maxima, layers = maxima[:, called], tuple(layers[i] for i in called)
    seen = producer_index >= 0 and fields["nonfinite"][0] > 0
    producer = tuple(fields["layers"])[producer_index] if seen else None
    passed_on = tuple(name for name, value in zip(fields["layers"], fields["first_max"], strict=True)
                      if producer is not None and name != producer and not np.isfinite(value))
    return {"layers": layers, "steps": steps, "maxima": maxima, "producer": producer,
            "producer_step": int(fields["first_step"][0]) if producer is not None else None,
            "passed_on": passed_on,
            "producer_counts": {name: int(c) for name, c in
                                zip(fields["layers"], fields["produced"], strict=True) if c},
            "traced": int(fields["traced"][0]), "dtype": judged_dtype(tuple(fields["dtypes"]))}
