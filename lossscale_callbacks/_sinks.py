"""Where metrics go: the ``Sink`` protocol, an in-memory sink, the guard every sink runs behind, the sinks
a loop opens by name (the registry), their closing at exit, and the policy table they write and read.

A sink receives the metric schema of :mod:`lossscale_callbacks._metrics` at the log interval.
Training must never die because a dashboard is down, so integrations wrap each sink in
:class:`GuardedSink`: the first failure is warned once and the sink is disabled, while the
other sinks and the training run go on.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from lossscale_callbacks._extras import require
from lossscale_callbacks._metrics import POLICY_TAG, config_markdown
from lossscale_callbacks._ranks import is_rank_zero


@runtime_checkable
class Sink(Protocol):
    """A destination for loss-scale metrics (TensorBoard, W&B, memory, ...).

    ``step`` is the number of optimizer steps attempted, skipped ones included.

    Three optional methods, used when a sink has them: ``write_config(config)`` receives the
    policy once per run (without it the sink gets the policy as a markdown table through
    ``write_text``), ``alert_verdict(verdict)`` receives each health problem (W&B alerts), and
    ``write_histogram(step, tag, edges, counts)`` the overflow forensics' gradient histogram.
    """

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def write_text(self, tag: str, markdown: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class InMemorySink:
    """Keeps everything written to it: for tests, notebooks and custom reporting.

    Example:
        >>> sink = InMemorySink()
        >>> sink.write(100, {"loss_scale/scale": 1024.0})
        >>> sink.series("loss_scale/scale")
        [(100, 1024.0)]
    """

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.texts: list[tuple[str, str]] = []
        self.histograms: list[tuple[int, str, tuple[float, ...], tuple[int, ...]]] = []
        self.flushes = 0
        self.closed = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.records.append((int(step), {k: float(v) for k, v in metrics.items()}))

    def write_text(self, tag: str, markdown: str) -> None:
        self.texts.append((tag, markdown))

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        entry = (int(step), tag, tuple(float(e) for e in edges), tuple(int(c) for c in counts))
        self.histograms.append(entry)

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True

    def series(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of one metric, in the order written."""
        return [(step, metrics[name]) for step, metrics in self.records if name in metrics]




class SinkFailureWarning(UserWarning):
    """A sink failed and was disabled; training goes on."""


class GuardedSink:
    """Runs a sink so that its failure costs one warning, never the training run.

    Args:
        sink: any object with the :class:`Sink` methods.
        name: how the warning names the sink (defaults to its class name).
    """

    def __init__(self, sink: Sink, name: str | None = None) -> None:
        for method in ("write", "write_text", "flush", "close"):
            if not callable(getattr(sink, method, None)):
                raise ValueError(f"sink {sink!r} has no callable {method}(); a sink needs "
                                 "write, write_text, flush and close")
        self.sink = sink
        self.name = name or type(sink).__name__
        self.disabled = False

    def _call(self, method: str, *args: object) -> None:
        if self.disabled:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as exc:  # any failure of a dashboard must not reach the training loop
            self.disabled = True
            warnings.warn(
                f"[lossscale-callbacks] the {self.name} sink failed in {method}() and is disabled for "
                f"the rest of this run; training and the other sinks go on. Cause: "
                f"{type(exc).__name__}: {exc}",
                SinkFailureWarning, stacklevel=3,
            )

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._call("write", step, metrics)

    def write_text(self, tag: str, markdown: str) -> None:
        self._call("write_text", tag, markdown)

    def _backend_has(self, method: str) -> bool:
        backend = self.sink
        # A guard around a guard (a managed sink handed to a group) asks the innermost backend.
        while isinstance(backend, GuardedSink) and not callable(getattr(type(backend), method, None)):
            backend = backend.sink
        return callable(getattr(backend, method, None))

    def write_config(self, config: Mapping[str, object]) -> None:
        """The policy, once per run: the sink's own ``write_config``, else a markdown table as text."""
        if self._backend_has("write_config"):
            self._call("write_config", config)
        else:
            self._call("write_text", POLICY_TAG, config_markdown(config))

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        """A histogram (``len(edges) == len(counts) + 1``), for sinks that draw them; others ignore it."""
        if self._backend_has("write_histogram"):
            self._call("write_histogram", step, tag, edges, counts)

    def alert_verdict(self, verdict: object) -> None:
        """A health problem, for sinks that raise alerts (W&B); others ignore it."""
        if self._backend_has("alert_verdict"):
            self._call("alert_verdict", verdict)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        if not self.disabled:
            self._call("close")
            return
        # A disabled sink still holds files or a run: release them, without a second warning.
        try:
            self.sink.close()
        except Exception:  # already reported once when the sink was disabled
            pass


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

    Example:
        >>> memory = InMemorySink()
        >>> sink = ManagedSink(memory, name="memory", all_ranks=True)
        >>> sink.write(1, {"loss_scale/scale": 2.0}); sink.close()
        >>> memory.records, memory.closed
        ([(1, {'loss_scale/scale': 2.0})], True)
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


