"""``LossScaler``: a ``torch.amp.GradScaler``-compatible scaler on the core's update rule.

Where the host synchronises (and nowhere else):

* ``step(optimizer)`` with an optimizer that unscales inside its own kernel (``Adam``, ``AdamW``,
  ``SGD`` with ``fused=True``): **never**. The overflow flag and the scale are handed to the
  optimizer as tensors (``optimizer.found_inf``/``optimizer.grad_scale``) and the fused kernel skips
  the update on the device. One exception: a fused ``SGD`` with momentum reads the flag until its
  first applied update (usually just the first step; see :func:`_fused_sgd_first_step`).
* ``step(optimizer)`` with any other optimizer: **one** read, the skip decision (``found_inf``),
  exactly like ``torch.amp.GradScaler``.
* ``scale``, ``unscale_`` and ``update``: never. ``update`` runs the core's rule on the device in at
  most 4 dispatched ops without hysteresis and 6 with it on the CPU, and replays a CUDA graph (two
  launches) on CUDA: see :mod:`lossscale_callbacks.torch._update_paths`.
* ``get_scale``, ``get_state``, ``state_dict``, ``last_step_skipped(sync=True)`` and
  ``read_forensics`` read the device (one copy each); call them at the log interval, not per step.
* ``diagnose=True`` adds no host read to a step, and a bounded number of ops whatever the number of
  parameters (see :mod:`lossscale_callbacks.torch._forensics`).
* ``update(new_scale=<tensor>)`` reads the tensor once to check it.
* ``read_outcomes`` reads the device ring of step outcomes (one copy); ``update`` writes the step's
  row in one op (a host-chosen slot; device-side indexing inside a CUDA graph) and, without
  hysteresis, counts the skip with it: still 4 ops (see :mod:`lossscale_callbacks.torch._outcome_ring`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import Any, NamedTuple

import torch

from lossscale_callbacks import LossScaleState, initial_state
from lossscale_callbacks.integration import (
    APPLIED_NONFINITE_CODE,
    SPIKE_CODE,
    IntervalForensics,
    IntervalOutcomes,
    Policy,
    SpikeRule,
    check_bool,
    check_choice,
    check_diagnose,
    check_int,
    check_policy,
    check_spike,
    decode_records,
    host_number,
    is_policy,
    nonfinite_cause,
    validate_state,
)
from lossscale_callbacks.torch._checkpoint import (
    SYNC_CHOICES,
    check_process_group,
    parse_pickle,
    parse_state_dict,
)
from lossscale_callbacks.torch._forensics import GradForensics
from lossscale_callbacks.torch._grad_scaler_compat import policy_from_grad_scaler_settings
from lossscale_callbacks.torch._held import Holder
from lossscale_callbacks.torch._ledger import LedgerCapture, check_replay
from lossscale_callbacks.torch._outcome_ring import DEFAULT_CAPACITY, OutcomeRing
from lossscale_callbacks.torch._spike import SpikeWindow
from lossscale_callbacks.torch._update_paths import PathState, make_path


class _OutcomeCursor(NamedTuple):
    """What :meth:`LossScaler.read_outcomes` saw last: the ring's counts per code, steps, skipped."""

    counts: tuple[int, ...]
    steps: int
    skipped: int


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    # One float32 0-d tensor on the scaler's device: 1.0 when any gradient was Inf/NaN, else 0.0.
    found_inf: torch.Tensor | None = None
    # The flag the optimizer was given: the overflow flag, merged with the spike rule's (or the spike
    # rule's alone when non-finite steps are applied); None when nothing can skip the step.
    skip: torch.Tensor | None = None
    # Host copy of the decision, only where ``step`` already had to read it.
    skipped_on_host: bool | None = None
    # Whether the optimizer had any gradient to check (GradScaler refuses to step or update without).
    checked: bool = False


