"""``Fp8ScaleCallback``: the scales of Keras' fp8 layers in ``fit``, on the dashboards and under the rules."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import keras

from lossscale_callbacks import LoggingLoop
from lossscale_callbacks.integration import (
    LoggingArgs,
    check_int,
    interval_args,
    logging_args,
    sampled_within,
)
from lossscale_callbacks.keras._callback import _is_chief, _strategy_scope
from lossscale_callbacks.keras._fit_sampling import _second_train_function
from lossscale_callbacks.keras._fp8 import LAG, Fp8Layers

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["Fp8ScaleCallback"]


class Fp8ScaleCallback(keras.callbacks.Callback):
    """Watch the per-tensor scales of a model's fp8 layers during ``fit``: amax, scale, saturated and
    underflowed values per layer and role, on the dashboards and under the health rules.

    For a model quantized with ``model.quantize("float8")`` (or built with ``dtype="float8_from_float32"``):
    its ``Dense`` and ``EinsumDense`` layers scale their input, kernel and output gradient with Keras'
    delayed scaling (an amax history of 1,024 steps unless the dtype policy says otherwise). Every
    ``log_every`` optimizer steps the callback reads the layers' own scales and histories once, rebuilds
    every step's amax and scale from them (``log_every`` must stay under the history's length minus 2),
    and hands the read to its :class:`~lossscale_callbacks.LoggingLoop`: the ``fp8/<layer>/<role>/...``
    metrics, the fp8 rules (a saturated cast, a zero amax or a non-finite scale, a scale left coarse by an
    outlier, a stale history after a checkpoint load) and the summary. How many values a cast clipped or
    flushed to zero is counted on the device every ``count_every`` steps: ``fit`` runs a train function of
    its own for those steps, and the others run as without the callback (on JAX but for one identity per
    layer). Nothing is read from the device inside a step, and ``fit`` does not wait for a step to end
    because of the callback: the read after a step that ends an interval runs when the next step starts,
    before it (after the epoch's last step: at the epoch's end, after validation and after the epoch-end
    hooks of the callbacks listed before it). Only with a ``"stop"`` rule does it read
    at the step's end, so that ``fit`` stops after that very step; Keras then waits for every step's logs
    on JAX and torch, as for any callback with a batch-end hook. The page "FP8: reading the scales" of the
    documentation explains each number.

    The counts live in one more variable per fp8 layer (not saved with its weights), which the optimizer
    stores as Keras stores the fp8 scales: before the first step of the first ``fit`` the optimizer is
    rebuilt once to know it (a fresh one, from its own config). A model that has trained already keeps
    its optimizer: then the steps are not counted, and everything read from the histories still is.

    Args:
        log_every: the interval of :class:`~lossscale_callbacks.LoggingLoop`, in optimizer steps (>= 1;
            at most the history's length minus 2).
        count_every: optimizer steps between counted steps (>= 1; 1 counts every step).
        **logging: the shared logging arguments (``tensorboard=``, ``wandb=``, ``sinks=``, ``health=``,
            ``echo=``), handed to :class:`~lossscale_callbacks.LoggingLoop` as given; a ``"stop"`` rule sets
            ``model.stop_training``.

    Raises:
        ValueError: an argument is invalid, named.
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra installed.

    Example:
        >>> model.quantize("float8")  # doctest: +SKIP
        >>> model.compile(optimizer="adam", loss="mse")  # doctest: +SKIP
        >>> monitor = Fp8ScaleCallback(log_every=100, tensorboard="runs/fp8")  # doctest: +SKIP
        >>> model.fit(x, y, callbacks=[monitor])  # doctest: +SKIP
    """

    def __init__(self, log_every: int = 100, count_every: int = 100, **logging: Unpack[LoggingArgs]) -> None:
        super().__init__()
        log_every, _ = interval_args("Fp8ScaleCallback", log_every, None)  # no interval but the count
        self.count_every = check_int("count_every", count_every)
        self.loop = LoggingLoop(None, log_every=log_every, stop=self._stop,
                                **logging_args("Fp8ScaleCallback", logging))
        self.log_every: int = self.loop.log_every
        self.layers = Fp8Layers(self.count_every)
        self._counting_ok = False
        self._made: Any = None  # the train function Keras made; _ordinary runs it (see _stepping)
        self._ordinary: Any = None
        self._counting: Any = None
        self._step = 0
        self._per_execution = 1
        self._read_at: int | None = None
        self._ran = False  # a train function returned and its steps were not counted yet (_stepping)
        if self.loop.may_stop:
            # A "stop" rule stops fit at the step its read found the problem: the read at each step's
            # end. Otherwise the callback has no batch-end hook, so that Keras (JAX, torch) dispatches
            # the next step without waiting for this one (its CallbackList waits for every step's logs
            # while a callback overrides on_train_batch_end); the read then runs at the next step's start.
            self.on_train_batch_end = self._after_step

    @property
    def summary(self) -> str | None:
        """The summary of the last ``fit()`` (``None`` before one ended)."""
        return self.loop.summary

    def _stop(self) -> None:
        self.model.stop_training = True

    # ---- installation ----

    def _install(self, model: keras.Model) -> None:
        """Watch the model's fp8 layers; let a fresh optimizer know their tallies (see the class)."""
        had = {id(v) for v in model.trainable_variables}
        self.layers.watch(model)
        if not self.layers.layers:
            warnings.warn("[lossscale-callbacks] Fp8ScaleCallback found no fp8 layer in the model (quantize "
                          "it with model.quantize('float8') before fit)", UserWarning, stacklevel=3)
            return
        if keras.backend.backend() == "torch":
            for layer in model._flatten_layers():  # as Keras' own quantize() re-tracks torch_params
                layer._track_variables()
        optimizer = getattr(model, "optimizer", None)
        new = [v for v in model.trainable_variables if id(v) not in had]
        if optimizer is None or not new or not getattr(optimizer, "built", False):
            self._counting_ok = True
            return
        wrapped = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if int(optimizer.iterations.numpy()) > 0 or wrapped:
            warnings.warn(
                "[lossscale-callbacks] Fp8ScaleCallback: the model's optimizer has trained already (or wraps "
                "another), so the fp8 casts' saturated and underflowed values are not counted in this fit "
                "(the amaxes, scales and findings read from the histories are); add the callback to the "
                "first fit to count them.", UserWarning, stacklevel=3)
            self.layers.counting_enabled = False
            return
        with _strategy_scope(model):
            fresh = type(optimizer).from_config(optimizer.get_config())
            fresh.build(model.trainable_variables)
        model.optimizer = fresh  # the same class and config: what compile() recorded still names it
        model.make_train_function(force=True)
        self._counting_ok = True

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if getattr(model, "compiled", False) and not self.layers.layers:
            self._install(model)

    # ---- reading ----

    def _optimizer_steps(self) -> int:
        optimizer = getattr(self._model, "optimizer", None)
        return int(optimizer.iterations.numpy()) if optimizer is not None else 0

    def _read(self) -> Any:
        self._read_at = self._step
        return self.layers.read(self._step, self._model)

    # ---- Keras hooks ----

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.layers.layers:
            self._install(self.model)
        self.layers.new_fit()
        self.loop.start(writer=_is_chief(self.model))
        sync = getattr(self._model, "jax_state_sync", None)
        if keras.backend.backend() == "jax" and callable(sync):
            sync()
        self._step = self._optimizer_steps()
        self._per_execution = int(getattr(self._model, "steps_per_execution", 1) or 1)
        length = self.layers.history_length
        if length is not None and self.log_every > length - LAG - 1:
            warnings.warn(f"[lossscale-callbacks] Fp8ScaleCallback(log_every={self.log_every}) reads the "
                          f"amax histories less often than they turn over ({length} steps): the steps "
                          f"between are not rebuilt; use log_every <= {length - LAG - 1}", UserWarning,
                          stacklevel=2)
        # The baseline of the histories (the first read of a fit): a history loaded since the last read
        # (a checkpoint) is found here, before the first step trains on it.
        read = self._read()
        if any(t.replaced_after is not None for t in read.tensors):
            self.loop.observe(None, fp8=read)
        self.loop.restart_interval(self._step)
        self._ran = False

    def _follow(self, current: Any) -> None:
        """``current``, the model's train function, is one Keras made afresh (a first fit, a compile): it
        runs through :meth:`_stepping`, and the counting function is made again when next due. The one
        :meth:`on_train_end` put back is not new: a later ``fit`` keeps both (no trace again)."""
        if all(current is not known for known in (self._made, self._ordinary, self._counting)):
            self._made, self._ordinary, self._counting = current, self._stepping(current), None

    def _stepping(self, function: Any) -> Any:
        """``function`` that marks a step as run when it returns. Keras begins a batch before its train
        function finds data of unknown length exhausted (it then raises, and no step ran): counted by the
        batch's start, that batch shifted every later read by a step against the histories."""
        def stepping(*args: Any, **kwargs: Any) -> Any:
            out = function(*args, **kwargs)
            self._ran = True
            return out
        return stepping

    def _counted(self, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.layers.counting = True  # while it traces (TensorFlow, JAX) or runs (torch)
            try:
                return function(*args, **kwargs)
            finally:
                self.layers.counting = False
        return counted

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._after_step()  # the step before this one, when nothing waited for its end
        model = self._model
        current = model.train_function
        self._follow(current)
        want = self._ordinary
        if (self._counting_ok and self.layers.counting_enabled
                and sampled_within(self._step + 1, self._per_execution, self.count_every)):
            if self._counting is None:
                self._counting = self._stepping(self._counted(_second_train_function(model)))
            want = self._counting
        if current is not want:  # a Keras model's attribute assignment goes through its tracker: only if due
            model.train_function = want

    def _after_step(self, batch: int | None = None, logs: dict[str, Any] | None = None) -> None:
        """A train function returned since the last call: count its steps, and read when an interval
        ended. Called at the next step's start, at the epoch's end and the fit's; and at the step's end
        only with a ``"stop"`` rule (see the class)."""
        if not self._ran:
            return
        self._ran = False
        self._step += self._per_execution
        if self.loop.due(self._step):
            self.loop.observe(None, fp8=self._read())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._after_step()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._after_step()
        if self._made is not None:
            self._model.train_function = self._made
        if self._read_at != self._step:
            self.loop.observe(None, fp8=self._read())
        self.loop.finish()

