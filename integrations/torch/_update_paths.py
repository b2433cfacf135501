"""How :class:`~lossscale_callbacks.torch.LossScaler` runs the core's update rule in a few kernel launches.

The rule is :func:`lossscale_callbacks.next_state`, written once. Written with
:class:`~lossscale_callbacks.torch._ops.TorchOps` it is 22 tiny elementwise ops, and on a GPU every op
is a kernel launch. A *path* holds the state in the layout its ops need and advances it with fewer
ops; each one is an implementation of ``next_state`` that ``tests/test_torch_update_paths.py`` proves
bit-identical to the NumPy reference on generated step sequences (random policies, factors that are
not powers of two, hysteresis 1 to 4, both bounds reached):

==========================  ============================================  ============================
path                        used for                                      aten ops per ``update()``
==========================  ============================================  ============================
:class:`AmpPath`            ``hysteresis <= 1`` (the default policy,      4
                            GradScaler's settings, ``FixedPolicy``)
:class:`TablePath`          any other policy on the CPU                   6
:class:`RulePath`           any other policy on another device            ``next_state``'s 24
==========================  ============================================  ============================

On CUDA, whichever path the policy gets is captured once into a CUDA graph
(:class:`CudaGraphPath`) and replayed: two launches per update (the overflow flag copied into the
graph's input, and the replay) for every policy. Inside a graph the user is capturing, the path runs
as plain ops, so it becomes part of that graph.

Counters the user reads are exact integers: ``steps`` is counted on the host (one ``update()`` with
an overflow flag is one step, so no device op is needed), and ``skipped_steps`` is a host number
(what the state held when the path was built) plus the skips since then, summed on the device: in
float32 (the flag's dtype, the cheap add) and folded into a float64 count every 2**20 steps (two more
ops), before float32 could round; float64 is exact below 2**53 skipped steps (285 years at a step
per microsecond).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

from lossscale_callbacks import LossScaleState, next_state
from lossscale_callbacks.integration import Policy
from lossscale_callbacks.torch._ops import TorchOps

_FOLD_EVERY = 2**20  # float32 counts integers exactly up to 2**24

_AMP_DEVICES = ("cpu", "cuda")


def _f32(value: float) -> float:
    """``value`` rounded to float32, as the rule rounds its constants."""
    return float(np.float32(value))


def _put(target: torch.Tensor, value: Any) -> None:
    """Write a host number or a device tensor into ``target``; no host-to-device copy for numbers."""
    if isinstance(value, torch.Tensor):
        target.copy_(value)
    else:
        target.fill_(value)


class PathState(NamedTuple):
    """What a path is built from: the rule's first three fields and the two counters.

    ``scale``, ``growth_counter`` and ``hysteresis_left`` are host numbers or 0-d tensors on the
    path's device (when one path replaces another, e.g. after ``set_growth_factor``, nothing is
    read back). ``skipped_base`` and ``steps`` are host integers, ``skipped_new`` a float64 device
    count added to ``skipped_base`` (``None`` for zero).
    """

    scale: Any
    growth_counter: Any
    hysteresis_left: Any
    skipped_base: int
    steps: int
    skipped_new: torch.Tensor | None = None

    @classmethod
    def from_host(cls, state: LossScaleState) -> PathState:
        """A validated host state (a checkpoint, the policy's initial state): Python or NumPy numbers."""
        return cls(float(state.scale), *(int(v) for v in state[1:]))


class _Path:
    """Shared by the paths: the counters, the three views, and the one host read."""

    name = ""

    def __init__(self, policy: Policy, device: torch.device, start: PathState) -> None:
        self.policy = policy
        self.device = device
        self.steps = start.steps
        self._skipped_base = start.skipped_base
        self._skipped_new = torch.zeros((), dtype=torch.float64, device=device)
        if start.skipped_new is not None:
            self._skipped_new.copy_(start.skipped_new)
        # Skips since the last fold, in the flag's own dtype: adding float32 to float32 is the cheap op
        # (a float64 sum would cast every step). Folded into the float64 count before it could round.
        self._recent: torch.Tensor | None = torch.zeros((), dtype=torch.float32, device=device)
        self._since_fold = 0
        self.scale: torch.Tensor  # 0-d float32, updated in place: the tensor the scaler multiplies by
        # The step outcomes' ring (lossscale_callbacks.torch._outcome_ring), written before each update.
        self.recorder: Any = None

    def update(self, found_inf: torch.Tensor, code: torch.Tensor | None = None) -> None:
        """Advance one optimizer step; ``found_inf`` is the step's float32 overflow flag (the rule's
        input), ``code`` the step's outcome code for the recorder (default: ``found_inf``, a non-finite
        skip). No host sync."""
        self.recorded_step(found_inf, code)
        self.after_step()

    def recorded_step(self, found_inf: torch.Tensor, code: torch.Tensor | None = None) -> None:
        """The step's outcome recorded (with the scale it used), then the rule's device ops."""
        if self.recorder is not None:
            self.recorder.record(found_inf if code is None else code, self.scale)
        self.device_step(found_inf)

    def after_step(self) -> None:
        """The host's part of a step (also after a CUDA graph replay): count it, fold every 2**20 steps."""
        self.steps += 1
        self._since_fold += 1
        if self._since_fold == _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        if self._recent is not None:
            self._skipped_new.add_(self._recent)
            self._recent.zero_()
        self._since_fold = 0

    def _skipped(self) -> torch.Tensor:
        """Skips since the path was built, float64 on the device."""
        return self._skipped_new if self._recent is None else self._skipped_new + self._recent

    def device_step(self, found_inf: torch.Tensor) -> None:
        """The step's device ops (what a CUDA graph captures)."""
        raise NotImplementedError

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``scale``, ``growth_counter``, ``hysteresis_left`` as 0-d device tensors of the path's dtypes."""
        raise NotImplementedError

    def export(self) -> PathState:
        """The state on the device, for building another path from it without a host read."""
        return PathState(*self.fields(), self._skipped_base, self.steps, self._skipped())

    def tensors(self) -> LossScaleState:
        """The state as 0-d device tensors: float32 scale (the live one), int64 counters. No host sync."""
        scale, growth, hysteresis = self.fields()
        skipped = self._skipped().to(torch.int64) + self._skipped_base
        steps = torch.full((), self.steps, dtype=torch.int64, device=self.device)
        return LossScaleState(scale, growth.to(torch.int64), hysteresis.to(torch.int64), skipped, steps)

    def read(self) -> LossScaleState:
        """The state as Python numbers: one device-to-host copy (float64 holds every field exactly)."""
        return self.read_with(None)[0]

    def read_with(self, extra: torch.Tensor | None) -> tuple[LossScaleState, list[float]]:
        """The state and ``extra`` (a flat float64 device tensor, e.g. the outcome ring) in one copy."""
        parts = [t.to(torch.float64).reshape(1) for t in (*self.fields(), self._skipped())]
        values = torch.cat(parts if extra is None else [*parts, extra]).cpu().tolist()
        scale, growth, hysteresis, skipped = values[:4]
        state = LossScaleState(float(scale), int(growth), int(hysteresis), self._skipped_base + int(skipped),
                               self.steps)
        return state, values[4:]


class AmpPath(_Path):
    """``hysteresis <= 1``: torch's fused ``_amp_update_scale_`` twice, one clamp, one count. 4 aten ops.

    ``torch._amp_update_scale_(scale, tracker, found_inf, growth, backoff, interval)`` is
    ``GradScaler``'s update: back off and reset the tracker on an overflow, else count, and grow and
    reset on reaching the interval. With the factors rounded to float32 first it computes the rule's
    float32 products, so a clamp to ``[min_scale, max_scale]`` afterwards gives ``next_state``'s scale
    and growth counter. The second call tracks ``hysteresis_left`` (0 or 1) as ``mark = 2**h``: it
    doubles on growth and halves on an overflow, and the same clamp keeps it in ``[1, 2**h]``.
    """

    name = "amp"

    def __init__(self, policy: Policy, device: torch.device, start: PathState) -> None:
        super().__init__(policy, device, start)
        c = policy.constants
        self._settings = (_f32(c.growth_factor), _f32(c.backoff_factor), c.growth_interval)
        self._packed = torch.empty(2, dtype=torch.float32, device=device)  # scale, 2 ** hysteresis_left
        self.scale = self._packed[0]
        _put(self.scale, start.scale)
        _put(self._packed[1], start.hysteresis_left)
        self._packed[1].add_(1.0)  # 2**h == h + 1 for h in {0, 1}
        self._tracker = torch.empty((), dtype=torch.int32, device=device)
        _put(self._tracker, start.growth_counter)
        self._tracker.clamp_(max=c.growth_interval - 1)
        self._mark_tracker = self._tracker.clone()
        # Views made once: a view made in the step would be one more dispatched op.
        self._scale_slot, self._mark_slot = self._packed[0:1], self._packed[1:2]
        self._low = torch.empty(2, dtype=torch.float32, device=device)
        self._high = torch.empty(2, dtype=torch.float32, device=device)
        for i, (low, high) in enumerate(((c.min_scale, c.max_scale), (1.0, 2.0**c.hysteresis))):
            self._low[i].fill_(_f32(low))
            self._high[i].fill_(_f32(high))

    def device_step(self, found_inf: torch.Tensor) -> None:
        growth, backoff, interval = self._settings
        torch._amp_update_scale_(self._scale_slot, self._tracker, found_inf, growth, backoff, interval)
        torch._amp_update_scale_(self._mark_slot, self._mark_tracker, found_inf, 2.0, 0.5, interval)
        self._packed.clamp_(self._low, self._high)
        self._recent.add_(found_inf)  # type: ignore[union-attr]

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.scale, self._tracker, self._packed[1] - 1.0


class TablePath(_Path):
    """Any policy on the CPU: the step's outcome picks one row of a transition table. 6 aten ops.

    The counters live in a float64 row ``v = [growth_counter, hysteresis_left, d, skipped, factor,
    1]`` with ``d = growth_interval + hysteresis_left - growth_counter``. The rule has four outcomes
    (finite; finite and grow; overflow and back off; overflow within the hysteresis), and
    ``key = growth_counter + found_inf * d`` tells them apart with one ``bucketize``: finite steps
    give ``growth_counter`` (growth at ``growth_interval - 1``), overflows ``growth_interval +
    hysteresis_left`` (backoff at ``hysteresis_left <= 1``). Each outcome's successor of ``v`` is
    linear in ``v``: one ``mv`` computes all four, ``index_select`` keeps the outcome's, whose
    ``factor`` (the growth or backoff factor, or 1) then multiplies the float32 scale (the exact
    float64 product of two float32 numbers, rounded once: the rule's float32 product) before a
    clamp to the bounds. The counters are integers below 2**53 in float64: exact for every policy.
    """

    name = "table"
    _FIELDS = 6  # growth_counter, hysteresis_left, d, skipped, factor, 1

    def __init__(self, policy: Policy, device: torch.device, start: PathState) -> None:
        super().__init__(policy, device, start)
        c = policy.constants
        interval = c.growth_interval
        self.scale = torch.empty((), dtype=torch.float32, device=device)
        _put(self.scale, start.scale)
        self._row = torch.zeros(1, self._FIELDS, dtype=torch.float64, device=device)
        v = self._row[0]
        _put(v[0], start.growth_counter)
        v[0].clamp_(max=interval - 1)
        _put(v[1], start.hysteresis_left)
        v[2].fill_(interval).add_(v[1]).sub_(v[0])
        v[3].copy_(self._skipped_new)
        v[5].fill_(1.0)
        self._skipped_new, self._recent = v[3], None
        self._table = self._transitions(c.growth_factor, c.backoff_factor, interval, c.hysteresis).to(device)
        self._boundaries = torch.tensor([interval - 1.5, interval - 0.5, interval + 1.5], dtype=torch.float64,
                                        device=device)
        self._key = torch.empty(1, dtype=torch.float64, device=device)
        self._outcome = torch.empty(1, dtype=torch.int64, device=device)
        self._candidates = torch.empty(4 * self._FIELDS, dtype=torch.float64, device=device)
        # Views made once: a view made in the step would be one more dispatched op.
        self._outcomes = self._candidates.view(4, self._FIELDS)
        self._v, self._counter, self._d, self._factor = v, self._row[:, 0], self._row[:, 2], v[4]
        self._bounds = (_f32(c.min_scale), _f32(c.max_scale))

    @classmethod
    def _transitions(cls, growth: float, backoff: float, interval: int, h: int) -> torch.Tensor:
        """Rows ``outcome * 6 + field``, columns the fields of ``v``: the new ``v`` is ``T[outcome] @ v``."""
        g, hl, d, skipped, factor, one = range(cls._FIELDS)
        table = torch.zeros(4, cls._FIELDS, cls._FIELDS, dtype=torch.float64)
        table[:, one, one] = 1.0
        table[:, skipped, skipped] = 1.0
        # 0: finite, no growth: the counter counts.
        table[0, g, g], table[0, g, one] = 1.0, 1.0
        table[0, hl, hl] = 1.0
        table[0, d, d], table[0, d, one] = 1.0, -1.0
        table[0, factor, one] = 1.0
        # 1: finite, growth: counter 0, hysteresis refilled, scale * growth_factor.
        table[1, hl, one], table[1, d, one], table[1, factor, one] = h, interval + h, _f32(growth)
        # 2: overflow at hysteresis_left <= 1: counter 0, hysteresis 0, one skip, scale * backoff_factor.
        table[2, d, one], table[2, skipped, one], table[2, factor, one] = interval, 1.0, _f32(backoff)
        # 3: overflow with hysteresis to spare: counter 0, one overflow used, one skip, scale kept.
        table[3, hl, hl], table[3, hl, one] = 1.0, -1.0
        table[3, d, hl], table[3, d, one] = 1.0, interval - 1
        table[3, skipped, one], table[3, factor, one] = 1.0, 1.0
        return table.reshape(4 * cls._FIELDS, cls._FIELDS)

    def device_step(self, found_inf: torch.Tensor) -> None:
        torch.addcmul(self._counter, found_inf, self._d, out=self._key)
        torch.bucketize(self._key, self._boundaries, out=self._outcome)
        torch.mv(self._table, self._v, out=self._candidates)
        torch.index_select(self._outcomes, 0, self._outcome, out=self._row)
        torch.mul(self.scale, self._factor, out=self.scale)
        self.scale.clamp_(*self._bounds)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.scale, self._v[0], self._v[1]


class RulePath(_Path):
    """Any policy on any device: ``next_state`` itself on
    :class:`~lossscale_callbacks.torch._ops.TorchOps`."""

    name = "rule"

    def __init__(self, policy: Policy, device: torch.device, start: PathState) -> None:
        super().__init__(policy, device, start)
        self._ops = TorchOps(device)
        dtypes = (torch.float32, torch.int64, torch.int64)
        self._fields = [torch.empty((), dtype=d, device=device) for d in dtypes]
        for tensor, value in zip(self._fields, start[:3], strict=True):
            _put(tensor, value)
        self._fields[1].clamp_(max=policy.constants.growth_interval - 1)
        self.scale = self._fields[0]
        self._zero = self._ops.count(0)
        # Creates the ops' cached constants now, outside any CUDA graph capture.
        next_state(policy, LossScaleState(*self._fields, self._zero, self._zero), True, self._ops)

    def device_step(self, found_inf: torch.Tensor) -> None:
        state = LossScaleState(*self._fields, self._zero, self._zero)
        new = next_state(self.policy, state, found_inf == 0, self._ops)
        torch._foreach_copy_(self._fields, list(new[:3]))
        self._recent.add_(found_inf)  # type: ignore[union-attr]

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._fields[0], self._fields[1], self._fields[2]


class CudaGraphPath:
    """A path on CUDA, its step captured once into a CUDA graph: two launches per update.

    The capture happens at the first :meth:`update` (it records, it does not run the ops, so the
    state is untouched); each update then copies the flag into the graph's input and replays. If
    the capture fails (a driver without graph support), the path runs as plain ops, with a warning.
    """

    def __init__(self, path: _Path) -> None:
        self.path = path
        self.scale = path.scale
        self._input = torch.zeros((), dtype=torch.float32, device=path.device)
        self._code = torch.zeros((), dtype=torch.float32, device=path.device)
        self._graph: Any = None  # None: not captured yet; False: capture failed, run the ops
        self._with_code = False  # whether the captured graph reads a code of its own (a third launch)

    # The scaler reads a path through these names whatever its class (tests/test_torch_update_paths.py
    # checks that the wrapper answers every public name a plain path has).
    @property
    def device(self) -> torch.device:
        return self.path.device

    @property
    def policy(self) -> Policy:
        return self.path.policy

    @property
    def steps(self) -> int:
        return self.path.steps

    @property
    def name(self) -> str:
        return f"cuda_graph({self.path.name})"

    @property
    def recorder(self) -> Any:
        return self.path.recorder

    @recorder.setter
    def recorder(self, recorder: Any) -> None:
        self.path.recorder = recorder
        self._graph = None if self._graph is not False else False  # captured again with it

    def update(self, found_inf: torch.Tensor, code: torch.Tensor | None = None) -> None:
        if self._graph is False or torch.cuda.is_current_stream_capturing():
            self.path.update(found_inf, code)  # a graph being captured by the user takes the plain ops
            return
        if self._graph is None or self._with_code != (code is not None):
            self._with_code = code is not None
            self._graph = self._capture()
            if self._graph is False:
                self.path.update(found_inf, code)
                return
        self._input.copy_(found_inf)
        if code is not None:
            self._code.copy_(code)
        self._graph.replay()
        self.path.after_step()

    def _capture(self) -> Any:
        device = self.path.device
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.path.recorded_step(self._input, self._code if self._with_code else None)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            warnings.warn(f"LossScaler: capturing the update into a CUDA graph failed ({exc}); running "
                          "it as plain ops", RuntimeWarning, stacklevel=4)
            return False
        torch.cuda.current_stream(device).wait_stream(stream)
        return graph

    def export(self) -> PathState:
        return self.path.export()

    def tensors(self) -> LossScaleState:
        return self.path.tensors()

    def read(self) -> LossScaleState:
        return self.path.read()

    def read_with(self, extra: torch.Tensor | None) -> tuple[LossScaleState, list[float]]:
        return self.path.read_with(extra)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.path.fields()


def path_class(policy: Policy, device: torch.device) -> type[_Path]:
    """The path a policy gets on a device (see the module docstring)."""
    c = policy.constants
    if c.hysteresis <= 1 and device.type in _AMP_DEVICES:
        return AmpPath
    if device.type == "cpu":
        return TablePath
    return RulePath


def make_path(policy: Policy, device: torch.device, start: PathState) -> Any:
    """The path for ``policy`` on ``device``, started from ``start``; captured into a CUDA graph on CUDA.

    Example:
        >>> from lossscale_callbacks._policy import DynamicPolicy
        >>> from lossscale_callbacks._update import initial_state
        >>> policy = DynamicPolicy(initial_scale=8.0)
        >>> path = make_path(policy, torch.device("cpu"), PathState.from_host(initial_state(policy)))
        >>> path.update(torch.tensor(1.0))  # one overflow
        >>> path.name, path.read()
        ('amp', LossScaleState(scale=4.0, growth_counter=0, hysteresis_left=0, skipped_steps=1, steps=1))
    """
    path = path_class(policy, device)(policy, device, start)
    if device.type == "cuda":
        return CudaGraphPath(path)
    return path


__all__ = ["AmpPath", "CudaGraphPath", "PathState", "RulePath", "TablePath", "make_path",
           "path_class"]