def guarded_sinks(sinks: Any, name: str = "sinks") -> list[GuardedSink]:
    """``sinks`` checked (an iterable of objects with the Sink methods), each behind its guard.

    Raises:
        ValueError: naming ``name`` when ``sinks`` is not an iterable of sinks (``None``, a string, an
            object without ``write``...).

    Example:
        >>> [type(s).__name__ for s in guarded_sinks([InMemorySink()])]
        ['GuardedSink']
        >>> guarded_sinks(None)
        Traceback (most recent call last):
        ...
        ValueError: sinks must be an iterable of Sink objects (write, write_text, flush, close), got None
    """
    if sinks is None or isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
        raise ValueError(f"{name} must be an iterable of Sink objects (write, write_text, flush, close), "
                         f"got {sinks!r}")
    try:
        return [s if isinstance(s, GuardedSink) else GuardedSink(s) for s in sinks]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


class SinkGroup:
    """Several guarded sinks written together.

    Example:
        >>> memory = InMemorySink()
        >>> group = SinkGroup([memory])
        >>> group.write(10, {"loss_scale/scale": 2.0})
        >>> memory.series("loss_scale/scale")
        [(10, 2.0)]
    """

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self.sinks = guarded_sinks(sinks)

    def __len__(self) -> int:
        return len(self.sinks)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def write_text(self, tag: str, markdown: str) -> None:
        for sink in self.sinks:
            sink.write_text(tag, markdown)

    def write_config(self, config: Mapping[str, object]) -> None:
        for sink in self.sinks:
            sink.write_config(config)

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        for sink in self.sinks:
            sink.write_histogram(step, tag, edges, counts)

    def alert_verdicts(self, verdicts: Iterable[object]) -> None:
        verdicts = list(verdicts)
        for sink in self.sinks:
            for verdict in verdicts:
                sink.alert_verdict(verdict)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

# ----------------------------------------
# Closing sinks at interpreter exit without keeping them alive: atexit holds a weak reference per sink.


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

# ----------------------------------------
# The sinks a logging loop opens itself, by name: ``tensorboard=``, ``wandb=`` and ``sinks={name: value}``.
#
# One registry of sink classes by name: :func:`register_sink` adds one (a new sink is one class and
# this one entry), the ``lossscale_callbacks.sinks`` entry points add the installed integrations'
# (so the core imports no integration by name). Every integration passes ``sinks=`` to its
# :class:`~lossscale_callbacks.LoggingLoop`, so a registered name works in all of them. The values
# are checked once, when the object is constructed: a bad value is a ``ValueError`` naming the
# argument, a missing package a :class:`~lossscale_callbacks.extend.MissingExtraError` naming the
# pip extra, never an error in the middle of training.


ENTRY_POINT_GROUP = "lossscale_callbacks.sinks"

# name -> (the outside module its sink needs, the extra that installs it)
_PACKAGES = {"tensorboard": ("tensorboard.compat.proto.event_pb2", "tensorboard"),
             "wandb": ("wandb", "wandb")}


def check_tensorboard(value: Any) -> str | None:
    """``tensorboard=``: ``None`` or a non-empty log directory (``str`` or ``os.PathLike``), as a ``str``."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"tensorboard must be None or a non-empty log directory path, got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise ValueError(f"tensorboard must be a text path, got the bytes path {value!r}")
    return path


def check_wandb(value: Any) -> dict[str, Any] | None:
    """``wandb=``: ``None``/``False`` (none), ``True`` (the active or a new run), or ``wandb.init`` args."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"wandb must be None, a bool, or a dict of wandb.init arguments, got {value!r}")
    return dict(value)


# name -> the sink class (or any callable returning a sink) registered by register_sink.
_REGISTRY: dict[str, Callable[..., Sink]] = {}


