"""``LossScaleCallback``: loss scaling on the core for ``model.fit``, with its metrics in ``logs``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import keras

from lossscale_callbacks._activations import ActivationTrace
from lossscale_callbacks._validation import check_bool, check_int, check_known
from lossscale_callbacks.forensics import check_diagnose
from lossscale_callbacks.keras._forward_trace import activation_arguments
from lossscale_callbacks.keras.config import record_in_compile_config
from lossscale_callbacks.keras.fit_sampling import FitSampling
from lossscale_callbacks.keras.optimizer import LossScaleOptimizer
from lossscale_callbacks.keras.wrapping import wrap
from lossscale_callbacks.logging_loop import LoggingLoop
from lossscale_callbacks.metrics import METRIC_NAMES, SCALE, SKIPPED_STEPS, Snapshot
from lossscale_callbacks.policy import Policy, check_policy
from lossscale_callbacks.sinks import Sink

# What Keras' progress bar shows unless log_metrics= asks for more (and for History/CSVLogger).
QUIET_METRICS: tuple[str, ...] = (SCALE, SKIPPED_STEPS)


class LossScaleCallback(keras.callbacks.Callback):
    """Run ``fit`` with the core's loss scaling and see the scale in every Keras logger.

    When ``fit()`` hands it the model (``set_model``, before any callback's
    ``on_train_begin``; again on ``on_train_begin`` if the model was recompiled) it installs a
    :class:`~lossscale_callbacks.keras.LossScaleOptimizer`: it wraps the compiled
    optimizer, or replaces the ``keras.optimizers.LossScaleOptimizer`` that Keras adds by
    itself under ``mixed_float16`` (carrying over its current scale and counter), and
    rebuilds ``model.train_function`` so the new optimizer is traced. A model already
    compiled with our optimizer is left as it is. Repeated ``fit()`` calls reuse it. In a
    custom loop driven through ``keras.callbacks.CallbackList`` nothing is installed:
    ``model.optimizer`` must be the :class:`~lossscale_callbacks.keras.LossScaleOptimizer`
    that the loop steps (``ValueError`` otherwise).

    On every ``log_every``-th batch of an epoch (Keras' batch index ``0, n, 2n, ...``, the
    batches ``WandbMetricsLogger(log_freq=n)`` logs; the core's
    :class:`~lossscale_callbacks.logging_loop.LoggingLoop` decides, as for every integration) and
    at the end of each epoch, the callback reads the state once (the only host synchronisation it
    adds; none happens per step) and hands it to that loop, which writes every metric
    (``loss_scale/scale``, ``loss_scale/log2_scale``, ``loss_scale/growth_counter``,
    ``loss_scale/skipped_steps``, ``loss_scale/skipped_in_interval``, ``loss_scale/skip_rate``,
    ``loss_scale/steps``) to the sinks and applies the health rules. By default the progress bar
    shows the scale and the skipped steps (they go into the batch ``logs`` only, so History,
    ``CSVLogger`` and ``EarlyStopping``, which read the epoch ``logs``, get no extra columns);
    ``log_metrics=`` puts the metrics you choose into the batch *and* epoch ``logs`` (counts as
    ints). **Put it before** ``TensorBoard``,
    ``CSVLogger``, ``ModelCheckpoint``, ``EarlyStopping``, ``ReduceLROnPlateau`` and W&B's
    Keras callbacks in ``callbacks=[...]``: Keras passes one ``logs`` dict down the list, so
    only the callbacks after it see the metrics. (``BackupAndRestore`` may stand anywhere: the
    optimizer is installed before it restores.) At the end of training it prints a
    summary with an honest health verdict.

    The sinks' step axis is the number of optimizer steps attempted (skipped ones
    included), ``state.steps``; only the chief worker writes to sinks under
    ``MultiWorkerMirroredStrategy``. The loop opens the sinks of ``tensorboard=``/``wandb=`` at
    each ``fit()``'s start and closes them at its end (so each ``fit()`` is one W&B run; a ``fit()``
    that raised has its sinks closed when the next starts); sinks passed in ``sinks=`` belong to
    the caller and are only flushed. Every argument is checked here, at construction, and so is
    the extra that ``tensorboard=``/``wandb=`` need (``MissingExtraError`` with the pip command),
    never in the middle of ``fit()``.

    ``CSVLogger`` without validation data: Keras' CSVLogger adds a ``val_`` twin of every key in
    the epoch ``logs`` when the first epoch has no ``val_`` key (it keeps room for a validation that
    may come later). With the default ``log_metrics`` ours are not in the epoch ``logs``, so no
    ``val_loss_scale/*`` column appears; with ``log_metrics=`` set and no validation data, each
    chosen metric gets such an ``NA`` twin, as Keras' own ``loss`` does.

    Saving: the loss-scale state is saved with the model (``model.save()``, ``save_weights()``,
    ``ModelCheckpoint``, ``BackupAndRestore``) and checked whole when it is loaded. When the callback
    installed the optimizer (the model was compiled with a Keras optimizer) and the policy is the
    default, or any ``DynamicPolicy`` that only changes ``initial_scale`` and ``growth_interval``, a
    ``.keras`` file names Keras' own ``LossScaleOptimizer``: ``keras.models.load_model()`` in a process
    that never imports this library (a serving job) gets the model compiled with Keras' class, its scale
    and growth counter, and can keep training (Keras' class does not clamp the scale to ``[1, 2**24]``);
    where ``lossscale_callbacks.keras`` is imported the same file comes back with our optimizer and its
    whole state. Any other policy (hysteresis, other bounds or factors, a ``FixedPolicy``), or a model
    compiled with our ``LossScaleOptimizer`` itself, needs this library: ``import
    lossscale_callbacks.keras`` before ``load_model()``, or load with ``compile=False``; without it
    Keras' error says so (and names the policy Keras' class cannot run).

    Cost: the state read happens once per interval. Like any callback with a batch-end hook,
    it makes Keras convert ``logs`` to Python numbers after every batch and dispatch batch ends
    synchronously (``benchmarks/keras_overhead.py`` measures that separately).

    Args:
        log_every: read and log the state on the batches whose index in the epoch is a
            multiple of this (>= 1); with ``steps_per_execution > 1`` Keras only reports the
            last batch of each execution, so the callback logs after every execution that
            ran such a batch.
        policy: the core policy of the installed optimizer. Default: Keras' own scale
            settings when replacing its LossScaleOptimizer, else ``DynamicPolicy()``.
        tensorboard: a log directory: also write to
            ``lossscale_callbacks.tensorboard.TensorBoardSink(log_dir)``.
        wandb: True, or a dict of ``wandb.init`` keyword arguments: also write to
            ``lossscale_callbacks.wandb.WandbSink(**kwargs)``.
        sinks: more :class:`~lossscale_callbacks.sinks.Sink` objects.
        health: health rules: None/False (off), True/"warn", "raise", "stop" (sets
            ``model.stop_training``), or rule objects.
        log_metrics: ``None`` (default): ``loss_scale/scale`` and ``loss_scale/skipped_steps`` in
            the batch ``logs`` only (the progress bar shows them; History and CSVLogger do not get
            them). Otherwise the metrics go into the batch and the epoch ``logs`` (and so the
            progress bar, History, CSVLogger, Keras' TensorBoard, ``EarlyStopping``): ``True`` (all
            of ``lossscale_callbacks.METRIC_NAMES``), ``False`` (none; the sinks still get them) or
            names from ``METRIC_NAMES``.
        diagnose: overflow forensics on the installed optimizer, on every Keras backend (``True`` or
            ``"every_step"``, see :mod:`lossscale_callbacks.forensics`): the skip causes and the
            per-layer counts per interval join the sinks' metrics, the report (why steps were skipped
            and in which layer the overflow started, in plain words) and the gradient histogram go to
            the sinks, the health warnings and the summary name the layer. Layers are named by the
            model's layer objects, in the model's order. No host read is added to the step (on torch
            the step's own read of the skip flag serves them).
        headroom_every: optimizer steps between float16 headroom samples with ``diagnose``.
        trace_every: with ``diagnose``, optimizer steps between traced forward passes (per layer the
            largest ``|output|`` and the layer that produced the first non-finite activation, on the
            device; the step after a skipped untraced one is traced too); ``diagnose="every_step"``
            traces every step; ``None``: no forward trace.
        check_alignment: run the Tensor Core alignment checker once at the first
            ``on_train_begin``, print its report and write it to the sinks (TensorFlow backend,
            whose checker is imported here; on JAX and torch it warns and training goes on).

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
        log_every: int = 100,
        policy: Policy | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
        wandb: bool | Mapping[str, Any] | None = None,
        sinks: Iterable[Sink] = (),
        health: Any = "warn",
        log_metrics: bool | Iterable[str] | None = None,
        check_alignment: bool = False,
        diagnose: bool | str = False,
        headroom_every: int = 1000,
        trace_every: int | None = 100,
    ) -> None:
        super().__init__()
        check_policy("policy", policy)
        check_bool("check_alignment", check_alignment)
        self.diagnose = check_diagnose(diagnose)
        self._fit_sampling = FitSampling()  # JAX: the headroom samples decided on the host
        self.headroom_every = check_int("headroom_every", headroom_every)
        self.trace_every = None if trace_every is None else check_int("trace_every", trace_every)
        self.forward_trace: dict[str, Any] | None = None  # the last interval's forward trace (NumPy fields)
        # The default shows on the progress bar only; a choice of the user's also enters epoch logs.
        self.log_metrics = QUIET_METRICS if log_metrics is None else _chosen_metrics(log_metrics)
        self._epoch_metrics = () if log_metrics is None else self.log_metrics
        # Every argument of the sinks and the interval is checked here, the extras required here.
        self.loop = LoggingLoop(policy, log_every=log_every, tensorboard=tensorboard, wandb=wandb,
                                sinks=sinks, health=health, stop=self._stop)
        if check_alignment and keras.backend.backend() == "tensorflow":
            importlib.import_module("lossscale_callbacks.keras.alignment")  # fails now, not in fit()
        self.log_every = log_every
        self.policy = policy
        self.check_alignment = check_alignment
        self.optimizer: LossScaleOptimizer | None = None
        self.alignment_report: Any = None
        self._primed = False

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
                    current.set_diagnose(self.diagnose, self.headroom_every)
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
                ours.set_diagnose(self.diagnose, self.headroom_every)
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

    def _read_state(self) -> Any:
        # On JAX, fit() keeps the variables' values in its own state during an epoch; a callback
        # that reads variables syncs them back first (Keras' documented way; no copy of the arrays).
        sync = getattr(self.model, "jax_state_sync", None)
        if keras.backend.backend() == "jax" and callable(sync):
            sync()
        assert self.optimizer is not None
        return self.optimizer.read_state()

    def _observe(self, logs: dict[str, Any] | None, names: tuple[str, ...]) -> Snapshot:
        """One host read of the state, through the logging loop; the metrics ``names`` into ``logs``."""
        assert self.optimizer is not None
        state = self._read_state()
        snapshot = self.loop.observe(state, forensics=self._forensics(state))
        if logs is not None and names:
            metrics = snapshot.metrics()
            logs.update({name: metrics[name] for name in names})
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
        self._primed = False
        self._fit_sampling.begin(self.optimizer)
        if self.check_alignment and self.alignment_report is None:
            self._run_alignment_check()

    def _run_alignment_check(self) -> None:
        try:
            from lossscale_callbacks.keras.alignment import check_alignment

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
        # The count is Keras' batch index within the epoch, as W&B's WandbMetricsLogger(log_freq=n)
        # counts it, so both log on the same batches: it starts before batch 0, which logs.
        self.loop.restart_interval(-1)
        if not self._primed:
            # After every on_train_begin (BackupAndRestore restores there): the baseline
            # of the first interval is the restored state, not zero.
            self._primed = True
            self.loop.baseline(self._read_state())

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._fit_sampling.before_batch(self.model)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # With steps_per_execution=k Keras reports only every k-th index: the loop's rule logs when
        # the execution just run passed a multiple of log_every (landing on one is not needed).
        if self.loop.due(batch):
            self._observe(logs, self.log_metrics)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._observe(logs, self._epoch_metrics)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        assert self.optimizer is not None
        state = self._read_state()
        last = self.loop.last
        if self.optimizer.forensics is not None and (last is None or int(state.steps) != last.step):
            self.loop.observe(state, forensics=self._forensics(state))
        self._fit_sampling.end(self.model)
        self.loop.finish(state)  # the summary, and the sinks of tensorboard=/wandb= closed


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
