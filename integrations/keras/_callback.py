"""``LossScaleCallback``: loss scaling on the core for ``model.fit``, with its metrics in ``logs``.

It puts our optimizer in the model's place (:func:`~lossscale_callbacks.keras._optimizer.wrap`, beside the
optimizer) and drives the parts of ``fit``'s step chosen on the host, JAX's headroom sample and the forward
trace on TensorFlow and JAX (:mod:`~lossscale_callbacks.keras._fit_sampling`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import keras

from lossscale_callbacks import METRIC_NAMES, LoggingLoop
from lossscale_callbacks.integration import (
    COUNT_METRICS,
    SCALE,
    SKIPPED_STEPS,
    ActivationTrace,
    LoggingArgs,
    Policy,
    Snapshot,
    carry,
    check_bool,
    check_int,
    check_known,
    check_policy,
    interval_args,
    logging_args,
)
from lossscale_callbacks.keras._config import record_in_compile_config
from lossscale_callbacks.keras._fit_sampling import FitSampling
from lossscale_callbacks.keras._forensics_wiring import check_diagnose_settings
from lossscale_callbacks.keras._forward_trace import activation_arguments
from lossscale_callbacks.keras._ledger import KerasLedger
from lossscale_callbacks.keras._optimizer import LossScaleOptimizer, wrap
from lossscale_callbacks.keras._variable_reads import LiveVariables

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

# What Keras' progress bar shows unless log_metrics= asks for more (and for History/CSVLogger).
QUIET_METRICS: tuple[str, ...] = (SCALE, SKIPPED_STEPS)


class LossScaleCallback(keras.callbacks.Callback):
    """Run ``fit`` with the core's loss scaling and see the scale in every Keras logger.

    When ``fit()`` hands it the model it installs a :class:`~lossscale_callbacks.keras.LossScaleOptimizer`
    around the compiled optimizer, or in place of the ``keras.optimizers.LossScaleOptimizer`` Keras
    adds under ``mixed_float16`` (carrying over its scale and counter), and rebuilds the train
    function; a model compiled with our optimizer is left as it is. In a custom loop driven through
    ``keras.callbacks.CallbackList`` nothing is installed: ``model.optimizer`` must be our optimizer.
    Every ``log_every`` optimizer steps (or at each epoch's end, with ``every="epoch"``) it reads the
    state once (the only host read it adds) and hands it to its
    :class:`~lossscale_callbacks.LoggingLoop`. **Put it before** the callbacks that read ``logs``
    (``TensorBoard``, ``CSVLogger``, ``EarlyStopping``, W&B's): Keras passes one ``logs`` dict down the
    list. Saving, CSV columns and the cost are on the documentation's "Keras" page.

    Args:
        log_every: every this many optimizer steps (the optimizer's iterations, skipped steps included,
            counted on the host across epochs and ``fit`` calls), as for
            :class:`~lossscale_callbacks.LoggingLoop`; with ``steps_per_execution > 1``, after each
            execution that passed a multiple. Default 100; not with ``every``.
        every: ``"epoch"``: at the end of each epoch instead (no read in the epoch).
        policy: the core policy of the installed optimizer. Default: Keras' own scale settings when
            replacing its LossScaleOptimizer, else ``DynamicPolicy()``.
        **logging: the shared logging arguments (``tensorboard=``, ``wandb=``, ``sinks=``,
            ``health=``, ``echo=``), handed to :class:`~lossscale_callbacks.LoggingLoop` as given (see
            its Args); a ``"stop"`` health rule sets ``model.stop_training``.
        log_metrics: ``None`` (default): ``loss_scale/scale`` and ``loss_scale/skipped_steps`` in the
            batch ``logs`` only (the progress bar shows them; History and CSVLogger do not). Otherwise
            the metrics go into the batch and the epoch ``logs``: ``True`` (all of
            ``lossscale_callbacks.METRIC_NAMES``), ``False`` (none; the sinks still get them) or names
            from ``METRIC_NAMES``.
        diagnose: overflow forensics on every Keras backend (``True`` or ``"every_step"``): skip
            causes, the layer where each overflow started and a gradient histogram go to the sinks,
            the health warnings and the summary. No host read is added to the step.
        headroom_every: optimizer steps between float16 headroom samples with ``diagnose``.
        trace_every: with ``diagnose``, optimizer steps between traced forward passes (per layer the
            largest ``|output|`` and the layer that first produced a non-finite activation, on the
            device; in ``fit`` on TensorFlow and JAX the traced steps run a train function of their own,
            so the others carry nothing of it: the "Keras" page says when the device schedules them).
            ``diagnose="every_step"`` traces every step; ``None``: none.
        check_alignment: run the Tensor Core alignment checker once at the first
            ``on_train_begin``, print its report and write it to the sinks (TensorFlow backend; on
            JAX and torch it warns and training goes on).
        ledger: the ledger of bad steps (the "Which batch" page): ``True`` writes it beside
            ``tensorboard=`` (in memory without it), a folder there: each skipped step with its epoch and
            batch index, cause, scale (read with the state: no read of its own) and, with ``diagnose=``,
            the layers named. No replay: a callback never sees the batch ``fit`` feeds its step.
        unshuffled: ``(rows, batch_size)`` of ``fit``'s NumPy inputs given with ``shuffle=False``: each
            entry then lists its batch's rows too (Keras exposes a shuffled order nowhere).
        replay: not available in Keras ``fit``: ``True`` raises a ``ValueError`` that says why.

    Raises:
        ValueError: an argument is invalid, named (``tensorboard=""``, ``wandb={"mode": "x"}``,
            ``sinks=None``, ``log_every=0``...).
        MissingExtraError: ``tensorboard=``/``wandb=`` without their extra installed.

    Example:
        >>> keras.mixed_precision.set_global_policy("mixed_float16")  # doctest: +SKIP
        >>> model.compile(optimizer="adam", loss="mse")  # doctest: +SKIP
        >>> model.fit(x, y, callbacks=[LossScaleCallback(log_every=100, tensorboard="runs/exp1"),
        ...                            keras.callbacks.CSVLogger("log.csv")])  # doctest: +SKIP
    """

    def __init__(
        self,
        log_every: int | None = None,
        policy: Policy | None = None,
        *,
        every: str | None = None,
        log_metrics: bool | Iterable[str] | None = None,
        check_alignment: bool = False,
        diagnose: bool | str = False,
        headroom_every: int = 1000,
        trace_every: int | None = 100,
        ledger: Any = False,
        unshuffled: tuple[int, int] | None = None,
        replay: bool = False,
        **logging: Unpack[LoggingArgs],
    ) -> None:
        super().__init__()
        self._ledger = KerasLedger(ledger, unshuffled, replay)
        self._tensorboard = logging.get("tensorboard")
        log_every, self.every = interval_args("LossScaleCallback", log_every, every, allowed=("epoch",),
                                              default=(100, None))
        check_policy("policy", policy)
        check_bool("check_alignment", check_alignment)
        self._diagnose = check_diagnose_settings(diagnose, headroom_every)  # the one check of both
        self.diagnose, self.headroom_every = self._diagnose
        self._fit_sampling = FitSampling()  # the headroom samples (JAX) and traced steps (TF, JAX) of fit
        self._live = LiveVariables()  # JAX's fit state, lent to the variables a read reads
        self.trace_every = None if trace_every is None else check_int("trace_every", trace_every)
        self.forward_trace: dict[str, Any] | None = None  # the last interval's forward trace (NumPy fields)
        # The default shows on the progress bar only; a choice of the user's also enters epoch logs.
        self.log_metrics = QUIET_METRICS if log_metrics is None else _chosen_metrics(log_metrics)
        self._epoch_metrics = () if log_metrics is None else self.log_metrics
        # Every argument of the sinks and the interval is checked here, the extras required here.
        self.loop = LoggingLoop(policy, log_every=log_every, stop=self._stop,
                                **logging_args("LossScaleCallback", logging))
        if check_alignment and keras.backend.backend() == "tensorflow":
            importlib.import_module("lossscale_callbacks.keras._alignment")  # fails now, not in fit()
        self.policy = policy
        self.check_alignment = check_alignment
        self.optimizer: LossScaleOptimizer | None = None
        self.alignment_report: Any = None
        self._primed = False
        self._steps = 0  # the optimizer steps attempted, counted on the host (a read at each fit's start)
        self._epoch_start = 0  # ... when the epoch began

    @property
    def log_every(self) -> int | None:
        """The optimizer steps per interval (``None`` with ``every="epoch"``); the loop holds it."""
        return self.loop.log_every

    @property
    def summary(self) -> str | None:
        """The summary of the last ``fit()`` (``None`` before one ended)."""
        return self.loop.summary

    # ---- installation ----

    def _install(self) -> LossScaleOptimizer:
        model = self.model
        current = getattr(model, "optimizer", None)
        if current is None:
            raise ValueError("LossScaleCallback needs a compiled model: call model.compile(optimizer=...) "
                             "first")
        if isinstance(current, LossScaleOptimizer):
            if self.diagnose and current.forensics is None:
                with _strategy_scope(model):
                    current._configure_forensics(self._diagnose)
                    current.watch(model)
                    self._trace(current, model)
                model.make_train_function(force=True)  # the step now carries the forensics
            if self.policy is not None and current.policy != self.policy:
                warnings.warn(
                    f"[lossscale-callbacks] the model's LossScaleOptimizer already runs {current.policy}; "
                    f"LossScaleCallback(policy={self.policy}) is ignored", stacklevel=3)
            return current
        if not getattr(model, "compiled", False):
            # A custom loop calls its own optimizer object: replacing model.optimizer would
            # leave the loop untouched and the callback reading an optimizer that never steps.
            raise ValueError(
                "LossScaleCallback outside compile()/fit() needs model.optimizer to be a "
                "lossscale_callbacks.keras.LossScaleOptimizer that the loop steps, got "
                f"{type(current).__name__}"
            )
        with _strategy_scope(model):
            ours = wrap(current, self.policy)
            if self.diagnose:
                ours._configure_forensics(self._diagnose)
                ours.watch(model)
                self._trace(ours, model)
            if model.built and model.trainable_variables:
                ours.build(model.trainable_variables)
        model.optimizer = ours
        record_in_compile_config(model, ours)  # what model.save() names (see keras.config)
        # fit() made (but has not traced) the train function for the old optimizer.
        model.make_train_function(force=True)
        return ours

    def _trace(self, optimizer: LossScaleOptimizer, model: keras.Model) -> None:
        if self.trace_every is not None:
            optimizer.set_forward_trace(model, 1 if self.diagnose == "every_step" else self.trace_every)

    # ---- reading ----

    def _reading(self) -> Any:
        """The block in which the callback reads (and assigns) the optimizer's variables. On JAX, ``fit``
        keeps the variables' values in its own state during an epoch: they are lent to the variables for
        the block, without syncing every variable of the model back (see
        :mod:`~lossscale_callbacks.keras._variable_reads`). ``self._model``: ``self.model`` would sync."""
        return self._live.lent(self._model)

    def _read_state(self) -> Any:
        """The state read (one transfer), carrying the skip truth's outcomes since the previous read and
        the ledger, which took the interval's bad steps from them (with ``forensics`` when given). Within
        :meth:`_reading`."""
        assert self.optimizer is not None
        state, outcomes = self.optimizer.read_state_and_outcomes()
        return carry(state, outcomes=outcomes, ledger=self._ledger.book)

    def _take_bad_steps(self, state: Any, forensics: Any) -> None:
        """The ledger's entries of the read ``state`` carried (its outcomes), with the interval's layers."""
        if self._ledger.on:
            self._ledger.record(state.outcomes, forensics)

    def _observe(self, logs: dict[str, Any] | None, names: tuple[str, ...]) -> Snapshot:
        """One host read of the state, through the logging loop; the metrics ``names`` into ``logs``."""
        assert self.optimizer is not None
        with self._reading():
            state = self._read_state()
            forensics = self._forensics(state)
        self._take_bad_steps(state, forensics)
        snapshot = self.loop.observe(state, forensics=forensics)
        if logs is not None and names:
            metrics = snapshot.metrics()
            logs.update({name: _Count(metrics[name]) if name in COUNT_METRICS else metrics[name]
                         for name in names})
        return snapshot

    def _forensics(self, state: Any) -> Any:
        """The interval's gradient forensics, with the forward trace's activations (one read each)."""
        assert self.optimizer is not None
        forensics = self.optimizer.read_forensics(state)
        fields = self.optimizer.read_forward_trace()
        if fields is not None:
            self.forward_trace = fields
            if forensics is not None:
                trace = ActivationTrace(**activation_arguments(fields))
                forensics = dataclasses.replace(forensics, activations=trace)
        return forensics

    def _stop(self) -> None:
        self.model.stop_training = True

    # ---- Keras hooks ----

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        # fit() hands the model to every callback before any on_train_begin: installing here
        # means BackupAndRestore restores into our optimizer wherever it stands in the list.
        if getattr(model, "compiled", False) and getattr(model, "optimizer", None) is not None:
            self.optimizer = self._install()

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.optimizer = self._install()  # no-op when set_model installed it already
        # Each fit() is a run of the loop: its own W&B run and event file, the optimizer's policy.
        self.loop.start(policy=self.optimizer.policy, writer=_is_chief(self.model))
        self._live.forget()  # the model's variables are indexed again at the fit's first read
        if self._ledger.on:
            self._ledger.start(self._tensorboard)
        self._primed = False
        self._fit_sampling.begin(self.optimizer, self._model)
        if self.check_alignment and self.alignment_report is None:
            self._run_alignment_check()

    def _run_alignment_check(self) -> None:
        try:
            from lossscale_callbacks.keras._alignment import check_alignment

            self.alignment_report = check_alignment(self.model)
        except (ImportError, ValueError) as exc:
            if keras.backend.backend() == "tensorflow":
                raise
            # Training goes on: the check is an extra, and its limits are not the run's fault.
            warnings.warn(f"[lossscale-callbacks] check_alignment=True skipped: {exc}", UserWarning,
                          stacklevel=3)
            self.alignment_report = False  # not asked again at the next fit()
            return
        self.loop.report_alignment(self.alignment_report.to_markdown())

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        # The count is the optimizer's steps, on the host: one read at the first epoch of each fit (after
        # every on_train_begin: BackupAndRestore restores there) gives where it starts and the baseline of
        # the first interval; then each batch is one step.
        if not self._primed:
            with self._reading():
                state = self._read_state()
            self._take_bad_steps(state, None)  # skipped steps since the last read (a custom loop's, a resume)
            self._steps = int(state.steps)
            self.loop.resume_at(self._steps, lambda: state)
            self._primed = True
        self._epoch_start = self._steps
        if self._ledger.on:
            self._ledger.epoch_begin(epoch, self._steps)
        self._fit_sampling.new_epoch()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # ``self._model``, not ``self.model``: on JAX the property syncs every variable of the model back
        # from fit's state (and fit then re-reads them all), which cost 10 % of a small model's step on the
        # CPU and 25 % on an H100 when it ran at every batch.
        self._fit_sampling.before_batch(self._model)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._fit_sampling.after_batch(logs)
        # ``batch`` is the index in the epoch of the last batch run: with steps_per_execution=k Keras
        # reports every k-th, and the loop's rule logs when the execution passed a multiple of log_every.
        self._steps = self._epoch_start + batch + 1
        if self.every is None and self.loop.due(self._steps):
            self._observe(logs, self.log_metrics)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        # Read at the epoch's end when that is the interval, or when the epoch logs are to carry metrics.
        if self.every == "epoch" or self._epoch_metrics:
            self._observe(logs, self._epoch_metrics)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        assert self.optimizer is not None
        with self._reading():  # fit has synced its state at the epoch's end: nothing is lent here
            state = self._read_state()
            last = self.loop.last
            unread = self.optimizer.forensics is not None and (last is None or int(state.steps) != last.step)
            forensics = self._forensics(state) if unread else None
        if unread:
            self.loop.observe(state, forensics=forensics)
        self._take_bad_steps(state, forensics)
        self._fit_sampling.end(self._model)
        self.loop.finish(state)  # the summary (the ledger's lines in it); tensorboard=/wandb= sinks closed


class _Count(float):
    """A count in Keras' ``logs``: a number to every consumer (History, TensorBoard), written as an
    integer by the progress bar, which formats every value as ``{:.4e}`` or ``{:.4f}``
    (``skipped_steps: 0.0000e+00``), and by ``CSVLogger``, as the ``int`` it was before. Keras divides
    a value by its count of 1 before formatting."""

    def __truediv__(self, other: Any) -> Any:
        quotient = float(self) / other
        return _Count(quotient) if other == 1 else quotient

    def __format__(self, spec: str) -> str:
        return str(int(self)) if float(self).is_integer() else float(self).__format__(spec)

    def __repr__(self) -> str:
        return str(int(self)) if float(self).is_integer() else float.__repr__(self)

    __str__ = __repr__


def _strategy_scope(model: keras.Model) -> Any:
    """The model's ``tf.distribute`` scope on TensorFlow; nothing to enter elsewhere."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _is_chief(model: keras.Model) -> bool:
    """Whether this process writes the sinks: the chief worker (TensorFlow) or JAX process 0."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None:
        return bool(getattr(strategy.extended, "should_checkpoint", True))
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index() == 0
    return True


def _chosen_metrics(log_metrics: bool | Iterable[str]) -> tuple[str, ...]:
    if log_metrics is True:
        return METRIC_NAMES
    if log_metrics is False:
        return ()
    if isinstance(log_metrics, str) or not isinstance(log_metrics, Iterable):
        raise ValueError(f"log_metrics must be True, False or names from {list(METRIC_NAMES)}, "
                         f"got {log_metrics!r}")
    names = tuple(log_metrics)
    check_known("log_metrics", names, METRIC_NAMES, what="metric")
    return names


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "fit_sampling": """
    >>> sampling = FitSampling()
    >>> sampling.active
    False
""",
}
