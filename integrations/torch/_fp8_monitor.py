"""``Fp8ScaleMonitor``: the fp8 scales of a torch model (torchao's float8 training, TransformerEngine's
modules), read at the log interval, on the dashboards and under the health rules."""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, Any

import torch

from lossscale_callbacks import LoggingLoop
from lossscale_callbacks.integration import (
    Fp8Ranks,
    Fp8Read,
    LoggingArgs,
    TensorRead,
    check_int,
    interval_args,
    logging_args,
    require,
)
from lossscale_callbacks.torch._fp8_te import TeScales
from lossscale_callbacks.torch._fp8_torchao import TorchaoCasts
from lossscale_callbacks.torch._rank_gather import _group_device

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["Fp8ScaleMonitor"]


def _compared(tensors: list[TensorRead]) -> list[TensorRead]:
    """The scales every rank must share: a dynamic scale of a (replicated) weight, every delayed scale
    (its amax is reduced across the ranks)."""
    return [t for t in tensors if t.scaling == "delayed" or t.role == "weight"]


class Fp8ScaleMonitor:
    """Watch the per-tensor scales of a torch model's fp8 layers: amax, scale, saturated and underflowed
    values per layer and role, on the dashboards and under the health rules.

    It finds torchao's ``Float8Linear`` layers (``convert_to_float8_training``: the ``tensorwise``,
    ``rowwise`` and ``rowwise_with_gw_hp`` recipes, eager or under ``torch.compile``) and TransformerEngine's
    modules (their ``fp8_meta``: delayed scaling; read by the fields of its v2.18 source and tested on a
    recording of that state, not yet on TransformerEngine itself, which needs CUDA). Call :meth:`step`
    after each optimizer step: every
    ``count_every`` steps the next step's casts are counted on the device (torchao; the other steps carry
    nothing added), and every ``log_every`` steps the counts and TransformerEngine's scales and amax
    histories are read once and handed to the :class:`~lossscale_callbacks.LoggingLoop`: the
    ``fp8/<layer>/<role>/...`` metrics, the fp8 rules (a saturated cast, a zero amax or a non-finite
    scale, a scale left coarse by an outlier, a stale history after a checkpoint load) and the summary.
    Under ``torch.distributed`` the scales every rank must share (a replicated weight's, every delayed
    scale) are compared across the ranks at each read, in one ``all_gather``.

    Args:
        model: the model (wrappers such as DDP and ``torch.compile``'s are looked through).
        log_every: the interval of :class:`~lossscale_callbacks.LoggingLoop`, in optimizer steps (>= 1).
        count_every: optimizer steps between counted steps (>= 1; 1 counts every step).
        process_group: the group the ranks are compared in (default: the whole world).
        **logging: the shared logging arguments (``tensorboard=``, ``wandb=``, ``sinks=``, ``health=``,
            ``echo=``), handed to :class:`~lossscale_callbacks.LoggingLoop` as given; a ``"stop"`` rule
            sets :attr:`should_stop`.

    Raises:
        ValueError: an argument is invalid, or the model has no fp8 layer.
        MissingExtraError: the model has no fp8 layer and torchao is not installed (``pip install
            "lossscale-callbacks[fp8]"``).

    Example:
        >>> from torchao.float8 import convert_to_float8_training  # doctest: +SKIP
        >>> convert_to_float8_training(model)  # doctest: +SKIP
        >>> monitor = Fp8ScaleMonitor(model, log_every=100, tensorboard="runs/fp8")  # doctest: +SKIP
        >>> for batch in loader:  # doctest: +SKIP
        ...     loss_fn(model(batch)).backward(); optimizer.step(); optimizer.zero_grad()
        ...     monitor.step()
        >>> monitor.finish()  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, *, log_every: int = 100, count_every: int = 100,
                 process_group: Any = None, **logging: Unpack[LoggingArgs]) -> None:
        log_every, _ = interval_args("Fp8ScaleMonitor", log_every, None)  # no interval but the count
        self.count_every = check_int("count_every", count_every)
        self.process_group = process_group
        self.torchao = TorchaoCasts()
        self.torchao.watch(model)
        self.te = TeScales()
        self.te.watch(model)
        if not self.torchao.layers and not self.te.layers:
            if importlib.util.find_spec("torchao") is None:
                require("torchao", "fp8", feature="Fp8ScaleMonitor (torchao's float8 training)")
            raise ValueError("Fp8ScaleMonitor found no fp8 layer in the model: convert it with torchao's "
                             "convert_to_float8_training (or build it from TransformerEngine's modules) "
                             "first")
        self.loop = LoggingLoop(None, log_every=log_every, **logging_args("Fp8ScaleMonitor", logging))
        self.log_every: int = self.loop.log_every
        self._step = 0
        self._read_at = 0
        self.te.read(0)  # the baseline of the histories
        self.torchao.counting = self._due(1)

    @property
    def summary(self) -> str | None:
        """The end-of-run summary (after :meth:`finish`)."""
        return self.loop.summary

    @property
    def should_stop(self) -> bool:
        """Whether a ``"stop"`` health rule fired (on every process alike)."""
        return self.loop.should_stop

    @property
    def layers(self) -> tuple[str, ...]:
        """The watched layers."""
        return self.torchao.layers + self.te.layers

    def _due(self, step: int) -> bool:
        return step % self.count_every == 0

    def step(self) -> Fp8Read | None:
        """Count one optimizer step; read the scales when an interval ends (else no host read). Returns
        the read, or ``None``."""
        self._step += 1
        if self.torchao.counting:
            self.torchao.note_step(self._step)
        self.torchao.counting = self._due(self._step + 1)  # the next step's casts
        if not self.loop.due(self._step):
            return None
        read = self._read()
        self.loop.observe(None, fp8=read)
        return read

    def _read(self) -> Fp8Read:
        self._read_at = self._step
        tensors = [*self.torchao.read(self._step), *self.te.read(self._step)]
        return Fp8Read(self._step, tuple(tensors), ranks=self._gather(tensors))

    def _gather(self, tensors: list[TensorRead]) -> Any:
        """Every rank's compared scales (one ``all_gather``), or ``None`` with one process."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group
        world = dist.get_world_size(group)
        if world < 2:
            return None
        compared = _compared(tensors)
        values = [t.scale if t.scale is not None else math.nan for t in compared]
        mine = torch.tensor(values, dtype=torch.float64, device=_group_device(group))
        everyone = mine.new_empty((world, len(values)))
        dist.all_gather(list(everyone.unbind(0)), mine, group=group)
        return Fp8Ranks.from_rows([f"{t.layer}/{t.role}" for t in compared], everyone.tolist())

    def finish(self) -> str:
        """End of training: a last read (when steps passed since the last), the summary (printed on the
        writer, returned everywhere); closes the sinks made from ``tensorboard=``/``wandb=``."""
        if self._read_at != self._step:
            self.loop.observe(None, fp8=self._read())
        self.torchao.counting = False
        return self.loop.finish()