def _fused_sgd_first_step(optimizer: torch.optim.Optimizer) -> bool:
    """True before the first step of a fused ``SGD`` with momentum (no momentum buffer yet).

    torch's fused SGD allocates its momentum buffers with ``empty_like`` before the kernel runs and
    only the kernel fills them; when ``found_inf`` makes the kernel skip, the buffers keep whatever
    the allocator handed out and every later step builds on that garbage (``GradScaler`` has the
    same problem). A skipped step must leave the optimizer as it was, so this one step decides on
    the host and does not call ``optimizer.step`` at all when it overflowed.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        with_grad = next((p for p in group["params"] if p.grad is not None), None)
        if with_grad is not None and "momentum_buffer" not in optimizer.state.get(with_grad, {}):
            return True
    return False


def _is_sharded(param: torch.Tensor) -> bool:
    """True for FSDP (v1) flat parameters, whose gradients are plain tensors holding one shard each.

    DTensor gradients (FSDP2's ``fully_shard``, tensor parallel) need nothing here: torch's DTensor
    dispatch already all-reduces (MAX) the ``found_inf`` of the check-and-unscale kernel.
    """
    return bool(getattr(param, "_is_flat_param", False)) or any(
        c.__name__ == "FlatParameter" for c in type(param).__mro__)


class LossScaler(torch.amp.GradScaler):
    """Dynamic loss scaling with the core's rule: a ``torch.amp.GradScaler`` you can drop in.

    Constructed like ``GradScaler`` (same arguments, same defaults) it behaves like it, with the
    differences listed on the documentation's "Differences from the upstream classes" page (the
    scale stays in ``[1, 2**24]``; ``device=None`` follows the first scaled tensor). With
    ``policy=`` it runs any core policy. It *is* a ``torch.amp.GradScaler`` (``isinstance`` holds),
    but the state moves only by the core's ``next_state``, on the device, after torch's fused
    check-and-unscale kernel. Every state that comes in (``load_state_dict``, a GradScaler
    checkpoint, ``update(new_scale)``, unpickling) is checked whole before anything changes.

    Args:
        device: the device type (``"cuda"``, ``"cpu"``, ...), as in GradScaler; ``None`` follows
            the first scaled tensor. ``"cuda"`` without CUDA disables the scaler with a warning,
            like GradScaler.
        init_scale: GradScaler's initial scale (default ``2**16``).
        growth_factor: GradScaler's growth factor (default 2.0).
        backoff_factor: GradScaler's backoff factor (default 0.5).
        growth_interval: GradScaler's growth interval (default 2000).
        enabled: ``False`` makes every method a pass-through, like ``GradScaler(enabled=False)``.
        policy: a :class:`~lossscale_callbacks.DynamicPolicy` or
            :class:`~lossscale_callbacks.FixedPolicy` instead of GradScaler's four settings
            (``FixedPolicy(1.0)`` skips and counts non-finite steps without scaling: what bf16 wants).
        sync_found_inf: all-reduce (MAX) the overflow flag across ranks before the skip decision,
            so every rank skips the same steps. ``"auto"`` does it when ``torch.distributed`` is
            initialised with more than one rank and the parameters are FSDP (v1) flat parameters;
            under DDP the gradients are identical after its all-reduce, and for DTensor gradients
            (FSDP2 ``fully_shard``) torch's DTensor dispatch already reduces the flag. ``True``
            always does it when more than one rank runs (use it for FSDP v1 with
            ``use_orig_params=True``, whose sharded parameters look like plain ones).
        process_group: the group for that all-reduce (default: the world).
        diagnose: overflow forensics: ``True`` records on the device, without a host read in the
            step, why each skipped step was skipped and which layers' gradients were non-finite
            (name them with :meth:`watch`), and samples the float16 headroom every
            ``headroom_every`` steps; ``"every_step"`` samples every step. Read with
            :meth:`read_forensics` at the log interval. Off by default.
        headroom_every: optimizer steps between headroom samples with ``diagnose=True``.
        outcome_capacity: optimizer steps the device ring of step outcomes keeps between two
            :meth:`read_outcomes` (default 2048). A longer interval lists its newest steps, counts
            them all (the rest are ``missed``), and the ring grows at that read to fit it.
        spike: the opt-in loss-spike rule (a :class:`~lossscale_callbacks.skips._spike.SpikeRule`, or
            ``True``: 6σ over 128 applied steps), decided on the device; its skips are cause
            ``"spike"``, not overflows (see the "Skipped steps" page).
        skip_nonfinite: ``False`` (monitoring only, with a scale fixed at 1) applies non-finite steps
            and records them as ``"applied_nonfinite"``, with no host read in the step.

    Raises:
        ValueError: an invalid argument, naming it; ``policy`` together with GradScaler's settings.

    Example:
        >>> from lossscale_callbacks import DynamicPolicy
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler(policy=DynamicPolicy(initial_scale=1024.0, hysteresis=2))
        >>> loss = model(torch.ones(2, 4)).sum()
        >>> scaler.scale(loss).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.get_state().steps, isinstance(scaler, torch.amp.GradScaler)
        (1024.0, 1, True)
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        enabled: bool = True,
        *,
        policy: Policy | None = None,
        sync_found_inf: bool | str = "auto",
        process_group: Any = None,
        diagnose: bool | str = False,
        headroom_every: int = 1000,
        outcome_capacity: int = DEFAULT_CAPACITY,
        spike: SpikeRule | bool | None = None,
        skip_nonfinite: bool = True,
    ) -> None:
        # GradScaler.__init__ is not called: it would set up GradScaler's own scale and tracker.
        if is_policy(device):
            raise ValueError("LossScaler's first argument is the device, as in torch.amp.GradScaler; pass "
                             f"the policy by keyword: LossScaler(policy={device!r})")
        enabled = check_bool("enabled", enabled)
        check_choice("sync_found_inf", sync_found_inf, SYNC_CHOICES)
        check_process_group("process_group", process_group)
        check_diagnose(diagnose)
        check_int("headroom_every", headroom_every)
        check_int("outcome_capacity", outcome_capacity)
        spike = check_spike("spike", spike)
        check_bool("skip_nonfinite", skip_nonfinite)
        settings = {"init_scale": init_scale, "growth_factor": growth_factor,
                    "backoff_factor": backoff_factor, "growth_interval": growth_interval}
        if policy is not None:
            check_policy("policy", policy)
            given = [f"{k}={v!r}" for k, v in settings.items() if v is not None]
            if given:
                raise ValueError(f"pass either policy or GradScaler's settings, not both; got "
                                 f"policy={policy!r} and {', '.join(given)}")
        else:
            policy = policy_from_grad_scaler_settings(**settings)
        if not skip_nonfinite and nonfinite_cause(policy) != "nonfinite":
            raise ValueError(f"skip_nonfinite=False (apply non-finite steps, monitoring only) needs a scale "
                             f"fixed at 1 (policy=FixedPolicy(1.0): bf16 or fp32); got policy={policy!r}")
        device_type = None
        if device is not None:
            try:
                device_type = torch.device(device).type
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device must be None, a device type such as 'cuda' or 'cpu', or a "
                                 f"torch.device, got {device!r}") from exc
        if enabled and device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn("LossScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2)
            enabled = False
        self._assign(enabled=enabled, device=device_type, policy=policy, sync_found_inf=sync_found_inf,
                     process_group=process_group, diagnose=diagnose, headroom_every=headroom_every,
                     state=None, outcome_capacity=outcome_capacity, spike=spike,
                     skip_nonfinite=skip_nonfinite)

    def _assign(self, *, enabled: bool, device: str | None, policy: Policy, sync_found_inf: bool | str,
                process_group: Any, diagnose: bool | str, headroom_every: int,
                state: LossScaleState | None, outcome_capacity: int, spike: SpikeRule | None,
                skip_nonfinite: bool) -> None:
        """Set every attribute from checked values: the one place the constructor and unpickling meet."""
        self._device = device
        self._enabled = enabled
        self._policy: Policy = policy
        self.sync_found_inf = sync_found_inf
        self.process_group = process_group
        # The state on the device, in the layout of its update path (None until the device is known).
        self._path: Any = None
        self._one: torch.Tensor | None = None
        # A validated host state waiting for the device (a checkpoint loaded before the first step).
        self._pending: LossScaleState | None = state
        self._per_optimizer: dict[int, _OptimizerState] = defaultdict(_OptimizerState)
        self._last_found_inf: torch.Tensor | None = None
        self._last_code: torch.Tensor | None = None  # the last update's outcome code (None: the flag itself)
        self._last_skipped_on_host: bool | None = None
        self._headroom_every = headroom_every
        self.forensics: GradForensics | None = GradForensics(diagnose, headroom_every) if diagnose else None
        self._watched: weakref.ref | None = None
        self._ledger: LedgerCapture | None = None
        # The step outcomes (made with the path) and what the last read_outcomes saw: the ring's
        # records written, its counts per code, the steps and the skipped steps.
        self._outcome_capacity = outcome_capacity
        self._ring: OutcomeRing | None = None
        self.spike_rule = spike
        self._spike: SpikeWindow | None = None
        self.skip_nonfinite = skip_nonfinite
        self._outcome_cursor = self._cursor_at(self._host_state() if enabled else None)
        # What follows the optimizers (hold): LR schedulers and EMAs held on skipped steps.
        self._holder = Holder()
        self._state_reader: Any = None  # read_state's ScalerReader, made at the first read
        self._stepped: weakref.WeakValueDictionary[int, torch.optim.Optimizer] = weakref.WeakValueDictionary()

    # ------------------------------------------------------------------------------- forensics

    def watch(self, model: torch.nn.Module) -> LossScaler:
        """Name the parameters for ``diagnose``'s per-layer report after ``model``'s modules; returns self.

        Without it layers are called ``param0``, ``param1``... in the optimizer's order. The
        Lightning plugin watches the LightningModule itself. With ``diagnose=False`` the model is
        remembered (weakly) and named when :meth:`set_diagnose` switches the forensics on.
        """
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._watched = weakref.ref(model)
        if self.forensics is not None:
            self.forensics.watch(model)
        return self

    def set_diagnose(self, diagnose: bool | str, headroom_every: int = 1000) -> None:
        """Switch the overflow forensics on (``True``/``"every_step"``) or off (``False``) from now on."""
        check_diagnose(diagnose)
        check_int("headroom_every", headroom_every)
        self._headroom_every = headroom_every
        if not diagnose:
            self.forensics = None
        elif self.forensics is None or self.forensics.mode != diagnose:
            self.forensics = GradForensics(diagnose, headroom_every)
            model = self._watched() if self._watched is not None else None
            if model is not None:
                self.forensics.watch(model)
        else:
            self.forensics.headroom_every = headroom_every

    def track(self, loader: Any = None, *, ledger: Any = None, replay: bool | int = False,
              loss: Callable[[Any], Any] | None = None, ids: str | None = None) -> Any:
        """Record who is in each micro-batch (the ledger of bad steps) and, with ``replay``, replay bad steps.

        ``loader`` (a ``DataLoader``, or a framework's wrapper of one) comes back yielding the same
        batches; its sampler's indices are recorded on the host as the loader takes them (no host read,
        no copy from a device). Each batch it yields is one micro-batch of the coming optimizer step
        (gradient accumulation: every batch until ``update()`` is the same step's).

        The bad steps become entries of the ledger (one JSON line each, ``bad_steps.rank<r>.jsonl``)
        when the interval's outcomes are read (:meth:`read_outcomes`, which the monitors and the logging
        loop call at the log interval): the step, the rank, the micro-batches with their samples, the
        scale and the cause from the skip truth, the replay's verdict. :attr:`ledger` holds them.

        Args:
            loader: the training loader (``None``: only set the options, for a monitor that feeds the
                batches itself).
            ledger: the folder the ledger is written to (put it beside the dashboards, e.g. the
                TensorBoard log directory); ``None``: kept in memory only.
            replay: replay a bad step's batch right after it, before the next batch, on the same weights
                with the step's RNG state: ``True`` (at most 4 per log interval) or the most per interval.
                See :mod:`lossscale_callbacks.torch._replay` for what it costs and leaves unchanged.
            loss: for replay: the forward and the loss of one batch, as your step computes them, without
                the ``autocast`` block: ``lambda batch: loss_fn(model(batch[0]), batch[1])``. Needs
                :meth:`watch` (the model whose gradients are checked).
            ids: the batch's own id field (a mapping key or attribute) instead of the sampler's indices.

        Returns:
            The tracked loader, or ``None`` without one.

        Raises:
            ValueError: a bad ``replay``; ``replay`` without ``loss``, or without a watched model.

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
            >>> scaler = LossScaler(device="cpu").watch(model)
            >>> loader = scaler.track(torch.utils.data.DataLoader(data, batch_size=8))
            >>> [len(batch[0]) for batch in loader]
            [8, 8]
        """
        budget = check_replay(replay)
        if budget and loss is None:
            raise ValueError("replay needs loss=: the forward and the loss of one batch, e.g. "
                             "loss=lambda batch: loss_fn(model(batch[0]), batch[1])")
        if loss is not None and not callable(loss):
            raise ValueError(f"loss must be a callable taking a batch, got {loss!r}")
        if ids is not None and not isinstance(ids, str):
            raise ValueError(f"ids must be None or the name of the batch's id field, got {ids!r}")
        capture = self._ledger
        if capture is None or (capture.replay_budget, capture.loss_of, capture.ids, capture.directory) != (
                budget, loss, ids, ledger):
            capture = LedgerCapture(replay=budget, loss_of=loss, ids=ids, directory=ledger)
            capture.rebase(self._host_state().steps if self._path is None else self.get_state().steps)
            capture.attach(self, self._watched() if self._watched is not None else None)
            self._ledger = capture
        return capture.track(loader) if loader is not None else None

    @property
    def ledger(self) -> Any:
        """The ledger of bad steps (after :meth:`track` and a read of the outcomes): its ``entries`` and,
        in words, ``sentences()``; ``None`` before."""
        return self._ledger.book if self._ledger is not None else None

    @contextlib.contextmanager
    def _forensics_set_aside(self) -> Iterator[None]:
        """The forward trace's hook sees none of a replay's calls: its calls so far are set aside."""
        tracer = self.forensics.tracer if self.forensics is not None else None
        calls = tracer._calls if tracer is not None else None
        if tracer is not None:
            tracer._calls = []
        try:
            yield
        finally:
            if tracer is not None:
                tracer._calls = calls

    def read_forensics(self) -> IntervalForensics | None:
        """The forensics accumulated since the last call (``None`` with ``diagnose=False``). One host read
        (plus :meth:`get_state`'s): call it at the log interval."""
        if self.forensics is None:
            return None
        state = self.get_state()
        return self.forensics.read(int(state.steps), float(state.scale))

    # ----------------------------------------------------------------------------------- state

    @property
    def policy(self) -> Policy:
        """The (immutable) policy; ``load_state_dict`` and the ``set_*`` methods replace it."""
        return self._policy

    @property
    def device(self) -> torch.device | None:
        """Where the state lives; ``None`` until the first :meth:`scale`."""
        return self._path.device if self._path is not None else None

    @property
    def state(self) -> LossScaleState | None:
        """The state as 0-d device tensors (``None`` before the device is known). No host sync.

        ``scale`` is the live float32 tensor the scaler multiplies by; the int64 counters are a
        snapshot made by this call (the update path keeps them in its own layout).
        """
        return self._path.tensors() if self._path is not None else None

    def _lazy_init(self, device: torch.device) -> None:
        # torch.ones/full fill on the device: no host-to-device copy, no stream sync.
        self._one = torch.ones((), dtype=torch.float32, device=device)
        host = self._host_state()
        self._path = make_path(self._policy, device, PathState.from_host(host))
        self._ring = OutcomeRing(device, self._outcome_capacity, steps=host.steps)
        self._path.recorder = self._ring
        if self.spike_rule is not None:
            self._spike = SpikeWindow(self.spike_rule, device)
        if not self.skip_nonfinite:
            self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._pending = None

    def _require_state(self, funcname: str) -> Any:
        if self._path is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._path

    def _host_state(self) -> LossScaleState:
        """The state on the host without touching the device: pending, or the policy's initial state."""
        if self._pending is not None:
            return self._pending
        start = initial_state(self._policy)
        return LossScaleState(float(start.scale), *(int(v) for v in start[1:]))

    def _install(self, policy: Policy, host: LossScaleState) -> None:
        """Make a validated (policy, state) pair current: the one place a state from outside lands."""
        self._policy = policy
        if self._path is None:
            self._pending = host
        else:
            self._path = make_path(policy, self._path.device, PathState.from_host(host))
            assert self._ring is not None
            self._ring.clear(host.steps)  # the records belong to the state this one replaces
            self._path.recorder = self._ring
        self._outcome_cursor = self._cursor_at(host)
        self._per_optimizer = defaultdict(_OptimizerState)

    def _replace_policy(self, policy: Policy) -> None:
        """A new policy for the running state (``set_growth_factor``...): moved on the device, no host read.

        A growth counter at or above a shorter new interval is capped to ``interval - 1``: the next
        finite step grows either way, exactly as ``next_state`` grows any counter >= the interval.
        """
        self._policy = policy
        if self._path is not None:
            self._path = make_path(policy, self._path.device, self._path.export())
            self._path.recorder = self._ring
        elif self._pending is not None:
            cap = policy.constants.growth_interval - 1
            self._pending = self._pending._replace(growth_counter=min(self._pending.growth_counter, cap))

    # GradScaler's private names, read by code written against it. Read-only views of our state.

    @property
    def _scale(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._path.scale if self._path is not None else None

    @property
    def _growth_tracker(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._path.fields()[1] if self._path is not None else None

    @property
    def _init_scale(self) -> float:  # type: ignore[override]
        return self._host_state().scale

    @property
    def _init_growth_tracker(self) -> int:  # type: ignore[override]
        return self._host_state().growth_counter

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._path is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._lazy_init(torch.device(dev))

    # ----------------------------------------------------------------------------------- scale

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> Any:
        """Multiply a tensor (or a nested list/tuple of tensors) by the current scale. No host sync.

        Returns the outputs unchanged when the scaler is disabled.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._path is None:
                self._lazy_init(outputs.device)
            if self.forensics is not None:
                self.forensics.on_scale([outputs])
            if self._spike is not None:
                self._spike.note_loss(outputs)
            return outputs * self._path.scale.to(device=outputs.device, non_blocking=True)
        copies: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._path is None:
                    self._lazy_init(value.device)
                if self.forensics is not None:
                    self.forensics.on_scale([value])
                scale = copies.get(value.device)
                if scale is None:
                    scale = self._path.scale.to(device=value.device, non_blocking=True)
                    copies[value.device] = scale
                return value * scale
            if isinstance(value, Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # --------------------------------------------------------------------------------- unscale

    def _check_and_unscale(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                           allow_fp16: bool, before_user_code: bool = False) -> None:
        """One fused check(+unscale) per (device, dtype) group; records found_inf on the scaler's device.

        ``before_user_code``: the user's ``unscale_``, after which their code (clipping) may rewrite
        the gradients before ``step``: the forensics look at them now, as they were checked (a
        clipped Inf is a NaN by ``step``).
        """
        home = self._path.device
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        # Every parameter with its gradient or None: the forensics plan the optimizer's whole list once.
        entries: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        checked = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        entries.append((param, None))
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # Duplicate indices are summed by coalesce(); check the sums, which may overflow.
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    groups[grad.device][grad.dtype].append(grad)
                    entries.append((param, grad))
                    checked = True
            found_inf = torch.zeros((), dtype=torch.float32, device=home)
            sync = self._should_sync(optimizer)
            if self.forensics is not None and checked:  # sees the gradients while they are still scaled
                self.forensics.check(id(optimizer), entries, self._path.scale,
                                     defer=not (sync or before_user_code))
            for device, by_dtype in groups.items():
                local_inf = found_inf if device == home else torch.zeros_like(found_inf, device=device)
                local_inv = inv_scale if device == home else inv_scale.to(device, non_blocking=True)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, local_inf, local_inv)
                if device != home:
                    torch.maximum(found_inf, local_inf.to(home, non_blocking=True), out=found_inf)
            if sync:
                torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                             group=self.process_group)
                if self.forensics is not None:
                    self.forensics.reduce_flags(self.process_group)
        opt_state = self._per_optimizer[id(optimizer)]
        opt_state.found_inf = found_inf
        opt_state.checked = checked

    def _should_sync(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.sync_found_inf is False:
            return False
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return False
        if dist.get_world_size(self.process_group) < 2:
            return False
        # Looked at only when it matters: a per-parameter walk on every step would cost Python time.
        return self.sync_found_inf is True or any(
            _is_sharded(p) for group in optimizer.param_groups for p in group["params"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """GradScaler's hook for optimizers that unscale themselves: check (not unscale) the gradients."""
        self._require_state("_check_inf_per_device")
        self._check_and_unscale(optimizer, self._one, allow_fp16=True)  # type: ignore[arg-type]
        return self._found_inf_per_device(optimizer)

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        found_inf = self._per_optimizer[id(optimizer)].found_inf
        return {} if found_inf is None else {found_inf.device: found_inf}

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any was Inf/NaN.

        No host sync. Call it at most once per optimizer between :meth:`update` calls, after all
        gradients are accumulated (e.g. before clipping). Raises ``RuntimeError`` when called twice
        or after :meth:`step`, like ``GradScaler``.
        """
        if not self._enabled:
            return
        state = self._require_state("unscale_")
        opt_state = self._per_optimizer[id(optimizer)]
        if opt_state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update().")
        if opt_state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale(optimizer, state, before_user_code=True)

    def _unscale(self, optimizer: torch.optim.Optimizer, state: Any, before_user_code: bool) -> None:
        # GradScaler takes the reciprocal in float64 and rounds it to float32 (3 ops). IEEE float32
        # division is correctly rounded, and rounding a float64 quotient of float32 numbers to float32
        # is too (53 >= 2 * 24 + 2 bits, Figueroa 1995): one op, the same bits (tested on every exponent).
        inv_scale = torch.reciprocal(state.scale)
        self._check_and_unscale(optimizer, inv_scale, allow_fp16=False, before_user_code=before_user_code)
        self._per_optimizer[id(optimizer)].stage = _Stage.UNSCALED

    # ------------------------------------------------------------------------------------ step

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran), then run ``optimizer.step`` unless a gradient was Inf/NaN.

        Host sync: none for optimizers that unscale in their own kernel
        (``_step_supports_amp_scaling``, i.e. ``fused=True``); they receive ``grad_scale`` and
        ``found_inf`` tensors and skip on the device, except before the first applied update of a
        fused ``SGD`` with momentum (one read, see :func:`_fused_sgd_first_step`). Otherwise exactly one
        read of ``found_inf``. Returns what ``optimizer.step`` returned, or ``None`` when the step
        was skipped on the host.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._require_state("step")
        opt_state = self._per_optimizer[id(optimizer)]
        if opt_state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                # GradScaler's older contract: the optimizer asks the scaler itself
                # (_check_inf_per_device, _get_scale_async).
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning, stacklevel=2)
                self._resolve_forensics(optimizer, None)
                retval = optimizer.step(*args, **kwargs, grad_scaler=self)
                opt_state.stage = _Stage.STEPPED
                self._after_step(optimizer, opt_state.found_inf, None)
                return retval
            if opt_state.stage is _Stage.READY:
                # Only the check: the fused kernel unscales with grad_scale itself.
                self._check_and_unscale(optimizer, self._one, allow_fp16=True)  # type: ignore[arg-type]
                grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            skip = self._skip_flag(optimizer, opt_state, grad_scale)
            if _fused_sgd_first_step(optimizer):
                # One read, until the first update is applied (the buffers exist from then on).
                opt_state.skipped_on_host = skip is not None and bool(skip.item())
                self._resolve_forensics(optimizer, opt_state.skipped_on_host)
                if opt_state.skipped_on_host:
                    opt_state.stage = _Stage.STEPPED
                    self._after_step(optimizer, None, True)
                    return None
            self._resolve_forensics(optimizer, None)  # the kernel decides on the device
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = skip  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            opt_state.stage = _Stage.STEPPED
            self._after_step(optimizer, skip, opt_state.skipped_on_host if skip is not None else False)
            return retval

        if opt_state.stage is _Stage.READY:
            self._unscale(optimizer, state, before_user_code=False)
        if not opt_state.checked:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        assert opt_state.found_inf is not None
        skip = self._skip_flag(optimizer, opt_state, None)
        # The one host read of a non-fused step: Python must decide whether to call step() (none when
        # nothing can skip it: non-finite steps applied and no spike rule).
        skipped = skip is not None and bool(skip.item())
        opt_state.skipped_on_host = skipped
        self._resolve_forensics(optimizer, skipped)
        retval = None if skipped else optimizer.step(*args, **kwargs)
        opt_state.stage = _Stage.STEPPED
        self._after_step(optimizer, None, skipped)
        return retval

    def _skip_flag(self, optimizer: torch.optim.Optimizer, opt_state: _OptimizerState,
                   grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The flag that skips the step: the overflow flag, the spike rule's, both merged, or ``None``."""
        skip = opt_state.found_inf if self.skip_nonfinite else None
        if self._spike is not None:
            assert self.spike_rule is not None
            norm = self._grad_norm(optimizer, grad_scale) if self.spike_rule.grad_norm else None
            spike = self._spike.decide(norm)
            skip = spike if skip is None else torch.maximum(skip, spike)
        opt_state.skip = skip
        return skip

    @staticmethod
    def _grad_norm(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> torch.Tensor:
        """The step's gradient norm, unscaled (a fused optimizer's gradients are still scaled here)."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).to(torch.float64)
        return norm if grad_scale is None else norm / grad_scale

    def _after_step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor | None,
                    host_skipped: bool | None) -> None:
        """The step's flag for what follows the optimizer (one device op where a held object reads it)."""
        self._stepped[id(optimizer)] = optimizer
        self._holder.on_step(optimizer, skip=skip, host_skipped=host_skipped)

    # ------------------------------------------------------------------------------------ hold

    def hold(self, follower: Any, *, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Advance ``follower`` only on the steps its optimizer applied; returns it.

        ``follower`` is an LR scheduler (any ``torch.optim.lr_scheduler`` one, Transformers'
        ``get_*_schedule_with_warmup``, a ``SequentialLR`` chain) or an EMA
        (``torch.optim.swa_utils.AveragedModel``). Keep calling ``scheduler.step()`` and
        ``ema.update_parameters(model)`` every iteration, as the PyTorch recipe does: after a skipped
        step they do nothing. No host read is added to the step: with an optimizer that decides on the
        host (non-fused) the held call looks at that decision; with a fused one the learning rate and
        the average's weight follow a device flag (see :mod:`lossscale_callbacks.torch._held`, which
        also lists what needs one read per step: ``ReduceLROnPlateau``, ``cycle_momentum``, a custom
        average). The scheduler object's own counters are brought up to date at each read
        (:meth:`sync_held`; the monitors call it at the log interval).

        Args:
            follower: the scheduler or ``AveragedModel``.
            optimizer: the optimizer an EMA follows (default: the one this scaler steps; required when
                it steps several). A scheduler follows its own ``scheduler.optimizer``.

        Raises:
            ValueError: ``follower`` is neither, is held already, or the EMA's optimizer is ambiguous.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
            >>> scaler = LossScaler(device="cpu")
            >>> sched = scaler.hold(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
            >>> for step in range(3):
            ...     scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            ...     if step == 1:
            ...         model.weight.grad[0, 0] = float("inf")
            ...     _ = scaler.step(opt); scaler.update(); sched.step(); opt.zero_grad()
            >>> sched.last_epoch, sched.get_last_lr()  # two applied steps of three
            (2, [0.25])
        """
        if not self._enabled:
            return follower
        return self._holder.hold(follower, optimizer, known=list(self._stepped.values()))

    def release(self, follower: Any = None) -> None:
        """Stop holding ``follower`` (default: all): its stock methods and float learning rates back."""
        self.sync_held()
        self._holder.release(follower)

    def sync_held(self) -> None:
        """Bring the held schedulers' and EMAs' host side up to date: one read of their device counters
        (none when nothing is held on the device, or when :meth:`read_state_and_outcomes` read them at
        this step already). Call it at the log interval; the monitors' read does."""
        self._holder.sync(self._path.steps if self._path is not None else None)

    @property
    def held(self) -> list[Any]:
        """The held schedulers and EMAs (their follower records: ``obj``, ``mode``, ``steps_taken()``)."""
        return list(self._holder.followers)

    def _resolve_forensics(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        if self.forensics is not None:
            self.forensics.resolve(id(optimizer), skipped)

    # ---------------------------------------------------------------------------------- update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the state by the core's rule on the device. No host sync.

        Every optimizer stepped since the last update contributes its overflow flag; the step
        counts as skipped when any of them overflowed. With one optimizer this dispatches at most
        4 aten ops (policies without hysteresis) or 6 (any policy) on the CPU, and two launches
        (a CUDA graph replayed) on CUDA; each further optimizer adds one op to merge its flag.
        ``new_scale`` (a float or a 1-element tensor) replaces the resulting scale, as in
        ``GradScaler.update(new_scale)``; the step is still counted and the rule still moves the
        growth counter (GradScaler leaves its counter untouched then). ``new_scale`` must lie inside
        the policy's bounds (``ValueError`` otherwise, and nothing changes); a tensor ``new_scale``
        is read once to check it (one host sync, only when you pass one).
        """
        if not self._enabled:
            return
        path = self._require_state("update")
        # One pass over the optimizers stepped since the last update (usually one): this method runs
        # every step, and its Python is a good part of its cost on a CPU.
        flags, skips, checked, on_host = [], [], False, False
        for opt_state in self._per_optimizer.values():
            checked = checked or opt_state.checked
            if opt_state.found_inf is not None:
                flags.append(opt_state.found_inf)
                skips.append(opt_state.skip)
                known = opt_state.skipped_on_host
                on_host = None if known is None or on_host is None else on_host or known
        if new_scale is None and not checked:
            raise AssertionError("No inf checks were recorded prior to update.")
        if new_scale is not None:
            replacement = self._checked_new_scale(new_scale)
        if flags:
            found_inf = flags[0]
            for flag in flags[1:]:
                found_inf = torch.maximum(found_inf, flag.to(found_inf.device, non_blocking=True))
            if self._ledger is not None:  # host bookkeeping; a replay of a bad step, before the scale moves
                with self._forensics_set_aside():
                    self._ledger.end_step(on_host, found_inf, path.scale)
            rule_flag, code = self._step_code(found_inf, skips[0] if len(flags) == 1 else None)
            path.update(rule_flag, code)
            self._last_found_inf, self._last_code = found_inf, code
            self._last_skipped_on_host = on_host
            if self.forensics is not None:
                self.forensics.on_update(found_inf)
        if new_scale is not None:
            path.scale.fill_(replacement)
        self._per_optimizer = defaultdict(_OptimizerState)

    def _step_code(self, found_inf: torch.Tensor, merged: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rule's input and the step's outcome code (``None``: the code is the overflow flag itself).

        The code is :func:`~lossscale_callbacks.skips._outcomes.step_code` in arithmetic (tested equal):
        the rule sees whether the gradients were finite (or nothing, when non-finite steps are applied),
        never the spike rule's decision. The spike window takes the step's values only when it was an
        ordinary applied step. ``merged`` is the one optimizer's skip flag, ``max(found_inf, spike)``,
        when it was made from this ``found_inf`` (saves remaking it)."""
        spike = self._spike.decide() if self._spike is not None else None
        if self.skip_nonfinite:
            rule_flag = found_inf
            code = None
            if spike is not None:  # 2 max(f, s) - f: an overflow (1) wins over a spike (2)
                skip = torch.maximum(found_inf, spike) if merged is None else merged
                code = torch.lerp(found_inf, skip, float(SPIKE_CODE))
                self._spike.commit(skip == 0)
        else:
            rule_flag = self._zero
            code = found_inf * APPLIED_NONFINITE_CODE
            if spike is not None:  # 3f + s(2 - 3f): a spike skip wins over an applied non-finite step
                code = torch.addcmul(code, spike, SPIKE_CODE - code)
                self._spike.commit(code == 0)
        return rule_flag, code

    def _checked_new_scale(self, new_scale: float | torch.Tensor) -> float:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise AssertionError("new_scale should be a float or a 1-element torch.FloatTensor with "
                                     "requires_grad=False.")
            value: Any = new_scale.detach().reshape(()).item()  # the documented host read
        elif isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
            value = float(new_scale)
        else:
            raise ValueError(f"new_scale must be a float or a 1-element tensor, got {new_scale!r}")
        # Only the scale is new; the counters are placeholders that always pass.
        checked = validate_state(self._policy, LossScaleState(value, 0, 0, 0, 0), source="update(new_scale)")
        return checked.scale

    def last_step_skipped(self, sync: bool = False) -> bool | None:
        """Whether the last :meth:`update` counted a skipped step.

        Without ``sync`` this answers only when ``step`` already read the decision on the host
        (non-fused optimizers) and returns ``None`` otherwise; with ``sync=True`` it reads the
        flag from the device (one host sync).
        """
        if self._last_skipped_on_host is not None or not sync:
            return self._last_skipped_on_host
        if self._last_found_inf is None:
            return None
        if self._last_code is None:
            return bool(self._last_found_inf.item())
        code = int(self._last_code.item())  # codes 1 and 2 are skips; 3 (applied non-finite) is not
        return 0 < code < APPLIED_NONFINITE_CODE

    # -------------------------------------------------------------------------- step outcomes

    @staticmethod
    def _cursor_at(state: LossScaleState | None) -> _OutcomeCursor:
        """Where the next :meth:`read_outcomes` starts: after ``state``'s steps, no record read yet."""
        if state is None:
            return _OutcomeCursor((0, 0, 0, 0), 0, 0)
        return _OutcomeCursor((0, 0, 0, 0), int(state.steps), int(state.skipped_steps))

    def read_outcomes(self) -> IntervalOutcomes:
        """The optimizer steps since the previous call that were not ordinary applied steps. One host read.

        Every step since the previous call (or since the scaler started, or loaded a state) that was
        skipped, or applied with non-finite gradients, with its cause and the scale it used, oldest
        first, and the exact counts per cause (see
        :class:`~lossscale_callbacks.skips._outcomes.IntervalOutcomes`). The steps are written on the
        device by :meth:`update` (no host read there); call this at the log interval. In an interval longer
        than the ring (``outcome_capacity`` steps, grown at each read that finds a longer one) the oldest
        steps are not listed (``missed``), and still counted.

        Example:
            >>> scaler = LossScaler(device="cpu", init_scale=1024.0)
            >>> weight = torch.ones(2, requires_grad=True)
            >>> opt = torch.optim.SGD([weight], lr=0.1)
            >>> for step in range(1, 4):
            ...     scaler.scale(weight.sum()).backward()
            ...     if step == 2:
            ...         weight.grad[0] = float("inf")
            ...     _ = scaler.step(opt); scaler.update(); opt.zero_grad()
            >>> outcomes = scaler.read_outcomes()
            >>> outcomes.outcomes, outcomes.applied
            ((StepOutcome(step=2, cause='overflow', scale=1024.0),), 2)
        """
        return self.read_state_and_outcomes()[1]

    def read_state_and_outcomes(self) -> tuple[LossScaleState, IntervalOutcomes]:
        """:meth:`get_state` and :meth:`read_outcomes` in one device-to-host copy (the monitors' read)."""
        cursor = self._outcome_cursor
        if not self._enabled or self._path is None or self._ring is None:
            steps = cursor.steps
            state = self.get_state() if self._enabled else self._host_state()
            return state, IntervalOutcomes(steps + 1, steps)
        ring = self._ring.flat()
        held = self._holder.counters(ring.device)
        state, flat = self._path.read_with(ring if held is None else torch.cat([ring, held]))
        rows, counts, _ = self._ring.parse(flat[:ring.numel()], since=cursor.steps)
        self._holder.apply(flat[ring.numel():], at_step=state.steps)  # the held objects, in the same copy
        # The listed rows as a ring of their own, all new: the core's decoder names the causes.
        outcomes, _ = decode_records([*rows, [0.0, 0.0, 0.0]], len(rows), 0, len(rows),
                                     nonfinite_cause(self._policy))
        new_counts = [now - before for now, before in zip(counts, cursor.counts, strict=True)]
        skipped = state.skipped_steps - cursor.skipped
        by_cause = {nonfinite_cause(self._policy): skipped, "spike": new_counts[2],
                    "applied_nonfinite": new_counts[3]}
        missed = sum(new_counts[1:]) - len(outcomes)
        interval = state.steps - cursor.steps
        if interval > self._ring.capacity and self._ring.grow(interval):
            self._path.recorder = self._ring  # a captured CUDA graph is captured again with the new rows
        self._outcome_cursor = _OutcomeCursor(tuple(counts), state.steps, state.skipped_steps)
        result = IntervalOutcomes(cursor.steps + 1, state.steps, outcomes, by_cause, missed)
        if self._ledger is not None:  # the ledger of bad steps takes the interval's from this one read
            self._ledger.record(result)
        return state, result

    # -------------------------------------------------------------------------- host reads

    def get_state(self) -> LossScaleState:
        """The state as Python numbers. One host sync (a single copy of all five values)."""
        if self._path is None:
            return self._host_state()
        return self._path.read()

    def read_state(self) -> LossScaleState:
        """The state for a :class:`~lossscale_callbacks.LoggingLoop` to read at its log interval:
        ``loop.maybe_observe(step, scaler.read_state)`` and ``loop.finish(scaler.read_state())``.

        :meth:`get_state`, carrying what the loop judges besides: the interval's step outcomes (which
        steps were skipped and why), the counts of the LR schedulers and EMAs that follow the optimizer
        (held or not), and, where a ``torch.distributed`` process group of two or more ranks exists (DDP,
        FSDP), every rank's state, gathered in one ``all_gather`` of four numbers per rank: the loop then
        compares the ranks and names any that disagree, with its scale (the ``ranks_disagree`` health
        rule). It is :class:`~lossscale_callbacks.torch.ScalerReader`'s ``read`` on this scaler. The
        gather is a collective: every rank must call it at the same reads, as a loop run on every rank
        does; :meth:`get_state` never communicates and carries nothing.

        Example:
            >>> scaler = LossScaler(device="cpu", init_scale=1024.0)
            >>> scaler.read_state() == scaler.get_state()  # one process: the same numbers
            True
        """
        if self._state_reader is None:
            # The reader builds on this class (it reads stock scalers too): imported when first needed.
            from lossscale_callbacks.torch._reader import ScalerReader

            self._state_reader = ScalerReader(self)
        return self._state_reader.read()

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). One host sync."""
        if not self._enabled:
            return 1.0
        if self._path is None:
            return self._host_state().scale
        return float(self._path.scale.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._path.scale if self._path is not None else None

    def _get_growth_tracker(self) -> int:
        return self.get_state().growth_counter if self._enabled else 0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._policy.constants.growth_factor

    def get_backoff_factor(self) -> float:
        return self._policy.constants.backoff_factor

    def get_growth_interval(self) -> int:
        return self._policy.constants.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        """GradScaler's setter (a number or a one-element tensor); the factor is rounded to float32 as
        the scale is."""
        self._replace_policy(self._policy.replace(growth_factor=host_number(new_factor)))

    def set_backoff_factor(self, new_factor: float) -> None:
        """GradScaler's setter (a number or a one-element tensor); rounded to float32 as the scale is."""
        self._replace_policy(self._policy.replace(backoff_factor=host_number(new_factor)))

    def set_growth_interval(self, new_interval: int) -> None:
        """GradScaler's setter (a number or a one-element tensor).

        A growth counter at or above the new interval is capped just below it, so the scale grows at
        the next clean step. GradScaler's counter runs past a shrunk interval instead, and its scale
        does not grow again until an overflow resets the counter.
        """
        self._replace_policy(self._policy.replace(growth_interval=host_number(new_interval)))

    # -------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: the policy and the five state values. One host sync.

        Also carries ``GradScaler``'s keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) so code written for it can read the dict, and
        ``GradScaler.load_state_dict`` can load it. Empty when disabled.
        """
        if not self._enabled:
            return {}
        host = self.get_state()
        out: dict[str, Any] = {"policy": self._policy.to_config(), **host._asdict()}
        out.update(growth_factor=self.get_growth_factor(), backoff_factor=self.get_backoff_factor(),
                   growth_interval=self.get_growth_interval(), _growth_tracker=host.growth_counter)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from a ``torch.amp.GradScaler`` state dict. All or nothing.

        A ``LossScaler`` dict brings its own policy. A ``GradScaler`` dict sets the scale and growth
        counter and replaces the policy's growth factor, backoff factor and interval; the other
        counters start from zero; its scale is clamped into the policy's bounds (with a warning), and
        a zero or non-finite scale (what GradScaler reaches after a long run of overflows) is refused.
        Everything is checked before anything changes, also before the device is known.

        Unknown keys are refused, and in a ``LossScaler`` dict GradScaler's keys must agree with the
        policy and the state they mirror.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler), as in GradScaler.
            ValueError: an invalid policy or state, naming the field; the scaler is unchanged.
        """
        if not self._enabled:
            return
        self._install(*parse_state_dict(self._policy, state_dict))

    def __getstate__(self) -> dict[str, Any]:
        """The settings and the state as plain values (like GradScaler, not the tensors); the device is
        found again on first use. Forensics restart empty and the watched model is not pickled."""
        if self._enabled and any(s.stage is not _Stage.READY or s.found_inf is not None
                                 for s in self._per_optimizer.values()):
            raise AssertionError("A GradScaler instance may only be pickled at the beginning of an "
                                 "iteration, or at the end after scaler.update().")
        return {"enabled": self._enabled, "device": self._device, "policy": self._policy.to_config(),
                "state": self.get_state()._asdict() if self._enabled else None,
                "sync_found_inf": self.sync_found_inf, "process_group": self.process_group,
                "diagnose": self.forensics.mode if self.forensics is not None else False,
                "headroom_every": self._headroom_every, "outcome_capacity": self._outcome_capacity,
                "spike": self.spike_rule.to_config() if self.spike_rule is not None else None,
                "skip_nonfinite": self.skip_nonfinite}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`__getstate__`. A pickle is input from outside too: everything is checked
        first (``ValueError`` naming the key, and the object is left as it was)."""
        self._assign(**parse_pickle(state))

    def __repr__(self) -> str:
        where = self.device if self._path is not None else "uninitialized"
        return f"LossScaler(policy={self._policy!r}, device={where}, enabled={self._enabled})"


__all__ = ["LossScaler"]
