"""The torch side of the ledger of bad steps: who was in each micro-batch, and the replay of bad steps.

Sample identities, on the host side of the pipeline only (no host read, nothing copied from a device):

* a ``DataLoader``'s index sampler is wrapped so that each batch of indices is recorded as the loader
  takes it (in the main process, before any worker sees it), first in first out: a ``DataLoader``
  delivers its batches in that order (``in_order=False`` is refused, with a warning, and gives no ids);
* a batch's own id field (``ids="idx"``: a mapping's key or an attribute) is read where the batch is
  received: a CPU tensor or a list is host data; a device tensor is kept as it is and read only for a
  bad step, at the log interval;
* positions mapped to a ``datasets`` index column (``column=``), only for bad steps, at the interval.

Each micro-batch the training loop receives (the tracked loader yields it; Lightning's
``on_train_batch_start``; the model's forward in the Transformers Trainer) is filed under the
optimizer step it belongs to; every :meth:`LossScaler.update` ends a step. With ``replay`` on, each
micro-batch also keeps a reference to the batch and the RNG state before its forward until the step
ends (see :mod:`lossscale_callbacks.torch._replay` for what a replay costs and leaves).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from lossscale_callbacks.integration import Ledger, MicroBatch, Replay, SampleTracker, bad_steps, process_rank
from lossscale_callbacks.torch._replay import MicroRecord, StepReplayer, capture_rng

__all__ = ["DEFAULT_REPLAYS", "LedgerCapture", "check_replay", "ledger_capture"]

DEFAULT_REPLAYS = 4  # replays per log interval with replay=True
_QUEUE: Any = object()


def check_replay(replay: Any) -> int:
    """``replay``: ``False`` (off), ``True`` (at most :data:`DEFAULT_REPLAYS` per interval) or an integer
    >= 0, the most bad steps replayed per log interval.

    Raises:
        ValueError: anything else, naming ``replay``.
    """
    if replay is True:
        return DEFAULT_REPLAYS
    if replay is False or replay is None:
        return 0
    if isinstance(replay, int) and not isinstance(replay, bool) and replay >= 0:
        return replay
    raise ValueError(f"replay must be True, False or an integer >= 0 (replays per log interval), got "
                     f"{replay!r}")


class _RecordingIndexSampler:
    """A ``DataLoader``'s index sampler that records each batch of indices as the loader takes it."""

    def __init__(self, inner: Any, capture: LedgerCapture) -> None:
        self.inner = inner
        self._capture = weakref.ref(capture)
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        capture = self._capture()
        epoch = self._passes
        self._passes += 1
        if capture is not None:
            capture.tracker.new_pass()
        for number, indices in enumerate(self.inner):
            if capture is not None:
                capture.tracker.produced(list(indices) if isinstance(indices, (list, tuple)) else [indices],
                                         epoch, number)
            yield indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, sampler, set_epoch: the wrapped one's
        if name in ("inner", "_capture", "_passes"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _innermost_loader(loader: Any) -> torch.utils.data.DataLoader | None:
    """The ``DataLoader`` that iterates the batch sampler, inside framework wrappers (Fabric's
    ``_FabricDataLoader``, Accelerate's ``DataLoaderShard`` around its ``base_dataloader``...)."""
    seen = 0
    while seen < 8:
        base = loader.__dict__.get("base_dataloader") if hasattr(loader, "__dict__") else None
        if isinstance(loader, torch.utils.data.DataLoader) and base is None:
            break
        inner = base or getattr(loader, "_dataloader", None) or getattr(loader, "dataloader", None)
        if inner is None:
            return None
        loader, seen = inner, seen + 1
    return loader if isinstance(loader, torch.utils.data.DataLoader) else None


class _TrackedLoader:
    """The user's loader, yielding the same batches; each one it yields is a received micro-batch."""

    def __init__(self, loader: Any, capture: LedgerCapture) -> None:
        self._loader = loader
        self._capture = capture

    def __iter__(self) -> Iterator[Any]:
        capture = self._capture
        for batch in self._loader:
            capture.on_batch(batch)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("_loader", "_capture"):
            raise AttributeError(name)
        return getattr(self._loader, name)


class LedgerCapture:
    """Sample identities per micro-batch and, with ``replay``, the replay of the bad steps.

    Made and driven by :class:`~lossscale_callbacks.torch.LossScaler` (:meth:`LossScaler.track`) and the
    monitors: :meth:`on_batch` when the loop receives a micro-batch, :meth:`after_update` at the end of
    each ``update()``, :meth:`take` at the log interval for the steps the skip truth says were bad.

    Args:
        replay: replays per log interval (0: off).
        loss_of: the forward and the loss of one micro-batch (needed for replay).
        ids: the batch's id field (a mapping key or attribute), instead of the sampler's indices.
        column: map the sampler's indices through this sequence (a ``datasets`` index column), for
            the bad steps only.
        autocast: the step's autocast ``(device_type, dtype)`` where the integration knows it.
    """

    def __init__(self, *, replay: int = 0, loss_of: Callable[[Any], Any] | None = None,
                 ids: str | None = None, column: Any = None,
                 autocast: tuple[str, torch.dtype] | None = None, directory: Any = None) -> None:
        self.tracker = SampleTracker()
        self.directory = directory
        self.book: Ledger | None = None  # made at the first interval read (the rank is known by then)
        self.replay_budget = replay
        self.loss_of = loss_of
        self.ids = ids
        self.column = column
        self.autocast = autocast
        self.replays: dict[int, Replay] = {}  # step -> what its replay found, until read
        self.notes: dict[int, str] = {}  # step -> why it was not replayed
        self.skipped_on_host: dict[int, bool] = {}  # step -> the host knew it was skipped (replay on)
        self._left = replay
        self._records: list[MicroRecord] = []
        self._replayer: StepReplayer | None = None
        self._scaler: Any = None
        self._hook: Any = None
        self.replay_reads = 0  # host reads replay added (fused optimizers: the step's flag)

    # ------------------------------------------------------------------------------ set-up

    def attach(self, scaler: Any, model: torch.nn.Module | None) -> None:
        """Ride on ``scaler`` (its ``update()`` ends each step); replay needs ``model``."""
        self._scaler = weakref.ref(scaler)
        if self.replay_budget and self.loss_of is not None:
            if model is None:
                raise ValueError("replay needs the model: call scaler.watch(model) first (or give the "
                                 "monitor the module), so the replay knows whose gradients to check")
            self._replayer = StepReplayer(model, self.loss_of, scaler.policy.min_scale, self.autocast)
            if self.autocast is None:
                self._watch_autocast(model)

    def _watch_autocast(self, model: torch.nn.Module) -> None:
        capture = weakref.ref(self)

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            alive = capture()
            if alive is not None and alive._records and alive._replayer is not None:
                device = next(module.parameters(), torch.empty(0)).device.type
                alive._replayer.note_autocast(alive._records[-1], device)

        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_pre_hook(pre_hook)

    def set_autocast(self, device_type: str, dtype: torch.dtype) -> None:
        """The step's autocast, where the integration knows it (a precision plugin's): the replay runs
        under it, then with it off."""
        self.autocast = (device_type, dtype)
        if self._replayer is not None:
            self._replayer.autocast = self.autocast

    @property
    def replaying(self) -> bool:
        """Whether a replay is running now (a monitor's hooks ignore its forward passes)."""
        return self._replayer is not None and self._replayer.replaying

    def track(self, loader: Any) -> Any:
        """``loader``, yielding the same batches, its sampler's indices recorded (a new pass each epoch)."""
        self.watch_sampler(loader)
        return _TrackedLoader(loader, self)

    def watch_sampler(self, loader: Any) -> bool:
        """Record the indices of ``loader``'s index sampler from now on (idempotent); ``False``: none."""
        inner = _innermost_loader(loader)
        if inner is None or isinstance(inner.dataset, torch.utils.data.IterableDataset):
            return False
        if getattr(inner, "in_order", True) is False:
            warnings.warn("[lossscale-callbacks] the ledger cannot tell which samples were in a batch of a "
                          "DataLoader(in_order=False): its batches may come out of order. No sample ids.",
                          UserWarning, stacklevel=3)
            return False
        name = "batch_sampler" if inner.batch_sampler is not None else "sampler"
        current = getattr(inner, name)
        if isinstance(current, _RecordingIndexSampler):
            if current._capture() is self:
                return True
            current = current.inner
        # DataLoader refuses to have its samplers set after construction (its __setattr__); the index
        # sampler is read back through the instance at every iterator (re)start, so set it there.
        inner.__dict__[name] = _RecordingIndexSampler(current, self)
        return True

    # ------------------------------------------------------------------------------ the step

    def on_batch(self, batch: Any, *, epoch: int | None = None, batch_idx: int | None = None) -> None:
        """The training loop received ``batch`` (a micro-batch): its identities, and for replay the batch
        and the RNG state before its forward."""
        if self._replayer is not None and self._replayer.replaying:
            return
        if self.ids is not None:
            self.tracker.consumed(_id_field(batch, self.ids), epoch, batch_idx)
        else:
            self.tracker.consumed(epoch=epoch, batch=batch_idx)
        if self._replayer is not None:
            self._records.append(MicroRecord(batch, capture_rng()))

    def withdraw(self) -> None:
        """The micro-batch received last was not trained on (``training_step`` returned ``None``): it is
        no part of the coming step, nor of its replay."""
        if self._replayer is not None and self._replayer.replaying:
            return
        self.tracker.withdraw()
        if self._records:
            self._records.pop()

    def end_step(self, skipped_on_host: bool | None, found_inf: torch.Tensor | None,
                 scale: torch.Tensor | None) -> None:
        """The step ends (``LossScaler.update``, before the scale moves): file the next micro-batches under
        the next step, and replay this one if the host knows (or, with replay on and a fused optimizer,
        reads) it was skipped, at ``scale``, the step's."""
        if self._replayer is not None and self._replayer.replaying:
            return
        step = self.tracker.steps_ended + 1
        self.tracker.step_ended()
        records, self._records = self._records, []
        if self._replayer is None or not records:
            return
        skipped = skipped_on_host
        if skipped is None and found_inf is not None:
            skipped = bool(found_inf.item())  # a fused optimizer decided on the device: replay's one read
            self.replay_reads += 1
        if not skipped:
            return
        self.skipped_on_host[step] = True
        if self._left <= 0:
            self.notes[step] = f"budget: at most {self.replay_budget} replays per log interval"
            return
        self._left -= 1
        assert scale is not None
        value = float(scale.item())  # a bad step: its scale, for the replay
        try:
            self.replays[step] = self._replayer.replay(records, value)
        except Exception as error:  # a diagnostic never stops training
            self.notes[step] = f"failed: {type(error).__name__}: {error}"
            warnings.warn(f"[lossscale-callbacks] the replay of step {step} failed and was skipped: "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)

    def rebase(self, steps: int) -> None:
        """The run's true count of steps ended (a checkpoint was loaded)."""
        self.tracker.rebase(steps)

    # ------------------------------------------------------------------------------ reading

    def take(self, bad_steps: Mapping[int, Any], through: int) -> dict[int, tuple[tuple[MicroBatch, ...],
                                                                             Replay | None, str | None]]:
        """At the log interval: for each bad step, its micro-batches, its replay (or why none); then the
        steps up to ``through`` are forgotten and the replay budget starts again."""
        out = {}
        for step in bad_steps:
            note = self.notes.pop(step, None)
            if note is None and self._replayer is None:
                note = "off"
            out[step] = (self.tracker.of_step(step, self._resolve), self.replays.pop(step, None), note)
        self.tracker.release_through(through)
        for table in (self.replays, self.notes, self.skipped_on_host):
            for step in [s for s in table if s <= through]:
                del table[step]
        self._left = self.replay_budget
        return out

    def record(self, outcomes: Any) -> None:
        """An interval's skip truth (``IntervalOutcomes``, read by whoever reads the scaler's outcomes at the
        log interval) into the book: one entry per bad step, with its micro-batches and replay."""
        if self.book is None:
            self.book = Ledger(self.directory, rank=process_rank())
        bad = bad_steps(outcomes)
        self.book.record(bad, self.take(bad, outcomes.last_step))

    def _resolve(self, ids: Any) -> list[Any] | None:
        """Host values of kept identities (a device tensor is read here, for a bad step only)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().flatten().cpu().tolist()
        if self.column is not None and ids is not None:
            return _map_column(self.column, list(ids))
        return list(ids)


def _id_field(batch: Any, name: str) -> Any:
    """The id field of a batch (a mapping's key or an attribute): host values, or a device tensor kept."""
    value = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return value.flatten().tolist()
    return value


def _map_column(column: Any, positions: list[Any]) -> list[Any]:
    """``column[position]`` for each position: a ``datasets`` column (a list, or a Dataset and its
    column name as a pair), read for a bad step only."""
    if isinstance(column, tuple) and len(column) == 2:
        dataset, name = column
        values = dataset[positions][name]
        return values.tolist() if hasattr(values, "tolist") else list(values)  # a torch-formatted column
    return [column[p] for p in positions]


def ledger_capture(scaler: Any) -> LedgerCapture | None:
    """The ledger capture of a ``LossScaler`` (made by ``scaler.track(...)``), or ``None``."""
    return getattr(scaler, "_ledger", None)
