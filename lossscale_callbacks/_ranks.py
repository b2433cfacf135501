"""Which process this is: the global rank, read from the launchers' environment.

Framework-free: the rank comes from the launchers' environment variables, and from
``torch.distributed`` only when the program has already imported and initialised it
(this module never imports torch).

Example:
    >>> import os
    >>> os.environ.get("RANK") is not None or process_rank() >= 0
    True
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["is_rank_zero", "process_rank"]

# Launchers and the variables they set for the global rank, most specific first:
# torchrun/Lightning (RANK), SLURM (SLURM_PROCID), Open MPI / MPICH / Intel MPI (Horovod), LSF (Lightning).
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "JSM_NAMESPACE_RANK")


def _torch_rank() -> int | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-initialised process group: fall back to the environment
        return None
    return None


def _tf_config_rank(raw: str) -> int | None:
    try:
        config = json.loads(raw)
        task = config.get("task") or {}
        kind, index = str(task.get("type", "")), int(task.get("index", 0))
        cluster = config.get("cluster") or {}
    except (ValueError, TypeError, AttributeError):
        return None
    if not kind:
        return None
    # tf.distribute's chief writes summaries; without a chief, worker 0 plays the chief.
    if kind == "chief":
        return 0
    if kind == "worker":
        return index + 1 if "chief" in cluster else index
    return 1  # parameter servers and evaluators never write training dashboards


def process_rank() -> int:
    """The global rank of this process; 0 when it is not part of a distributed job.

    Looked up in order: an initialised ``torch.distributed`` (only if the program already
    imported it), ``RANK``, ``SLURM_PROCID``, MPI ranks, ``TF_CONFIG``'s task (chief, or
    worker 0 without a chief, is rank 0), then ``LOCAL_RANK`` as a last resort.
    """
    rank = _torch_rank()
    if rank is not None:
        return rank
    for var in _RANK_VARS:
        value = os.environ.get(var, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    tf_config = os.environ.get("TF_CONFIG", "").strip()
    if tf_config:
        rank = _tf_config_rank(tf_config)
        if rank is not None:
            return rank
    local = os.environ.get("LOCAL_RANK", "").strip()
    return int(local) if local.isdigit() else 0


def is_rank_zero() -> bool:
    """Whether this process is the one that writes dashboards (global rank 0)."""
    return process_rank() == 0
