"""Every rank's loss-scale state in one small collective, at the log interval (never in the step).

Where a ``torch.distributed`` process group of two or more ranks exists, :func:`gather_states`
sends this rank's (scale, growth counter, skipped steps, steps) as four float64 numbers with one
``all_gather`` and returns every rank's; with one process it returns ``None`` and costs nothing.
Every rank must call it at the same reads (the monitors read on every rank at the same steps).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lossscale_callbacks import LossScaleState
from lossscale_callbacks.integration import RankedState, RankStates

__all__ = ["gather_states", "with_ranks"]

# How long a gather waits for the collective's worker thread to let go of its tensors (see _released).
_RELEASE_WAIT_S = 2.0


def _group_device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: NCCL wants the current CUDA device."""
    backend = str(torch.distributed.get_backend(group))
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_states(state: LossScaleState, group: Any = None) -> RankStates | None:
    """Every rank's state, rank 0 first, or ``None`` without a process group of two or more ranks.

    ``state`` holds host numbers already (the interval's read), so this adds no device read of
    the scaler; the one collective is an ``all_gather`` of 4 float64 numbers per rank.

    Example:
        >>> from lossscale_callbacks._state import LossScaleState
        >>> gather_states(LossScaleState(1024.0, 0, 1, 0, 10)) is None  # one process
        True
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size(group)
    if world < 2:
        return None
    mine = torch.tensor([float(state.scale), float(state.growth_counter), float(state.skipped_steps),
                         float(state.steps)], dtype=torch.float64, device=_group_device(group))
    everyone = mine.new_empty((world, 4))
    rows = list(everyone.unbind(0))
    dist.all_gather(rows, mine, group=group)
    if str(dist.get_backend(group)) == "gloo":
        _released([mine, *rows])
    return RankStates.from_rows(everyone.tolist())  # the one copy to the host


def _released(tensors: list[torch.Tensor]) -> None:
    """Wait, with the GIL let go, until no one but us holds ``tensors`` (at most ``_RELEASE_WAIT_S``).

    For gloo only. gloo's worker thread may let go of a collective's tensors after the collective has
    returned, and needs the GIL to do so (they have Python objects). A process group destroyed
    meanwhile (DDP's reducer, freed with the model at the end of a training function) joins that
    thread while holding the GIL: the process hangs at exit (torch 2.13 with gloo; about one DDP run
    in five on a busy machine, after the last gather). Almost always they are free already, and this
    returns at once.
    """
    if not all(hasattr(t, "_use_count") for t in tensors):  # an older torch: nothing to look at
        return
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(0.0005)


def with_ranks(state: LossScaleState, group: Any = None) -> LossScaleState:
    """``state``, carrying every rank's (a :class:`RankedState`) where a process group exists."""
    ranks = gather_states(state, group)
    return state if ranks is None else RankedState(state, ranks)
