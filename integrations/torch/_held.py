"""Holding what follows the optimizer (LR schedulers, EMAs) on skipped steps, without a host read in the step.

``scaler.hold(scheduler)`` or ``scaler.hold(ema)`` makes the object advance only on the steps its
optimizer applied; the user (or Lightning, the Trainer, Accelerate) keeps calling ``scheduler.step()``
and ``ema.update_parameters(model)`` as before. How, by where the skip decision is made:

* **On the host** (an optimizer without a fused kernel: the scaler reads the overflow flag to decide
  whether to call ``optimizer.step``, as ``GradScaler`` does). The held ``step()`` / ``update_parameters``
  does nothing after a skipped step and is the stock call otherwise: exactly the stock run with the
  skipped steps removed. No read is added.
* **On the device** (a fused optimizer, whose kernel skips on the device: nothing on the host knows).
  The scaler writes, after each ``scaler.step(optimizer)``, a device flag ``applied`` (one op). Then:

  - *LR scheduler*: the optimizer's learning rate becomes a device tensor (fused optimizers take one),
    looked up in a table of the stock scheduler's values by a device counter of the scheduler steps
    that followed an applied optimizer step: ``step()`` is two device ops (``count += applied``, one
    ``index_select``). The table is made on the host by stepping a copy of the scheduler (on a shadow
    of the optimizer's param groups, so nothing of the user's moves), as far ahead as the host-known
    number of ``step()`` calls can reach, and extended at the reads (or in a step, when a run goes
    that long without one). At each read (:meth:`Holder.sync`, the log interval: one read of the
    counters) the user's scheduler object is stepped on the host to the applied count, so its
    ``last_epoch``, ``get_last_lr()`` and ``state_dict()`` are the stock ones; between reads they show
    the last read's (the optimizer's learning rate is always current). ``state_dict()`` reads first.
    The values are the stock scheduler's, bit for bit (float64 on the CPU; on CUDA torch's fused
    kernels read a tensor learning rate as float32).
  - *EMA* (``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``,
    ``get_swa_multi_avg_fn`` or the default SWA average): the average's weight is multiplied by the
    flag on the device (a skipped step averages with weight 0: a no-op) and ``n_averaged`` is
    corrected on the device afterwards (``n_averaged += applied - 1``): three ops.
  - *Not holdable without a read*: ``ReduceLROnPlateau`` (it reads a metric on the host), a scheduler
    that moves more than the learning rate (``OneCycleLR``/``CyclicLR`` with ``cycle_momentum=True``:
    fused kernels take ``betas``/``momentum`` as host numbers), a scheduler whose copy cannot be made,
    an EMA with a custom averaging function. These are held with **one read per step** (the flag),
    as the documentation says.

The ``state_dict`` of a held scheduler is the stock one (the hold's own attributes left out); loading
one moves the hold to the loaded position. :meth:`Holder.release` puts everything back.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

TABLE_CHUNK = 1024  # scheduler values made ahead at a time
_PATCHED = ("step", "state_dict", "load_state_dict")


@dataclasses.dataclass
class StepFlag:
    """What the scaler knows about an optimizer's last step.

    ``applied`` is a 0-d int64 device tensor, 1 when the last step was applied (written by the scaler
    when a follower reads it on the device: ``on_device``); ``host_skipped`` is the host's answer where
    the step decided on the host.
    """

    applied: torch.Tensor | None = None
    host_skipped: bool | None = None
    stepped: bool = False  # whether the optimizer took any step yet
    on_device: bool = False  # a follower in device or read mode uses ``applied``


class _ShadowOptimizer(torch.optim.Optimizer):
    """An optimizer's param groups without their parameters: what a scheduler copy steps instead."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = [{k: (float(v) if k == "lr" else copy.deepcopy(v)) for k, v in g.items()
                              if k != "params"} | {"params": []} for g in groups]
        self.defaults: dict[str, Any] = {}
        self.state: dict[Any, Any] = {}
        self._opt_called = True  # no "scheduler before optimizer" warning: it steps nothing

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