def register_sink(name: str, factory: Callable[..., Sink]) -> None:
    """Make a sink usable by name: ``sinks={name: value}`` in a ``LoggingLoop`` and every integration.

    The loop opens ``factory()`` for ``True``, ``factory(**value)`` for a mapping and ``factory(value)``
    for anything else, once per run and on the writing process only, and closes it at the run's end.

    Args:
        name: the name users write (not ``tensorboard`` or ``wandb``, which are taken).
        factory: the sink class, or a callable that returns a sink.

    Raises:
        ValueError: ``name`` is not a non-empty string, is taken, or ``factory`` is not callable.

    Example:
        >>> from lossscale_callbacks import InMemorySink, LoggingLoop
        >>> register_sink("memory", lambda value: InMemorySink())
        >>> LoggingLoop(log_every=10, sinks={"memory": "unused"}, echo=None).log_every
        10
    """
    if not isinstance(name, str) or not name.isidentifier() or name in _PACKAGES:
        raise ValueError(f"name must be an identifier other than {sorted(_PACKAGES)}, got {name!r}")
    if not callable(factory):
        raise ValueError(f"factory must be a sink class or a callable returning a sink, got {factory!r}")
    _REGISTRY[name] = factory


def named_sinks(sinks: Any) -> tuple[list[GuardedSink], dict[str, Any]]:
    """``sinks=`` split into the sink objects (guarded) and the sinks given by name, ``{name: value}``.

    Raises:
        ValueError: a name that no sink is registered under (the known names are listed), or
            ``sinks`` is neither a mapping of names nor an iterable of sinks.
    """
    if not isinstance(sinks, Mapping):
        return guarded_sinks(sinks), {}
    known = sorted({*_REGISTRY, *_PACKAGES, *(entry.name for entry in entry_points(group=ENTRY_POINT_GROUP))})
    unknown = [name for name in sinks if name not in known]
    if unknown:
        raise ValueError(f"sinks: each name must be one of {known} (register_sink adds one), got {unknown}")
    return [], dict(sinks)


def _open(name: str, value: Any) -> Sink:
    factory = _sink_class(name)
    if value is True:
        return factory()
    if isinstance(value, Mapping):
        return factory(**value)
    return factory(value)


def _sink_class(name: str) -> Any:
    if name in _REGISTRY:
        return _REGISTRY[name]
    module, extra = _PACKAGES.get(name, (None, None))
    if module is not None:
        require(module, extra, feature=f"{name}=")
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return entry.load()
    raise ImportError(f"{name}= needs the {name!r} entry point of the {ENTRY_POINT_GROUP!r} group, which "
                      "this installation of lossscale-callbacks lacks; reinstall it (pip install "
                      f'"lossscale-callbacks[{extra}]")')


def owned_sinks(tensorboard: Any, wandb: Any, named: Mapping[str, Any] | None = None) -> list[Sink]:
    """New sinks for ``tensorboard=``, ``wandb=`` and the named ones of ``sinks=``, checked; they open
    nothing before their first write.

    Raises:
        ValueError: an argument is not what it may be (``wandb``'s ``wandb.init`` arguments and
            its ``mode`` are checked by :class:`~lossscale_callbacks.wandb.WandbSink`).
        MissingExtraError: the package a sink needs is not installed.
    """
    values = {"tensorboard": check_tensorboard(tensorboard), "wandb": check_wandb(wandb), **(named or {})}
    sinks: list[Sink] = []
    for name, value in values.items():
        if value is None:
            continue
        try:
            sinks.append(_open(name, value))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return sinks

# ----------------------------------------
# The policy table the sinks write once per run (``loss_scale/policy``), read back by the run readers.
#
# The sinks write the policy as a two-column markdown table
# (:func:`lossscale_callbacks._sinks.config_markdown`);
# TensorBoard keeps it as a text summary. The readers turn it back into the policy's bounds and
# growth interval, so that ``lossscale-callbacks report`` judges a run against the policy it ran with.


# The examples of the sections above, run by doctest as the docstrings' are.
__test__ = {
    "at_exit": """
    >>> from lossscale_callbacks._sinks import InMemorySink
    >>> sink = InMemorySink()
    >>> close_at_exit(sink)   # closed at exit unless closed before
    >>> forget_at_exit(sink)  # ... which its close() says with this
""",
    "owned_sinks": """
    >>> check_tensorboard("")
    Traceback (most recent call last):
    ...
    ValueError: tensorboard must be None or a non-empty log directory path, got ''
    >>> owned_sinks(None, None)
    []
""",
}
