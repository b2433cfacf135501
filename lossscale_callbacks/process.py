"""Process-level helpers for sinks: the rank of this process, closing at exit, and the managed sink base.

Framework-free: the rank comes from the launchers' environment variables, and from
``torch.distributed`` only when the program has already imported and initialised it
(this module never imports torch).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import weakref
from typing import Any

from lossscale_callbacks.sinks import GuardedSink

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


# ---------------------------------------------------------------------------------------------
# Close at exit without keeping sinks alive: atexit holds only a weak reference per sink.

_open_sinks: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def _close_one(ref: weakref.ref[Any]) -> None:
    sink = ref()
    if sink is None:
        return
    with _lock:
        if sink not in _open_sinks:
            return  # closed by its user already
        _open_sinks.discard(sink)
    try:
        sink.close()
    except Exception:  # nothing useful can be done about a failing sink at exit
        pass


def close_at_exit(sink: Any) -> None:
    """Close ``sink`` at interpreter exit unless it was closed (or garbage-collected) before.

    atexit keeps only a weak reference, so registering never keeps a sink alive. Each sink
    registers when it opens, i.e. after its backend (a W&B run) set up its own exit hooks, and
    atexit runs hooks newest first: the sink is closed while its backend still works.
    """
    with _lock:
        if sink in _open_sinks:
            return
        _open_sinks.add(sink)
    atexit.register(_close_one, weakref.ref(sink))


def forget_at_exit(sink: Any) -> None:
    """Undo :func:`close_at_exit` (the sink was closed by its user)."""
    with _lock:
        _open_sinks.discard(sink)


# ---------------------------------------------------------------------------------------------
# The base of dashboard sinks: guarded, rank 0 only, closed at exit.


class ManagedSink(GuardedSink):
    """A sink backend run behind the guard, on rank 0 only, and closed at interpreter exit.

    The dashboard sinks (TensorBoard, W&B) are built on this class so that a plain training
    loop that uses one directly gets the same protection as the framework callbacks: the
    first failure (unwritable folder, full disk, W&B down) is warned once and disables the
    sink, and training goes on. The rank is looked up at the first call (after the program has
    set up ``torch.distributed``); on other ranks every call is a no-op and the backend never
    opens anything. Once the backend has written, it is closed at interpreter exit unless
    :meth:`close` was called before.

    Args:
        backend: the object doing the work, with ``write``, ``write_text``, ``flush``, ``close``.
        name: how warnings name the sink.
        all_ranks: write on every rank, not only rank 0 (for per-rank log folders).
    """

    def __init__(self, backend: Any, name: str, all_ranks: bool = False) -> None:
        super().__init__(backend, name=name)
        self.all_ranks = bool(all_ranks)
        self._writes: bool | None = None

    @property
    def active(self) -> bool:
        """Whether calls reach the backend: not disabled, and on a writing rank."""
        if self.disabled:
            return False
        if self._writes is None:
            self._writes = self.all_ranks or is_rank_zero()
        return self._writes

    def _call(self, method: str, *args: object) -> None:
        if method == "close" and self.disabled:
            forget_at_exit(self)
            try:  # release what the failed backend holds; its failure was warned already
                self.sink.close()
            except Exception:
                pass
            return
        if not self.active:
            return
        if method == "close":
            forget_at_exit(self)
        GuardedSink._call(self, method, *args)
        if method != "close" and not self.disabled:
            close_at_exit(self)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this library.

    Library frames are those of the core and of the integrations (``lossscale_callbacks.*``).
    """
    frame = sys._getframe(1)  # the caller of this function is the one about to warn
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "lossscale_callbacks":
        frame = frame.f_back
        level += 1
    return level