_ShadowOptimizer.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def scheduler_graph(scheduler: Any) -> list[LRScheduler]:
    """``scheduler`` and every scheduler it drives (``SequentialLR``'s, ``ChainedScheduler``'s), once each."""
    found: list[LRScheduler] = []
    todo = [scheduler]
    while todo:
        item = todo.pop()
        if isinstance(item, LRScheduler) and all(item is not f for f in found):
            found.append(item)
            for value in vars(item).values():
                if isinstance(value, (list, tuple)):
                    todo.extend(v for v in value if isinstance(v, LRScheduler))
                elif isinstance(value, LRScheduler):
                    todo.append(value)
    return found


@contextmanager
def _on_shadow(graph: list[LRScheduler], shadow: _ShadowOptimizer) -> Iterator[None]:
    saved = [s.optimizer for s in graph]
    for s in graph:
        s.optimizer = shadow
    try:
        yield
    finally:
        for s, optimizer in zip(graph, saved, strict=True):
            s.optimizer = optimizer


def _moves_more_than_lr(graph: list[LRScheduler]) -> bool:
    return any(getattr(s, "cycle_momentum", False) for s in graph)


def _lr_dtype(device: torch.device) -> torch.dtype:
    # torch's fused kernels take a CPU tensor learning rate as a double (.item<double>()) and read a CUDA
    # one as float32 (the scalar path rounds its double to float32 too).
    return torch.float64 if device.type == "cpu" else torch.float32


