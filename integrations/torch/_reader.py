"""``ScalerReader``: one reader for the loss scaler of any torch run, in the core's state shape.

Our :class:`~lossscale_callbacks.torch.LossScaler`, a stock ``torch.amp.GradScaler`` or
``ShardedGradScaler`` (whose skipped steps it counts on the device, see
:mod:`lossscale_callbacks.torch._stock`), DeepSpeed's own loss scaler (see
:mod:`lossscale_callbacks.torch._deepspeed_reader`) or Megatron-Core's grad scaler (see
:mod:`lossscale_callbacks.torch._megatron_reader`): every monitor (Lightning, Fabric, Accelerate,
the Transformers Trainer) reads the scaler through this class, once per log interval, and hands
what it read to the core's :class:`~lossscale_callbacks.LoggingLoop`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from lossscale_callbacks import LossScaleState
from lossscale_callbacks.integration import (
    INT64_MAX,
    IntervalForensics,
    IntervalOutcomes,
    Policy,
    carry,
    check_int,
)
from lossscale_callbacks.torch._deepspeed_reader import DeepSpeedScalerReader, has_deepspeed_scaler
from lossscale_callbacks.torch._followers import Followers
from lossscale_callbacks.torch._megatron_reader import MegatronScalerReader, has_megatron_scaler
from lossscale_callbacks.torch._rank_gather import with_ranks
from lossscale_callbacks.torch._scaler import LossScaler
from lossscale_callbacks.torch._stock import StockSkipCounter, check_stock_state

__all__ = ["ScalerReader"]



class ScalerReader:
    """Reads a torch run's loss scaler: ours, a stock GradScaler/ShardedGradScaler, DeepSpeed's, Megatron's.

    Call :meth:`after_optimizer_step` after each optimizer step (host counting; for a stock scaler
    also a few device ops that count its overflow, no host sync) and :meth:`read` at the log
    interval: the one host read, a :class:`~lossscale_callbacks.LossScaleState` of Python
    numbers. :meth:`state_dict`/:meth:`load_state_dict` carry what a stock scaler does not keep (the
    steps and skipped steps) beside its own state, checked whole before anything changes.

    Step accounting: :attr:`steps` counts optimizer steps on the host without a device read. For our
    scaler the truth is the scaler's own count: every :meth:`read` and :meth:`load_state_dict`
    takes it from the state. A stock scaler counts nothing, so the reader's count is the truth, and
    a checkpoint whose counts disagree with the scaler's is refused. DeepSpeed's engine counts its
    own steps.

    Skip truth: each :meth:`read` also carries what happened to the interval's steps (``outcomes``, an
    :class:`~lossscale_callbacks.skips._outcomes.IntervalOutcomes`: our scaler lists every non-ordinary
    step; a stock one gives the counts) and every LR scheduler's and EMA's own step count
    (``followers``, see :mod:`lossscale_callbacks.torch._followers`), for the logging loop's metrics
    and its check that nothing advanced on skipped steps. Make the reader before the first step: what
    follows the optimizer is found then, and compared from there.

    Args:
        scaler: an enabled ``LossScaler``, ``torch.amp.GradScaler`` or ``ShardedGradScaler``, a
            DeepSpeed engine, its optimizer, or its loss scaler, or a Megatron-Core optimizer or grad
            scaler.
        followers: LR schedulers and EMAs the caller knows (an integration's own).
        find_followers: also find the LR schedulers and EMAs alive in the process (once now, once at
            the first read).

    Raises:
        ValueError: ``scaler`` is none of these, or disabled.

    Example:
        >>> from lossscale_callbacks.torch import LossScaler
        >>> reader = ScalerReader(LossScaler(device="cpu", init_scale=1024.0))
        >>> reader.kind, reader.started, reader.read().scale
        ('ours', False, 1024.0)
        >>> ScalerReader(torch.amp.GradScaler("cpu", init_scale=256.0)).read().scale
        256.0
    """

    def __init__(self, scaler: Any, *, followers: Any = (), find_followers: bool = True) -> None:
        self._stock: StockSkipCounter | None = None
        # An engine's own scaler (DeepSpeed's, Megatron-Core's): read, never replaced.
        self._engine: DeepSpeedScalerReader | MegatronScalerReader | None = None
        if isinstance(scaler, torch.amp.GradScaler):
            if not scaler.is_enabled():
                raise ValueError(f"scaler: {type(scaler).__name__} is disabled (enabled=False): it scales "
                                 "nothing, so there is no loss scale to read")
            self.kind = "ours" if isinstance(scaler, LossScaler) else "stock"
            if self.kind == "stock":
                self._stock = StockSkipCounter(scaler)
        elif has_deepspeed_scaler(scaler):
            self.kind = "deepspeed"
            self._engine = DeepSpeedScalerReader(scaler)
        elif has_megatron_scaler(scaler):
            self.kind = "megatron"
            self._engine = MegatronScalerReader(scaler)
        else:
            raise ValueError("scaler must be a lossscale_callbacks.torch.LossScaler, a torch.amp.GradScaler "
                             "or ShardedGradScaler, a DeepSpeed engine, optimizer or loss scaler, or a "
                             f"Megatron-Core optimizer or grad scaler; got {type(scaler).__name__}")
        self.scaler = scaler
        # Ours: its own count, read without the device until it has one (a checkpoint, or 0).
        self._steps = int(scaler.get_state().steps) if self.kind == "ours" else 0
        # Skip truth: where the outcomes were read last (steps, skipped, spike skips so far).
        self._cursor = (self._steps, int(scaler.get_state().skipped_steps) if self.kind == "ours" else 0, 0)
        self.followers: Followers | None = None
        if self._engine is None:
            self.followers = Followers(scaler, self._progress, followers, find_followers)

    def progress(self) -> tuple[int, int]:
        """``(applied, skipped)`` optimizer steps as of the last read (no device read): where a follower an
        integration knows (a trainer's step counter) starts to be compared."""
        return self._progress()

    def _progress(self) -> tuple[int, int]:
        """``(applied, skipped)`` steps as of the last read of the outcomes (no device read)."""
        steps, skipped, spikes = self._cursor
        return steps - skipped - spikes, skipped + spikes

    @property
    def policy(self) -> Policy | None:
        """The scaler's policy (DeepSpeed's settings as one); ``None`` for a stock GradScaler."""
        if self._engine is not None:
            return self._engine.policy()
        return self.scaler.policy if self.kind == "ours" else None

    @property
    def started(self) -> bool:
        """Whether the scaler has scaled a loss: before that no optimizer step can have been taken."""
        if self._engine is not None:
            return True
        return self.scaler._get_scale_async() is not None

    @property
    def steps(self) -> int:
        """Optimizer steps attempted, counted on the host (no device read)."""
        if self._engine is not None:
            # DeepSpeed's engine counts (host numbers); Megatron's steps are counted by its reader
            return int(self._engine.steps if self.kind == "megatron" else self._engine.read()["steps"])
        return self._steps

    def count_from(self, steps: int) -> None:
        """Count optimizer steps from ``steps``: a trainer restored a checkpoint this reader did not load.

        Only the counts a scaler does not keep itself move (a stock GradScaler's, a bare DeepSpeed
        loss scaler's); our scaler and a DeepSpeed engine count their own steps, which stay.
        """
        steps = check_int("steps", steps, 0, INT64_MAX)
        if self._engine is not None:
            self._engine.steps = steps
        elif self._stock is not None:
            self._steps = steps

    def resume_counts(self, steps: int, skipped_steps: int, *, loading: bool = False) -> None:
        """Continue from counts a trainer saved beside a checkpoint that holds none (a stock scaler's).

        A stock scaler counts from ``steps`` with ``skipped_steps`` skipped before; our scaler takes
        them only when its own count is behind (it loaded a ``GradScaler`` dict, which has none):
        its own counts are the truth otherwise (one host read). ``loading``: the scaler's own
        checkpoint is loaded next (Accelerate's ``load_state``), so ours only counts from ``steps``.

        Raises:
            ValueError: a count is not an integer, or ``skipped_steps > steps``, naming it.
        """
        steps = check_int("steps", steps, 0, INT64_MAX)
        skipped_steps = check_int("skipped_steps", skipped_steps, 0, steps)
        if self._engine is not None:
            return
        if self._stock is not None:
            self._steps = steps
            self._stock.restore(skipped_steps)
            return
        if loading:
            self._steps = steps
            return
        own = self.scaler.state_dict()
        if own["steps"] < steps:
            self.scaler.load_state_dict({**own, "steps": steps, "skipped_steps": skipped_steps})
            self._steps = steps

    def after_optimizer_step(self, steps: int = 1) -> None:
        """Count ``steps`` optimizer steps since the last call (a stock scaler's last overflow on the device).

        No host sync. A stock ``GradScaler`` keeps no history: only the last of several steps can be
        seen, so call this after every optimizer step.
        """
        if self._engine is not None:
            self._engine.after_optimizer_step(steps)
            return
        self._steps += steps
        if self._stock is not None:
            self._stock.after_optimizer_step()

    def read(self, gather: bool = True, outcomes: bool = True) -> LossScaleState:
        """The state as Python numbers: the one host read of an interval (an engine's are host numbers).

        With a ``torch.distributed`` group of two or more ranks (and ``gather``), every rank's state
        comes along (a ``RankedState``, one ``all_gather`` of 4 numbers per rank), so the logging
        loop can tell whether the ranks agree: then every rank must call this at the same reads.
        With ``outcomes`` the state carries the interval's step outcomes and the followers' counts
        (see the class); a read that does not go to the logging loop (a checkpoint's counts) passes
        ``outcomes=False``, so that the next one covers those steps.
        """
        ours = None
        if self._engine is not None:
            state = LossScaleState(**self._engine.read())
        elif self._stock is not None:
            state = self._stock.read(self._steps)
        else:
            if outcomes:  # the state and the interval's outcomes in one copy
                state, ours = self.scaler.read_state_and_outcomes()
            else:
                state = self.scaler.get_state()
            self._steps = int(state.steps)
            self.scaler.sync_held()  # the held schedulers' and EMAs' host side, at the same interval
        ranked = with_ranks(state) if gather else state
        if not outcomes or self._engine is not None:
            return ranked
        interval = self._read_outcomes(state, ours)
        counts = self.followers.counts() if self.followers is not None else []
        # The ledger of bad steps (our scaler's, after track()) took the interval's bad steps in this read;
        # the loop tells them in the summary.
        book = getattr(self.scaler, "ledger", None) if ours is not None else None
        return carry(ranked, outcomes=interval, followers=counts, ledger=book)

    def _read_outcomes(self, state: LossScaleState, ours: IntervalOutcomes | None) -> IntervalOutcomes:
        """The interval's outcomes: ours lists every non-ordinary step; a stock scaler's are counts only."""
        steps, skipped, spikes = self._cursor
        if ours is not None:
            interval = ours
            if interval.first_step != steps + 1:  # the scaler loaded a state: its record starts afresh
                spikes = 0
            spikes += interval.counts["spike"]
        else:
            if int(state.steps) < steps or int(state.skipped_steps) < skipped:  # restored: counts afresh
                steps = skipped = 0
            new = int(state.skipped_steps) - skipped
            interval = IntervalOutcomes(steps + 1, int(state.steps), (), {"overflow": new}, missed=new)
        self._cursor = (int(state.steps), int(state.skipped_steps), spikes)
        return interval

    def read_forensics(self) -> IntervalForensics | None:
        """Our scaler's overflow forensics of the interval (``diagnose=True``), else ``None``."""
        return self.scaler.read_forensics() if self.kind == "ours" else None

    # ------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"steps", "scaler"}``, and ``"stock"``: the counts a GradScaler does not keep. One host read.

        Raises:
            ValueError: for DeepSpeed, which checkpoints its scaler itself (``engine.save_checkpoint``).
        """
        self._refuse_deepspeed()
        if self._stock is None:
            scaler_state = self.scaler.state_dict()
            return {"steps": int(scaler_state["steps"]), "scaler": scaler_state}
        skipped = self._stock.read(self._steps).skipped_steps
        return {"steps": self._steps, "scaler": self.scaler.state_dict(),
                "stock": {"steps": self._steps, "skipped_steps": skipped}}

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict`: every key and field checked before anything changes.

        The scaler's part goes through the core's state gate (ours: ``LossScaler.load_state_dict``;
        a stock GradScaler's: :func:`~lossscale_callbacks.torch._stock.check_stock_state`, so a NaN, zero
        or negative scale or a negative tracker never reaches the stock object); ``steps`` must be an
        integer that agrees with the scaler's own count.

        Raises:
            ValueError: naming the key or field; nothing was loaded.
        """
        self._refuse_deepspeed()
        keys = {"steps", "scaler"} | ({"stock"} if self._stock is not None else set())
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a dict with the keys {sorted(keys)}, got "
                             f"{type(state).__name__}")
        if self._stock is None and "stock" in state:
            raise ValueError("state: saved from a stock torch.amp.GradScaler (it has 'stock'), but this "
                             "scaler is a LossScaler; load it with a GradScaler, or load state['scaler'] "
                             "into the LossScaler (LossScaler.load_state_dict takes a GradScaler dict)")
        if set(state) != keys:
            raise ValueError(f"state must have exactly the keys {sorted(keys)}; missing "
                             f"{sorted(keys - set(state))}, unknown {sorted(set(state) - keys)}")
        steps = check_int("state: steps", state["steps"], 0, INT64_MAX)
        if self._stock is not None:
            self._load_stock(steps, state["scaler"], state["stock"])
        else:
            self._load_ours(steps, state["scaler"])

    def _load_ours(self, steps: int, scaler_state: Any) -> None:
        if not isinstance(scaler_state, Mapping) or "policy" not in scaler_state:
            raise ValueError("state: scaler must be a LossScaler.state_dict() (with 'policy'), got "
                             f"{scaler_state!r}")
        if scaler_state.get("steps") != steps or type(scaler_state.get("steps")) is not int:
            raise ValueError(f"state: steps ({steps}) disagrees with the scaler's own count of optimizer "
                             f"steps ({scaler_state.get('steps')!r}); the checkpoint is inconsistent")
        self.scaler.load_state_dict(scaler_state)  # the core gate; all or nothing
        self._steps = steps

    def _load_stock(self, steps: int, scaler_state: Any, counts: Any) -> None:
        checked = check_stock_state(scaler_state, counts)
        if checked.steps != steps:
            raise ValueError(f"state: steps ({steps}) disagrees with the stock scaler's count "
                             f"({checked.steps}); the checkpoint is inconsistent")
        self.scaler.load_state_dict(dict(scaler_state))
        assert self._stock is not None
        self._stock.restore(checked.skipped_steps)
        self._steps = steps

    def _refuse_deepspeed(self) -> None:
        if self._engine is not None:
            if self.kind == "megatron":
                raise ValueError("a Megatron-Core grad scaler is checkpointed by Megatron itself (the "
                                 "optimizer's state_dict), not through this reader")
            raise ValueError("a DeepSpeed loss scaler is checkpointed by DeepSpeed itself "
                             "(engine.save_checkpoint / load_checkpoint), not through this reader")


def warn_no_scaler(who: str, why: str, stacklevel: int) -> None:
    """The one warning of a monitor that finds no loss scaler to read (``why``: what to do about it).

    ``stacklevel`` counts from the caller, as ``warnings.warn``'s does.
    """
    warnings.warn(f"[lossscale-callbacks] {who} found no loss scaler: {why}. Nothing will be logged.",
                  UserWarning, stacklevel=stacklevel + 1)
