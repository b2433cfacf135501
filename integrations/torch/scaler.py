"""``LossScaler``: a ``torch.amp.GradScaler``-compatible scaler on the core's update rule.

Where the host synchronises (and nowhere else):

* ``step(optimizer)`` with an optimizer that unscales inside its own kernel (``Adam``, ``AdamW``,
  ``SGD`` with ``fused=True``): **never**. The overflow flag and the scale are handed to the
  optimizer as tensors (``optimizer.found_inf``/``optimizer.grad_scale``) and the fused kernel skips
  the update on the device. One exception: a fused ``SGD`` with momentum reads the flag until its
  first applied update (usually just the first step; see :func:`_fused_sgd_first_step`).
* ``step(optimizer)`` with any other optimizer: **one** read, the skip decision (``found_inf``),
  exactly like ``torch.amp.GradScaler``.
* ``scale``, ``unscale_`` and ``update``: never (the update rule is ``next_state`` on the device).
* ``get_scale``, ``get_state``, ``state_dict``, ``last_step_skipped()`` read the device (one copy each);
  call them at the log interval, not per step.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch

from lossscale_callbacks.policy import DynamicPolicy, FixedPolicy, Policy, policy_from_config
from lossscale_callbacks.state import LossScaleState
from lossscale_callbacks.torch.ops import TorchOps
from lossscale_callbacks.update import initial_state, next_state

_SYNC_CHOICES = (True, False, "auto")
_STATE_KEYS = ("scale", "growth_counter", "hysteresis_left", "skipped_steps", "steps")


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    # One float32 0-d tensor on the scaler's device: 1.0 when any gradient was Inf/NaN, else 0.0.
    found_inf: torch.Tensor | None = None
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


class LossScaler:
    """Dynamic loss scaling with the core's rule, as a drop-in for ``torch.amp.GradScaler``.

    The scaler keeps a :class:`~lossscale_callbacks.state.LossScaleState` of 0-d tensors on the
    device (float32 scale, int64 counters), checks and unscales gradients with torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_`` kernel, and advances the state with the core's
    ``next_state`` in ``update()``, all without reading the device (see the module docstring for
    the one read a non-fused optimizer needs).

    Args:
        policy: a :class:`~lossscale_callbacks.DynamicPolicy` (default ``DynamicPolicy()``) or
            :class:`~lossscale_callbacks.FixedPolicy` (``FixedPolicy(1.0)`` skips and counts
            non-finite steps without scaling: what bf16 wants).
        device: where the state lives. ``None`` takes the device of the first tensor given to
            :meth:`scale` (like ``GradScaler``'s lazy init).
        enabled: ``False`` makes every method a pass-through, like ``GradScaler(enabled=False)``.
        sync_found_inf: all-reduce (MAX) the overflow flag across ranks before the skip decision,
            so every rank skips the same steps. ``"auto"`` does it when ``torch.distributed`` is
            initialised with more than one rank and the parameters are FSDP (v1) flat parameters;
            under DDP the gradients are identical after its all-reduce, and for DTensor gradients
            (FSDP2 ``fully_shard``) torch's DTensor dispatch already reduces the flag. ``True``
            always does it when more than one rank runs (use it for FSDP v1 with
            ``use_orig_params=True``, whose sharded parameters look like plain ones).
        process_group: the group for that all-reduce (default: the world).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = LossScaler(DynamicPolicy(initial_scale=1024.0), device="cpu")
        >>> loss = model(torch.ones(2, 4)).sum()
        >>> scaler.scale(loss).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.get_state().steps
        (1024.0, 1)
    """

    def __init__(
        self,
        policy: Policy | None = None,
        device: str | torch.device | None = None,
        *,
        enabled: bool = True,
        sync_found_inf: bool | str = "auto",
        process_group: Any = None,
    ) -> None:
        if policy is None:
            policy = DynamicPolicy()
        if not isinstance(policy, (DynamicPolicy, FixedPolicy)):
            raise ValueError(f"policy must be a DynamicPolicy, a FixedPolicy or None, got {policy!r}")
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False, got {enabled!r}")
        if not (sync_found_inf is True or sync_found_inf is False or sync_found_inf == "auto"):
            raise ValueError(f"sync_found_inf must be one of {list(_SYNC_CHOICES)}, got {sync_found_inf!r}")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device must be None, a device string or a torch.device, got {device!r}") \
                    from exc
        self._policy: Policy = policy
        self._enabled = enabled
        self.sync_found_inf = sync_found_inf
        self.process_group = process_group
        self._ops: TorchOps | None = None
        self._state: LossScaleState | None = None
        # A loaded checkpoint waits here until the device is known.
        self._pending: dict[str, Any] | None = None
        self._per_optimizer: dict[int, _OptimizerState] = defaultdict(_OptimizerState)
        self._last_found_inf: torch.Tensor | None = None
        self._last_skipped_on_host: bool | None = None
        if device is not None and enabled:
            self._lazy_init(device)

    # ----------------------------------------------------------------------------------- state

    @property
    def policy(self) -> Policy:
        """The (immutable) policy; the ``set_*`` methods replace it."""
        return self._policy

    @property
    def device(self) -> torch.device | None:
        return self._ops.device if self._ops is not None else None

    @property
    def state(self) -> LossScaleState | None:
        """The state as 0-d device tensors (``None`` before the device is known). Reading it does not sync."""
        return self._state

    def _lazy_init(self, device: torch.device) -> None:
        self._ops = TorchOps(device)
        start = initial_state(self._policy, self._ops)
        # Own buffers (not the cached constants) because update() writes into them in place.
        self._state = LossScaleState(*(t.clone() for t in start))
        if self._pending is not None:
            self._fill(self._pending)
            self._pending = None

    def _require_state(self, funcname: str) -> LossScaleState:
        if self._state is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._state

    def _fill(self, values: dict[str, Any]) -> None:
        state = self._state
        assert state is not None
        for key in _STATE_KEYS:
            getattr(state, key).fill_(values[key])

    # ----------------------------------------------------------------------------------- scale

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> Any:
        """Multiply a tensor (or a nested list/tuple of tensors) by the current scale. No host sync.

        Returns the outputs unchanged when the scaler is disabled.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._state is None:
                self._lazy_init(outputs.device)
            scale = self._state.scale  # type: ignore[union-attr]
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        copies: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._state is None:
                    self._lazy_init(value.device)
                scale = copies.get(value.device)
                if scale is None:
                    scale = self._state.scale.to(device=value.device, non_blocking=True)  # type: ignore
                    copies[value.device] = scale
                return value * scale
            if isinstance(value, Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # --------------------------------------------------------------------------------- unscale

    def _check_and_unscale(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                           allow_fp16: bool) -> None:
        """One fused check(+unscale) per (device, dtype) group; records found_inf on the scaler's device."""
        home = self._ops.device  # type: ignore[union-attr]
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # Duplicate indices are summed by coalesce(); check the sums, which may overflow.
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    groups[grad.device][grad.dtype].append(grad)
            found_inf = torch.zeros((), dtype=torch.float32, device=home)
            for device, by_dtype in groups.items():
                local_inf = found_inf if device == home else torch.zeros_like(found_inf, device=device)
                local_inv = inv_scale if device == home else inv_scale.to(device, non_blocking=True)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, local_inf, local_inv)
                if device != home:
                    torch.maximum(found_inf, local_inf.to(home, non_blocking=True), out=found_inf)
            if self._should_sync(optimizer):
                torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                             group=self.process_group)
        opt_state = self._per_optimizer[id(optimizer)]
        opt_state.found_inf = found_inf
        opt_state.checked = bool(groups)

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
        # The reciprocal in float64, then rounded: the same inverse GradScaler uses.
        inv_scale = state.scale.double().reciprocal().float()
        self._check_and_unscale(optimizer, inv_scale, allow_fp16=False)
        opt_state.stage = _Stage.UNSCALED

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
            if opt_state.stage is _Stage.READY:
                # Only the check: the fused kernel unscales with grad_scale itself.
                self._check_and_unscale(optimizer, self._ops.scale(1.0), allow_fp16=True)  # type: ignore
                grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            if _fused_sgd_first_step(optimizer):
                assert opt_state.found_inf is not None
                # One read, until the first update is applied (the buffers exist from then on).
                opt_state.skipped_on_host = bool(opt_state.found_inf.item())
                if opt_state.skipped_on_host:
                    opt_state.stage = _Stage.STEPPED
                    return None
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = opt_state.found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            opt_state.stage = _Stage.STEPPED
            return retval

        if opt_state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if not opt_state.checked:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        assert opt_state.found_inf is not None
        # The one host read of a non-fused step: Python must decide whether to call step().
        skipped = bool(opt_state.found_inf.item())
        opt_state.skipped_on_host = skipped
        retval = None if skipped else optimizer.step(*args, **kwargs)
        opt_state.stage = _Stage.STEPPED
        return retval

    # ---------------------------------------------------------------------------------- update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the state with the core's ``next_state`` on the device. No host sync.

        Every optimizer stepped since the last update contributes its overflow flag; the step
        counts as skipped when any of them overflowed. ``new_scale`` (a float or a 1-element
        tensor) replaces the resulting scale, as in ``GradScaler.update(new_scale)``; the step is
        still counted.
        """
        if not self._enabled:
            return
        state = self._require_state("update")
        ops = self._ops
        assert ops is not None
        flags = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
        if new_scale is None and not any(s.checked for s in self._per_optimizer.values()):
            raise AssertionError("No inf checks were recorded prior to update.")
        if flags:
            found_inf = flags[0]
            for flag in flags[1:]:
                found_inf = torch.maximum(found_inf, flag.to(found_inf.device, non_blocking=True))
            new = next_state(self._policy, state, found_inf == 0, ops)
            # In place, so references to the state tensors stay valid; one foreach launch on CUDA.
            torch._foreach_copy_(list(state), list(new))
            self._last_found_inf = found_inf
            host = [s.skipped_on_host for s in self._per_optimizer.values() if s.found_inf is not None]
            self._last_skipped_on_host = any(host) if all(h is not None for h in host) else None
        if new_scale is not None:
            if isinstance(new_scale, float):
                state.scale.fill_(new_scale)
            else:
                if not isinstance(new_scale, torch.Tensor) or new_scale.numel() != 1 \
                        or new_scale.requires_grad:
                    raise AssertionError("new_scale should be a float or a 1-element torch.FloatTensor "
                                         "with requires_grad=False.")
                state.scale.copy_(new_scale.reshape(()))
        self._per_optimizer = defaultdict(_OptimizerState)

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
        return bool(self._last_found_inf.item())

    # -------------------------------------------------------------------------- host reads

    def get_state(self) -> LossScaleState:
        """The state as Python numbers. One host sync (a single copy of all five values)."""
        if self._state is None:
            source = self._pending or dict(zip(_STATE_KEYS, initial_state(self._policy), strict=True))
            return LossScaleState(float(source["scale"]), *(int(source[k]) for k in _STATE_KEYS[1:]))
        # float64 holds a float32 and an int64 counter below 2**53 exactly: one copy, one sync.
        packed = torch.stack([t.to(torch.float64) for t in self._state]).cpu().tolist()
        return LossScaleState(float(packed[0]), *(int(v) for v in packed[1:]))

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). One host sync."""
        if not self._enabled:
            return 1.0
        if self._state is None:
            return self.get_state().scale
        return float(self._state.scale.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._state.scale if self._state is not None else None

    def _get_growth_tracker(self) -> int:
        return self.get_state().growth_counter if self._enabled else 0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._policy.growth_factor if isinstance(self._policy, DynamicPolicy) else 1.0

    def get_backoff_factor(self) -> float:
        return self._policy.backoff_factor if isinstance(self._policy, DynamicPolicy) else 1.0

    def get_growth_interval(self) -> int:
        return self._policy.growth_interval if isinstance(self._policy, DynamicPolicy) else 1

    def _replace_policy(self, **changes: Any) -> None:
        if not isinstance(self._policy, DynamicPolicy):
            raise ValueError(f"{', '.join(changes)} can only be set on a DynamicPolicy, the policy is "
                             f"{self._policy!r}")
        self._policy = dataclasses.replace(self._policy, **changes)

    def set_growth_factor(self, new_factor: float) -> None:
        self._replace_policy(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._replace_policy(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._replace_policy(growth_interval=new_interval)

    # -------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: the policy and the five state values. One host sync.

        Also carries ``GradScaler``'s keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) so code written for it can read the dict.
        Empty when disabled.
        """
        if not self._enabled:
            return {}
        host = self.get_state()
        out: dict[str, Any] = {"policy": self._policy.to_config(), **host._asdict()}
        out.update(growth_factor=self.get_growth_factor(), backoff_factor=self.get_backoff_factor(),
                   growth_interval=self.get_growth_interval(), _growth_tracker=host.growth_counter)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from a ``torch.amp.GradScaler`` state dict.

        A ``GradScaler`` dict sets the scale and growth counter and replaces the policy's growth
        factor, backoff factor and interval; the other counters start from zero.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        if "policy" in state_dict:
            self._policy = policy_from_config(state_dict["policy"])
            values = {k: state_dict[k] for k in _STATE_KEYS}
        else:
            base = self._policy if isinstance(self._policy, DynamicPolicy) else DynamicPolicy()
            self._policy = dataclasses.replace(
                base, growth_factor=float(state_dict["growth_factor"]),
                backoff_factor=float(state_dict["backoff_factor"]),
                growth_interval=int(state_dict["growth_interval"]))
            values = {"scale": float(state_dict["scale"]),
                      "growth_counter": int(state_dict["_growth_tracker"]),
                      "hysteresis_left": self._policy.hysteresis, "skipped_steps": 0, "steps": 0}
        if self._state is None:
            self._pending = values
        else:
            self._fill(values)
        self._per_optimizer = defaultdict(_OptimizerState)

    def __repr__(self) -> str:
        where = self.device if self._state is not None else "uninitialized"
        return f"LossScaler(policy={self._policy!r}, device={where}, enabled={self._enabled})"


__all__ = ["LossScaler"]
