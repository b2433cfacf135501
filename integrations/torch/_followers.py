"""Finding what follows a torch scaler's optimizers, and counting its steps at the log interval.

The LR schedulers and EMAs of a run are found once, when :class:`~lossscale_callbacks.torch.ScalerReader`
is made (usually before the first step): the schedulers an integration hands over (Lightning's configs,
the Trainer's), the ones the scaler holds, and, with ``find=True``, every ``LRScheduler``/
``ReduceLROnPlateau`` and ``AveragedModel`` alive in the process (one pass over the garbage collector's
objects, on the host, once; again at the first read, for those made after the reader). A scheduler
counts only if its optimizer is one this scaler stepped; a scheduler driven by another
(``SequentialLR``'s, ``ChainedScheduler``'s) is left to its driver.

At each read :meth:`Followers.counts` gives every follower's own step count as host numbers (a
scheduler's ``last_epoch``; an EMA's ``n_averaged``, read from the device with the held ones' counters,
one copy) for the core's :class:`~lossscale_callbacks.skips._followers.FollowerCheck`.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.optim.swa_utils import AveragedModel

from lossscale_callbacks.integration import EMA, SCHEDULER, FollowerCount
from lossscale_callbacks.torch._held import describe, scheduler_graph, unwrap_optimizer

_FOLLOWER_TYPES = (LRScheduler, ReduceLROnPlateau, AveragedModel)


def _with_subclasses(classes: Iterable[type]) -> set[type]:
    found: set[type] = set()
    todo = list(classes)
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return found


def find_followers() -> list[Any]:
    """Every LR scheduler and ``AveragedModel`` alive in this process: once, when a reader is made and at
    its first read. An instance refers to its class, so gc's referrers of the follower classes are the
    candidates (one pass in C over gc's objects: half the time of a Python loop over them, about 0.1 s
    in a process that loaded TensorFlow, Lightning and Transformers)."""
    classes = _with_subclasses(_FOLLOWER_TYPES)
    return [obj for obj in gc.get_referrers(*classes) if type(obj) in classes]  # type(): no __class__


def _averages_these(ema: Any, shapes: Counter) -> bool:
    """Whether ``ema`` averages a model these optimizers train: its parameters' shapes are among theirs."""
    mine = Counter(tuple(p.shape) for p in ema.module.parameters())
    return bool(mine) and not mine - shapes


def _read_n_averaged(emas: list[Any]) -> list[int]:
    """The EMAs' ``n_averaged``, in one device-to-host copy."""
    if not emas:
        return []
    home = emas[0].n_averaged.device
    return [int(v) for v in torch.stack([e.n_averaged.to(home) for e in emas]).cpu().tolist()]


def _scheduler_count(scheduler: Any) -> int | None:
    if hasattr(scheduler, "last_epoch"):
        return int(scheduler.last_epoch)
    graph = scheduler_graph(scheduler)  # a ChainedScheduler: its schedulers step together
    inner = [s for s in graph if s is not scheduler and hasattr(s, "last_epoch")]
    return int(inner[0].last_epoch) if inner else None


class Followers:
    """The schedulers and EMAs that follow a scaler's optimizers (see the module docstring).

    Args:
        scaler: the ``LossScaler`` (or any scaler: only ours holds; the others' followers are counted).
        progress: ``(applied, skipped)`` steps so far, as the host knows them without a read: each
            follower's count is compared from when it was first seen.
        given: schedulers or EMAs the integration knows (its own, or the user's).
        find: also find the ones alive in the process.
    """

    def __init__(self, scaler: Any, progress: Any, given: Iterable[Any] = (), find: bool = True) -> None:
        self.scaler = scaler
        self._progress = progress
        self._refs: list[weakref.ref] = []
        self._base: dict[int, tuple[int, int, int]] = {}
        self.add(given)
        if find:
            self.add(find_followers())
        self._found_again = not find

    def add(self, objects: Iterable[Any]) -> None:
        """More schedulers or EMAs to follow (unwrapped from ``AcceleratedScheduler``-like wrappers); their
        counts now are where they start (an EMA's ``n_averaged``: one read for all)."""
        new = []
        for obj in objects:
            obj = getattr(obj, "scheduler", obj) if not isinstance(obj, _FOLLOWER_TYPES) else obj
            if isinstance(obj, _FOLLOWER_TYPES) and id(obj) not in self._base and all(
                    obj is not n for n in new):
                new.append(obj)
        if not new:
            return
        applied, skipped = self._progress()
        emas = [obj for obj in new if isinstance(obj, AveragedModel)]
        averaged = dict(zip(map(id, emas), _read_n_averaged(emas), strict=True))
        for obj in new:
            count = averaged[id(obj)] if id(obj) in averaged else _scheduler_count(obj)
            if count is not None:
                self._base[id(obj)] = (count, applied, skipped)
                self._refs.append(weakref.ref(obj))

    def _live(self) -> list[Any]:
        if not self._found_again:  # the first read: those made after the reader (the Trainer's, Lightning's)
            self._found_again = True
            self.add(find_followers())
        objs = [obj for ref in self._refs if (obj := ref()) is not None]
        driven = {id(s) for obj in objs if isinstance(obj, LRScheduler)
                  for s in scheduler_graph(obj) if s is not obj}
        return [obj for obj in objs if id(obj) not in driven]

    def counts(self) -> list[FollowerCount]:
        """Every follower's step count now (one device read for the EMAs)."""
        held = {id(f.obj): f for f in getattr(self.scaler, "held", [])}
        optimizers = list(self._stepped_optimizers())
        stepped = {id(o) for o in optimizers}
        shapes = Counter(tuple(p.shape) for o in optimizers for g in o.param_groups for p in g["params"])
        out: list[FollowerCount] = []
        emas = []
        for obj in self._live():
            is_ema = isinstance(obj, AveragedModel)
            if is_ema and id(obj) not in held and not _averages_these(obj, shapes):
                continue  # an EMA of another model than the one these optimizers train
            if not is_ema and id(unwrap_optimizer(getattr(obj, "optimizer", None))) not in stepped:
                continue
            if is_ema:
                emas.append(obj)
            else:
                count = _scheduler_count(obj)
                if count is not None:
                    out.append(self._count(obj, SCHEDULER, count, id(obj) in held))
        for obj, count in zip(emas, _read_n_averaged(emas), strict=True):
            out.append(self._count(obj, EMA, count, id(obj) in held))
        return out

    def _stepped_optimizers(self) -> Iterable[torch.optim.Optimizer]:
        """The optimizers the scaler stepped (ours records them; a stock scaler: the followers' own)."""
        stepped = getattr(self.scaler, "_stepped", None)
        if stepped is not None:
            return list(stepped.values())
        optimizers = (unwrap_optimizer(getattr(ref(), "optimizer", None)) for ref in self._refs)
        return list({id(o): o for o in optimizers if isinstance(o, torch.optim.Optimizer)}.values())

    def _count(self, obj: Any, kind: str, count: int, held: bool) -> FollowerCount:
        return FollowerCount(describe(obj), kind, count, held, id(obj), self._base[id(obj)])


__all__ = ["Followers", "find_followers"]
