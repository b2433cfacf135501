"""``LossScaleCallback``: loss scaling on the core for ``model.fit``, with its metrics in ``logs``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import keras

from lossscale_callbacks.health import HealthMonitor
from lossscale_callbacks.keras.optimizer import LossScaleOptimizer, wrap
from lossscale_callbacks.metrics import MetricsTracker, Snapshot
from lossscale_callbacks.policy import DynamicPolicy, FixedPolicy, Policy
from lossscale_callbacks.sinks import GuardedSink, Sink, SinkGroup
from lossscale_callbacks.summary import summarize

SUMMARY_TAG = "loss_scale/summary"
ALIGNMENT_TAG = "loss_scale/alignment"


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
    batches ``WandbMetricsLogger(log_freq=n)`` logs) and at the end of each epoch, the
    callback reads the state once (the only host synchronisation it adds; none happens per
    step), puts the metrics
    (``loss_scale/scale``, ``loss_scale/growth_counter``, ``loss_scale/skipped_steps``,
    ``loss_scale/skipped_in_interval``, ``loss_scale/skip_rate``) into ``logs``, writes them
    to its sinks and applies the health rules. **Put it before** ``TensorBoard``,
    ``CSVLogger``, ``ModelCheckpoint``, ``EarlyStopping``, ``ReduceLROnPlateau`` and W&B's
    Keras callbacks in ``callbacks=[...]``: Keras passes one ``logs`` dict down the list, so
    only the callbacks after it see the metrics. (``BackupAndRestore`` may stand anywhere: the
    optimizer is installed before it restores.) At the end of training it prints a
    one-paragraph summary.

    The sinks' step axis is the number of optimizer steps attempted (skipped ones
    included), ``state.steps``; only the chief worker writes to sinks under
    ``MultiWorkerMirroredStrategy``. Sinks made from ``tensorboard=``/``wandb=`` are opened
    at each ``fit()``'s start and closed at its end (so each ``fit()`` is one W&B run);
    sinks passed in ``sinks=`` belong to the caller and are only flushed.

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
        check_alignment: run the Tensor Core alignment checker once at the first
            ``on_train_begin``, print its report and write it to the sinks.

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
        check_alignment: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
        if policy is not None and not isinstance(policy, (DynamicPolicy, FixedPolicy)):
            raise ValueError(f"policy must be None, a DynamicPolicy or a FixedPolicy, got {policy!r}")
        if tensorboard is not None and not isinstance(tensorboard, (str, os.PathLike)):
            raise ValueError(f"tensorboard must be None or a log directory path, got {tensorboard!r}")
        if not (wandb is None or isinstance(wandb, (bool, Mapping))):
            raise ValueError(f"wandb must be None, a bool, or a dict of wandb.init arguments, got {wandb!r}")
        if not isinstance(check_alignment, bool):
            raise ValueError(f"check_alignment must be True or False, got {check_alignment!r}")
        self.log_every = log_every
        self.policy = policy
        self.tensorboard = tensorboard
        self.wandb = wandb
        self.check_alignment = check_alignment
        self._user_sinks = [GuardedSink(s) for s in sinks]
        self._monitor = HealthMonitor.from_spec(health)
        self.optimizer: LossScaleOptimizer | None = None
        self.tracker: MetricsTracker | None = None
        self.summary: str | None = None
        self.alignment_report: Any = None
        self._sinks = SinkGroup()
        self._owned_sinks: list[Sink] = []
        self._primed = False
        self._is_chief = True
        self._last_batch = -1

    # ---- installation ----

    def _install(self) -> LossScaleOptimizer:
        model = self.model
        current = getattr(model, "optimizer", None)
        if current is None:
            raise ValueError("LossScaleCallback needs a compiled model: call model.compile(optimizer=...) "
                             "first")
        if isinstance(current, LossScaleOptimizer):
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
        with model.distribute_strategy.scope():
            ours = wrap(current, self.policy)
            if model.built and model.trainable_variables:
                ours.build(model.trainable_variables)
        model.optimizer = ours
        # model.save() writes the compile config: it must name our optimizer, or
        # load_model() would rebuild the old one and skip our variables.
        compile_config = getattr(model, "_compile_config", None)
        if compile_config is not None and "optimizer" in getattr(compile_config, "config", {}):
            compile_config.config["optimizer"] = ours
        # fit() made (but has not traced) the train function for the old optimizer.
        model.make_train_function(force=True)
        return ours

    def _close_owned_sinks(self) -> None:
        for sink in self._owned_sinks:
            GuardedSink(sink).close()
        self._owned_sinks = []

    def _open_sinks(self) -> None:
        # A fit() that raised never reached on_train_end: close its sinks (a W&B run) first.
        self._close_owned_sinks()
        owned: list[Sink] = []
        policy = self.optimizer.policy
        bounds = {"min_scale": policy.min_scale, "max_scale": policy.max_scale}
        if self._is_chief and self.tensorboard is not None:
            from lossscale_callbacks.tensorboard import TensorBoardSink

            owned.append(TensorBoardSink(os.fspath(self.tensorboard), **bounds))
        if self._is_chief and self.wandb:
            from lossscale_callbacks.wandb import WandbSink

            init_kwargs = dict(self.wandb) if isinstance(self.wandb, Mapping) else {}
            owned.append(WandbSink(**bounds, **init_kwargs))
        self._owned_sinks = owned
        self._sinks = SinkGroup([*owned, *self._user_sinks] if self._is_chief else [])

    # ---- reading ----

    def _observe(self) -> Snapshot:
        """One host read of the state; new snapshots go to the sinks and the health rules."""
        assert self.optimizer is not None and self.tracker is not None
        host = self.optimizer.read_state()
        last = self.tracker.last
        if last is not None and int(host.steps) == last.step:
            return last
        snapshot = self.tracker.observe(host)
        self._sinks.write(snapshot.step, snapshot.metrics())
        if self._monitor is not None:
            verdicts = self._monitor.observe(snapshot)
            self._monitor.apply(verdicts, stop=self._stop)
        return snapshot

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
        wanted = MetricsTracker.for_policy(self.optimizer.policy)
        if self.tracker is None or self.tracker.min_scale != wanted.min_scale:
            self.tracker = wanted
        self._is_chief = bool(getattr(self.model.distribute_strategy.extended, "should_checkpoint", True))
        self._open_sinks()
        self._primed = False
        if self.check_alignment and self.alignment_report is None:
            self._run_alignment_check()

    def _run_alignment_check(self) -> None:
        from lossscale_callbacks.keras.alignment import check_alignment

        self.alignment_report = check_alignment(self.model)
        markdown = self.alignment_report.to_markdown()
        if self._is_chief:
            print(markdown)
        self._sinks.write_text(ALIGNMENT_TAG, markdown)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._last_batch = -1
        if not self._primed:
            # After every on_train_begin (BackupAndRestore restores there): the baseline
            # of the first interval is the restored state, not zero.
            self._primed = True
            self.tracker.observe(self.optimizer.read_state())

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Keras' own batch index within the epoch, as W&B's WandbMetricsLogger(log_freq=n)
        # counts it, so both log on the same batches. With steps_per_execution=k Keras only
        # reports every k-th index: log when the execution just run covered a multiple of
        # log_every (a plain ``batch % log_every`` would never fire for, e.g., k = log_every).
        previous, self._last_batch = self._last_batch, batch
        if batch // self.log_every == previous // self.log_every:
            return
        snapshot = self._observe()
        if logs is not None:
            logs.update(snapshot.metrics())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        snapshot = self._observe()
        if logs is not None:
            logs.update(snapshot.metrics())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        snapshot = self._observe()
        self.summary = summarize(snapshot, self.optimizer.policy.min_scale)
        if self._is_chief:
            print(self.summary)
        self._sinks.write_text(SUMMARY_TAG, self.summary)
        self._sinks.flush()
        self._close_owned_sinks()