def _other_keys(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings but the learning rate (a scheduler that moves them cannot be held
    on the device)."""
    return [{k: v for k, v in g.items() if k not in ("lr", "params")} for g in optimizer.param_groups]


def _upload(rows: list[list[float]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Schedule values onto the device: a copy that does not wait for the device's queue."""
    return torch.tensor(rows, dtype=dtype).to(device, non_blocking=True)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside framework wrappers (Accelerate's ``AcceleratedOptimizer``, which the
    Transformers Trainer's scheduler holds): the one the scaler steps."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def describe(obj: Any) -> str:
    """The name a finding uses for a follower: its class (``LambdaLR``, ``AveragedModel``...)."""
    return type(obj).__name__


class _Follower:
    """One held object: its optimizer's flag, its mode, how many steps it held back."""

    kind = ""

    def __init__(self, obj: Any, flag: StepFlag, mode: str) -> None:
        self.obj = obj
        self.flag = flag
        self.mode = mode  # "host", "device" or "read"
        self.held = 0  # steps held back, counted on the host (host and read modes)

    @property
    def name(self) -> str:
        return describe(self.obj)

    def last_skipped(self) -> bool:
        """Whether the optimizer's last step was skipped: the host's answer, or one read (read mode)."""
        if not self.flag.stepped:
            return False
        if self.flag.host_skipped is not None:
            return self.flag.host_skipped
        assert self.flag.applied is not None
        return not bool(self.flag.applied.item())  # the one read per step of "read" mode

    def steps_taken(self) -> int:
        """Steps the object took since the hold began, as of the last :meth:`Holder.sync`."""
        raise NotImplementedError

    def sync(self, values: list[int]) -> None:
        """Bring the host side up to date with the device counters read (device mode)."""

    def device_counters(self) -> list[torch.Tensor]:
        return []

    _originals: dict[str, Any]  # the instance attributes the hold replaced (None: there was none)

    def release(self) -> None:
        """Everything back: the object's own attributes as they were before the hold."""
        for name, original in self._originals.items():
            if original is None:
                self.obj.__dict__.pop(name, None)
            else:
                self.obj.__dict__[name] = original


class HeldScheduler(_Follower):
    """A held LR scheduler (see the module docstring)."""

    kind = "scheduler"

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer, flag: StepFlag, mode: str) -> None:
        super().__init__(scheduler, flag, mode)
        self.optimizer = optimizer
        self.start_epoch = int(getattr(scheduler, "last_epoch", 0))
        self._originals = {name: scheduler.__dict__.get(name) for name in _PATCHED}
        if mode == "device":
            try:
                self._build_device()
            except Exception:  # a scheduler this route cannot copy: held with one read per step
                self.mode = "read"
        scheduler.step = self.step
        scheduler.state_dict = self.state_dict
        scheduler.load_state_dict = self.load_state_dict
        self._opt_hooks = [optimizer.register_state_dict_post_hook(self._plain_lrs),
                           optimizer.register_load_state_dict_post_hook(self._reinstall)]

    # ------------------------------------------------------------------ device mode

    def _build_device(self) -> None:
        scheduler, optimizer = self.obj, self.optimizer
        self.graph = scheduler_graph(scheduler)
        if _moves_more_than_lr(self.graph):
            raise ValueError("moves more than the learning rate")
        groups = optimizer.param_groups
        devices = {p.device for g in groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError("parameters on more than one device")
        self.device = next(iter(devices))
        self.shadow = _ShadowOptimizer(groups)  # the user's scheduler catches up on this one
        self._gen_shadow = _ShadowOptimizer(groups)
        # The copy steps a shadow: every optimizer the graph points at (a wrapper's too) maps to it, and
        # the parameters to themselves, so nothing big is copied.
        memo: dict[int, Any] = {id(s.optimizer): self._gen_shadow for s in self.graph}
        memo[id(optimizer)] = self._gen_shadow
        memo.update({id(p): p for g in groups for p in g["params"]})
        self._gen = copy.deepcopy(scheduler, memo)
        self._rows = [[float(g["lr"]) for g in groups]]
        self._end: Exception | None = None
        self.base = 0  # scheduler steps (since the hold) that table row 0 stands for
        self.calls = 0  # step() calls since the hold: what the count can reach at most
        self.synced = 0  # steps the user's scheduler object took since the hold
        self._extend(TABLE_CHUNK)
        self._table = _upload(self._rows, _lr_dtype(self.device), self.device)
        self._count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._lr = self._table[0].clone()
        self._lr2d = self._lr.view(1, -1)
        self._views = [self._lr[g] for g in range(len(groups))]  # made once: a view is an op
        self._install()

    def _extend(self, rows: int) -> None:
        """``rows`` more values of the schedule, by stepping the copy (host only). A schedule that ends
        (``OneCycleLR`` past ``total_steps`` raises) ends the table: :attr:`_end` keeps its error."""
        keys = _other_keys(self._gen_shadow)
        with _on_shadow(scheduler_graph(self._gen), self._gen_shadow):
            for _ in range(rows if self._end is None else 0):
                try:
                    type(self._gen).step(self._gen)
                except Exception as exc:  # the stock scheduler raises it at that step() too
                    self._end = exc
                    break
                self._rows.append([float(g["lr"]) for g in self._gen_shadow.param_groups])
        if _other_keys(self._gen_shadow) != keys:
            raise ValueError("the schedule moves more than the learning rate")

    def _at_the_end(self) -> None:
        """The schedule has no value for this many steps: where the stock scheduler would raise, raise its
        error (one read, only at a schedule's end)."""
        assert self._end is not None
        applied = 1 if self.flag.applied is None else int(self.flag.applied.item())
        reached = int(self._count.item()) + applied
        if reached >= len(self._rows):
            raise self._end
        self.calls = self.base + reached  # exact again: the next reads come only at the end again

    def _grow_table(self) -> None:
        if self._end is not None:
            return
        start = len(self._rows)
        self._extend(TABLE_CHUNK)
        new = _upload(self._rows[start:], self._table.dtype, self.device)
        self._table = torch.cat([self._table, new])

    def _install(self) -> None:
        for group, view in zip(self.optimizer.param_groups, self._views, strict=True):
            group["lr"] = view

    def _plain_lrs(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of the optimizer holds host numbers, not our device tensors (one read, at saving)."""
        for group in state["param_groups"]:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        return state

    def _reinstall(self, optimizer: Any) -> None:
        if self.mode == "device":
            self._install()

    def device_counters(self) -> list[torch.Tensor]:
        return [self._count] if self.mode == "device" else []

    # ------------------------------------------------------------------ the held methods

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The scheduler's ``step()``: only after an applied optimizer step (see the module docstring)."""
        if self.mode == "device" and not args and not kwargs:
            if self.optimizer.param_groups[0]["lr"] is not self._views[0]:
                self._install()  # the optimizer loaded a state: its groups are new dicts
            self.calls += 1
            if self.calls >= self.base + len(self._rows):
                self._grow_table()
                if self.calls >= self.base + len(self._rows):
                    self._at_the_end()
            if self.flag.applied is not None:
                self._count.add_(self.flag.applied)
            else:  # before the optimizer's first step: the stock scheduler steps
                self._count.add_(1)
            torch.index_select(self._table, 0, self._count, out=self._lr2d)
            return None
        if self.last_skipped():
            self.held += 1
            return None
        return type(self.obj).step(self.obj, *args, **kwargs)

    def sync(self, values: list[int]) -> None:
        """The device count read: the user's scheduler steps on the host to it; the table drops the past."""
        if self.mode != "device":
            return
        (relative,) = values
        applied = self.base + relative
        with _on_shadow(self.graph, self.shadow):
            while self.synced < applied:
                type(self.obj).step(self.obj)
                self.synced += 1
        if relative:
            del self._rows[:relative]
            self._table = self._table[relative:]
            self._count.sub_(relative)
            self.base = applied
        if len(self._rows) - (self.calls - self.base) < TABLE_CHUNK // 2:
            self._grow_table()

    def steps_taken(self) -> int:
        if self.mode == "device":
            return self.synced
        return int(getattr(self.obj, "last_epoch", 0)) - self.start_epoch

    def held_back(self) -> int:
        """``step()`` calls held back on skipped optimizer steps since the hold (as of the last sync)."""
        return self.calls - self.synced if self.mode == "device" else self.held

    def state_dict(self) -> dict[str, Any]:
        """The stock ``state_dict`` (brought up to date first: one read in device mode)."""
        if self.mode == "device" and self._holder is not None:
            holder = self._holder()
            if holder is not None:
                holder.sync()
        state = type(self.obj).state_dict(self.obj)
        return {k: v for k, v in state.items() if k not in _PATCHED}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The stock load; the hold then continues from the loaded position."""
        type(self.obj).load_state_dict(self.obj, state)
        if self.mode == "device":
            self._restore_lrs()
            self._build_device()
        self.start_epoch = int(getattr(self.obj, "last_epoch", 0))
        self.held = 0

    _holder: Any = None

    def _restore_lrs(self) -> None:
        values = self._lr.tolist()
        for g, group in enumerate(self.optimizer.param_groups):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"] = float(values[g])

    def release(self) -> None:
        """Everything back: the scheduler's methods, the optimizer's float learning rates."""
        super().release()
        for hook in self._opt_hooks:
            hook.remove()
        if self.mode == "device":
            self._restore_lrs()


def _ema_factory_kind(fn: Any) -> tuple[str, float | None]:
    """``("ema", decay)``, ``("swa", None)`` or ``("ema_avg", decay)`` for torch's own averaging functions
    (``get_ema_multi_avg_fn``, ``get_swa_multi_avg_fn``, ``get_ema_avg_fn``), else ``("custom", None)``."""
    from torch.optim import swa_utils

    if fn is None:
        return "swa", None
    inner = inspect.unwrap(fn)  # torch decorates them with no_grad: the wrapper's code is everyone's
    code = getattr(inner, "__code__", None)
    for kind, factory in (("ema", swa_utils.get_ema_multi_avg_fn), ("ema_avg", swa_utils.get_ema_avg_fn)):
        if code is inspect.unwrap(factory()).__code__:
            return kind, float(inspect.getclosurevars(inner).nonlocals["decay"])
    if code is inspect.unwrap(swa_utils.get_swa_multi_avg_fn()).__code__:
        return "swa", None
    return "custom", None


class HeldEMA(_Follower):
    """A held ``AveragedModel`` (see the module docstring)."""

    kind = "ema"

    def __init__(self, ema: Any, flag: StepFlag, mode: str) -> None:
        super().__init__(ema, flag, mode)
        self._originals = {name: ema.__dict__.get(name)
                           for name in ("update_parameters", "multi_avg_fn", "avg_fn")}
        self.start = int(ema.n_averaged)  # one read, when the hold begins
        per_tensor = ema.multi_avg_fn is None and ema.avg_fn is not None  # AveragedModel's own order
        self.average, self.decay = _ema_factory_kind(ema.avg_fn if per_tensor else ema.multi_avg_fn)
        if per_tensor != (self.average == "ema_avg"):
            self.average = "custom"
        if self.mode == "device" and self.average == "custom":
            self.mode = "read"
        if self.mode == "device" and self.average == "ema_avg":  # Lightning's EMAWeightAveraging
            ema.avg_fn = self._held_tensor_average
        elif self.mode == "device":
            ema.multi_avg_fn = self._held_average
        ema.update_parameters = self.update_parameters

    def _weight(self, like: torch.Tensor, n_averaged: Any) -> torch.Tensor:
        assert self.flag.applied is not None
        if self.average == "ema":
            weight = self.flag.applied * (1.0 - self.decay)
        else:  # SWA: 1 / (n + 1), with n the applied steps averaged so far
            weight = self.flag.applied / (n_averaged + 1)
        return weight.to(device=like.device, dtype=like.dtype)

    def _held_average(self, averaged: list[torch.Tensor], current: list[torch.Tensor], n_averaged: Any
                      ) -> None:
        with torch.no_grad():
            weight = self._weight(averaged[0], n_averaged)
            torch._foreach_lerp_(averaged, current, [weight] * len(averaged))

    def _held_tensor_average(self, averaged: torch.Tensor, current: torch.Tensor, n_averaged: Any
                             ) -> torch.Tensor:
        """``get_ema_avg_fn``'s ``decay * ema + (1 - decay) * current`` with a decay of 1 after a skipped
        step: the same float32 products (``decay`` and ``1 - decay`` rounded as the stock function's)."""
        keep, take = self._tensor_weights
        return keep * averaged + take * current

    def update_parameters(self, model: Any) -> None:
        """``AveragedModel.update_parameters``, held on skipped steps."""
        ema = self.obj
        if self.mode == "device" and self.flag.stepped:
            if self.average == "ema_avg":
                applied = self.flag.applied
                assert applied is not None and self.decay is not None
                # applied: (decay, 1 - decay); skipped: (1, 0). Each product exact in float32.
                self._tensor_weights = (applied * self.decay + (1 - applied), applied * (1.0 - self.decay))
            type(ema).update_parameters(ema, model)
            assert self.flag.applied is not None
            ema.n_averaged.add_(self.flag.applied).sub_(1)
            return
        if self.last_skipped():
            self.held += 1
            return
        type(ema).update_parameters(ema, model)

    def device_counters(self) -> list[torch.Tensor]:
        return [self.obj.n_averaged.reshape(1)]  # read with the others, in every mode

    def sync(self, values: list[int]) -> None:
        self._taken = values[0] - self.start

    _taken = 0

    def steps_taken(self) -> int:
        return self._taken


class Holder:
    """The followers a scaler holds, and the flags it writes for them after each optimizer step.

    Example:
        >>> holder = Holder()
        >>> holder.followers
        []
    """

    def __init__(self) -> None:
        self.followers: list[_Follower] = []
        self._flags: dict[int, StepFlag] = {}
        self._fused: dict[int, bool] = {}
        self._pending_ema: list[tuple[Any, Callable[[], None]]] = []

    # --------------------------------------------------------------------------- holding

    def hold(self, obj: Any, optimizer: torch.optim.Optimizer | None = None, known: Any = ()) -> Any:
        """Hold ``obj`` (an LR scheduler or an ``AveragedModel``); ``optimizer`` for an EMA when the scaler
        steps more than one. Returns ``obj``.

        Raises:
            ValueError: ``obj`` is neither, or it is held already.
        """
        if any(f.obj is obj for f in self.followers):
            raise ValueError(f"{describe(obj)} is held already")
        from torch.optim.swa_utils import AveragedModel

        if isinstance(obj, AveragedModel):
            optimizer = unwrap_optimizer(optimizer)
            if optimizer is None:
                known = list(known)
                if len(known) != 1:
                    raise ValueError("hold(ema): pass optimizer= (the optimizer whose steps the EMA "
                                     f"follows); this scaler has stepped {len(known)} optimizers so far")
                optimizer = known[0]
            mode = self._mode(optimizer, obj)
            follower: _Follower = HeldEMA(obj, self._flag(optimizer, mode), mode)
            follower.flag.on_device = follower.flag.on_device or follower.mode != "host"
        elif isinstance(obj, (LRScheduler, ReduceLROnPlateau)) or hasattr(obj, "optimizer"):
            optimizer = unwrap_optimizer(getattr(obj, "optimizer", None) if optimizer is None else optimizer)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError(f"hold: {describe(obj)} has no optimizer to follow")
            mode = self._mode(optimizer, obj)
            follower = HeldScheduler(obj, optimizer, self._flag(optimizer, mode), mode)
            follower._holder = weakref.ref(self)
        else:
            raise ValueError(f"hold takes an LR scheduler or a torch.optim.swa_utils.AveragedModel, got "
                             f"{type(obj).__name__}")
        self.followers.append(follower)
        return obj

    def _mode(self, optimizer: torch.optim.Optimizer, obj: Any) -> str:
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if not fused:
            return "host"
        if isinstance(obj, ReduceLROnPlateau):
            return "read"
        return "device"

    def _flag(self, optimizer: torch.optim.Optimizer, mode: str) -> StepFlag:
        flag = self._flags.setdefault(id(optimizer), StepFlag())
        flag.on_device = flag.on_device or mode != "host"
        return flag

    def release(self, obj: Any = None) -> None:
        """Stop holding ``obj`` (default: everything): its stock methods and float learning rates back."""
        keep = []
        for follower in self.followers:
            if obj is None or follower.obj is obj:
                follower.release()
            else:
                keep.append(follower)
        if obj is not None and len(keep) == len(self.followers):
            raise ValueError(f"{describe(obj)} is not held")
        self.followers = keep

    # --------------------------------------------------------------------------- the step

    def wants(self, optimizer: torch.optim.Optimizer) -> bool:
        return id(optimizer) in self._flags

    def on_step(self, optimizer: torch.optim.Optimizer, *, skip: torch.Tensor | None = None,
                host_skipped: bool | None = None) -> None:
        """After ``scaler.step(optimizer)``: the step's flag (``skip``: the device overflow flag; or the
        host's decision). One device op on the device path, none on the host path."""
        flag = self._flags.get(id(optimizer))
        if flag is None:
            return
        flag.stepped = True
        flag.host_skipped = host_skipped
        if not flag.on_device:
            return
        if flag.applied is None:
            device = skip.device if skip is not None else next(
                p.device for g in optimizer.param_groups for p in g["params"])
            flag.applied = torch.zeros((), dtype=torch.int64, device=device)
        if host_skipped is None:
            assert skip is not None
            torch.eq(skip, 0, out=flag.applied)
        else:
            flag.applied.fill_(0 if host_skipped else 1)

    # --------------------------------------------------------------------------- the read

    def counters(self, device: torch.device) -> torch.Tensor | None:
        """Every held object's device counters as one flat float64 tensor on ``device`` (to copy with
        the scaler's state: one copy), or ``None`` when nothing is held on the device."""
        flat = [t.reshape(-1).to(device=device, dtype=torch.float64)
                for f in self.followers for t in f.device_counters()]
        return torch.cat(flat) if flat else None

    def apply(self, values: list[float], at_step: int | None = None) -> None:
        """The held objects' host side brought up to date from :meth:`counters`' values (read at the
        scaler's step ``at_step``: a second sync at that step reads nothing)."""
        at = 0
        for follower in self.followers:
            n = len(follower.device_counters())
            follower.sync([int(v) for v in values[at:at + n]])
            at += n
        self.synced_at = at_step

    synced_at: int | None = None

    def sync(self, at_step: int | None = None) -> None:
        """One read of every device counter (none when already synced at ``at_step``, the scaler's step
        count); the held objects' host side brought up to date."""
        if at_step is not None and at_step == self.synced_at:
            return
        flat = [t for f in self.followers for t in f.device_counters()]
        tensor = self.counters(flat[0].device) if flat else None
        self.apply([] if tensor is None else tensor.cpu().tolist(), at_step)


__all__ = ["HeldEMA", "HeldScheduler", "Holder", "StepFlag", "describe", "scheduler_graph",
           "unwrap_optimizer"]
