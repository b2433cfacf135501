"""W&B sink: loss-scale metrics on their own step axis, a run summary, reports as tables, health alerts.

W&B does its network I/O in its own service process: ``run.log`` hands the row to that
process over a local socket and returns, online or offline, whether or not the network is up.
The sink adds no network call of its own to the training loop (``benchmarks/sink_write.py``
measures the cost of a write).
"""

from __future__ import annotations

import inspect
import netrc
import os
import socket
import time
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import wandb

from lossscale_callbacks.integration import (
    APPLIED_STEPS,
    FINAL_SCALE,
    OVERALL_SKIP_RATE,
    SCALE,
    SKIPPED_STEPS,
    STEP_METRIC,
    TAG_PREFIX,
    TOTAL_APPLIED_STEPS,
    TOTAL_SKIPPED_STEPS,
    ManagedSink,
    Verdict,
    check_number,
    user_stacklevel,
)

__all__ = [
    "FINAL_SCALE",
    "OVERALL_SKIP_RATE",
    "STEP_METRIC",
    "TOTAL_APPLIED_STEPS",
    "TOTAL_SKIPPED_STEPS",
    "WandbOfflineWarning",
    "WandbSink",
    "verdict_alert",
]


_LEVELS = ("INFO", "WARN", "ERROR")
_VERDICT_LEVEL = {"warn": "WARN", "stop": "ERROR", "raise": "ERROR"}


class WandbOfflineWarning(UserWarning):
    """W&B could not run online (no API key, no network); the run is logged offline instead."""


def _has_credentials() -> bool:
    """Whether W&B can authenticate without prompting: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
        return os.path.isfile(path) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _unreachable_server(timeout: float) -> str | None:
    """Why W&B's server cannot be reached (one TCP connect, at most ``timeout`` s), or None.

    Without this check, ``wandb.init`` waits its full ``init_timeout`` (90 s) for a server it
    cannot reach before giving up. Behind a proxy the direct connect proves nothing, so no
    check is made there.
    """
    if any(os.environ.get(var) for var in _PROXY_VARS):
        return None
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host = url.hostname or "api.wandb.ai"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"the W&B server {host}:{port} cannot be reached ({exc.strerror or exc})"


def _check_mode(init_kwargs: Mapping[str, Any]) -> None:
    """Refuse a ``mode`` (argument or ``settings``) that ``wandb.init`` would refuse at the first write."""
    settings = init_kwargs.get("settings")
    given = [("mode", init_kwargs.get("mode"))]
    if isinstance(settings, Mapping):
        given.append(("settings['mode']", settings.get("mode")))
    for name, mode in given:
        if mode is None:
            continue
        try:
            wandb.Settings(mode=mode)
        except Exception:  # pydantic's ValidationError: the allowed values are W&B's own
            field = getattr(wandb.Settings, "model_fields", {}).get("mode")
            allowed = list(typing.get_args(field.annotation)) if field is not None else "W&B's modes"
            raise ValueError(f"{name} must be one of {allowed}, got {mode!r}") from None


def _requested_mode(init_kwargs: Mapping[str, Any]) -> str | None:
    mode = init_kwargs.get("mode")
    settings = init_kwargs.get("settings")
    if mode is None and settings is not None:
        mode = getattr(settings, "mode", None) if not isinstance(settings, Mapping) else settings.get("mode")
    return mode or os.environ.get("WANDB_MODE") or None


class _WandbBackend:
    """Does the work of :class:`WandbSink`; every failure propagates to the sink's guard."""

    def __init__(self, run: Any, init_kwargs: dict[str, Any], summary_secs: float,
                 connect_timeout: float = 3.0) -> None:
        self.run = run
        self.connect_timeout = connect_timeout
        self.init_kwargs = init_kwargs
        self.owns_run = False
        self.offline_reason: str | None = None
        self._prepared: Any = None
        self._last_step = 0
        self._alert_failed = False
        self.summary_secs = summary_secs
        self._summary: dict[str, float] = {}
        self._summary_sent = time.monotonic()

    # -- the run ---------------------------------------------------------------------------

    def _start(self) -> Any:
        kwargs = dict(self.init_kwargs)
        mode = _requested_mode(kwargs)
        if mode in (None, "online") and not _has_credentials():
            self.offline_reason = "no W&B API key is configured (WANDB_API_KEY or `wandb login`)"
        elif mode in (None, "online"):
            self.offline_reason = _unreachable_server(self.connect_timeout)
        if self.offline_reason:
            kwargs["mode"] = "offline"
            run = wandb.init(**kwargs)
        else:
            try:
                run = wandb.init(**kwargs)
            except Exception as exc:
                if mode in ("offline", "disabled"):
                    raise
                # No network, W&B down, a rejected key: keep the metrics locally instead.
                self.offline_reason = f"W&B could not start an online run ({type(exc).__name__}: {exc})"
                kwargs["mode"] = "offline"
                try:
                    run = wandb.init(**kwargs)
                except Exception:
                    raise exc from None
        self.owns_run = True
        if self.offline_reason:
            files = getattr(run, "dir", None)
            where = os.path.dirname(files) if files else "the wandb/ folder"
            warnings.warn(
                f"[lossscale-callbacks] {self.offline_reason}; logging this run offline to {where}. "
                f"Upload it later with `wandb sync {where}`.",
                WandbOfflineWarning, stacklevel=user_stacklevel(),
            )
        return run

    def ensure_run(self) -> Any:
        if self.run is None:
            self.run = wandb.run if wandb.run is not None else self._start()
        if self._prepared is not self.run:
            # Put the loss-scale metrics on the optimizer-step axis (skipped steps included),
            # independent of W&B's own _step, which every other log call also advances.
            self.run.define_metric(STEP_METRIC, hidden=True)
            self.run.define_metric(f"{TAG_PREFIX}*", step_metric=STEP_METRIC)
            self._prepared = self.run
        return self.run

    # -- the Sink protocol -----------------------------------------------------------------

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        run = self.ensure_run()
        # Counts stay ints (W&B shows 3, not 3.0); the rest are floats.
        row: dict[str, float | int] = {name: value if isinstance(value, int) else float(value)
                                       for name, value in metrics.items()}
        row[STEP_METRIC] = int(step)
        self._last_step = int(step)
        run.log(row)
        if SCALE in row:
            self._summary[FINAL_SCALE] = row[SCALE]
        if SKIPPED_STEPS in row:
            self._summary[TOTAL_SKIPPED_STEPS] = row[SKIPPED_STEPS]
        if APPLIED_STEPS in row:
            self._summary[TOTAL_APPLIED_STEPS] = row[APPLIED_STEPS]
            self._summary[OVERALL_SKIP_RATE] = row[SKIPPED_STEPS] / step if step > 0 else 0.0
        # A summary update costs more than the log call itself; send it at most every
        # summary_secs, and always on flush() and close() (which also runs at exit).
        if time.monotonic() - self._summary_sent >= self.summary_secs:
            self._send_summary()

    def _send_summary(self) -> None:
        if self._summary and self.run is not None:
            self.run.summary.update(self._summary)
            self._summary = {}
        self._summary_sent = time.monotonic()

    def write_config(self, config: Mapping[str, Any]) -> None:
        """The policy (settings and bounds) into the run config, under ``loss_scale``: once per run."""
        run = self.ensure_run()
        run.config.update({"loss_scale": dict(config)}, allow_val_change=True)

    def alert_verdict(self, verdict: Verdict) -> None:
        self.alert(*verdict_alert(verdict))

    def write_text(self, tag: str, markdown: str) -> None:
        run = self.ensure_run()
        table = wandb.Table(columns=["step", "markdown"], data=[[self._last_step, markdown]])
        # No loss_scale/step here: W&B fills the step metric in from the last row (step_sync).
        run.log({tag: table})

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        run = self.ensure_run()
        histogram = wandb.Histogram(np_histogram=(list(counts), list(edges)))
        run.log({tag: histogram, STEP_METRIC: int(step)})

    def flush(self) -> None:
        # Rows are not buffered here (run.log handed each to W&B's service process); the summary is.
        self._send_summary()

    def close(self) -> None:
        run, owned = self.run, self.owns_run
        try:
            self._send_summary()
        finally:
            # A run the sink started is finished even when the summary update failed.
            self.run, self._prepared, self.owns_run = None, None, False
            if run is not None and owned:
                run.finish()

    def alert(self, title: str, text: str, level: str) -> None:
        run = self.ensure_run()
        try:
            run.alert(title=title[:63], text=text, level=level)
        except Exception as exc:
            # Alerts need W&B's servers; an offline run may refuse them. That must not cost
            # the metrics, so only the alert is given up (and said once).
            if not self._alert_failed:
                self._alert_failed = True
                warnings.warn(f"[lossscale-callbacks] a W&B alert could not be sent ({type(exc).__name__}: "
                              f"{exc}); the metrics are still logged.", UserWarning,
                              stacklevel=user_stacklevel())


def verdict_alert(verdict: Verdict) -> tuple[str, str, str]:
    """``(title, text, level)`` of the W&B alert for a health verdict (warn: WARN; stop, raise: ERROR)."""
    title = f"Loss scale: {verdict.rule.replace('_', ' ')} at step {verdict.step}"
    return title, verdict.message, _VERDICT_LEVEL.get(verdict.action, "WARN")


class WandbSink(ManagedSink):
    """Logs the loss-scale metrics to Weights & Biases.

    Uses ``run``, else the active run (``wandb.run``), else starts one with
    ``wandb.init(**init_kwargs)`` at the first write. With no API key configured, or when W&B
    cannot start an online run, the run is logged offline with one :class:`WandbOfflineWarning`
    instead of failing (``wandb sync`` uploads it later).

    ``define_metric`` puts ``loss_scale/*`` on its own axis, ``loss_scale/step``: the optimizer
    steps *attempted*, skipped steps included (W&B's ``_step`` counts log calls instead). The
    run summary holds ``loss_scale/final_scale``, ``loss_scale/total_skipped_steps`` and
    ``loss_scale/overall_skip_rate`` (updated every ``summary_secs`` and on flush/close).
    :meth:`write_text` logs a markdown report as a ``wandb.Table`` (columns ``step``,
    ``markdown``); :meth:`write_config` puts the policy into the run config (``loss_scale``).
    Each health problem that the logging loop (:class:`~lossscale_callbacks.LoggingLoop`, used by
    every integration) reports becomes a ``wandb.alert`` (Slack or e-mail; W&B sends alerts of
    online runs only; a refused alert is warned about once and the metrics go on): the rules are
    the integration's ``health=``, judged once. :meth:`alert` sends alerts of your own.

    Never blocks on the network: ``run.log`` hands each row to W&B's own service process,
    which does the uploading. The one exception is starting an online run (at the first write,
    when the sink starts the run): one TCP connect to the W&B server (at most 3 s) decides
    between online and offline, instead of ``wandb.init`` waiting its 90 s ``init_timeout``
    for a server it cannot reach. A failure (``wandb.init`` raising, the run gone) is warned once
    and disables the sink; training and the other sinks go on. Only rank 0 logs (see
    :func:`lossscale_callbacks._ranks.process_rank`). A run the sink started is finished on
    :meth:`close` or at interpreter exit; a run it was given or found is left to its owner.

    Args:
        run: a W&B run to log into (default: the active run, or a new one).
        summary_secs: longest time, in seconds, between run summary updates while writing (the
            summary is always brought up to date on :meth:`flush` and :meth:`close`).
        all_ranks: log on every rank (one run per rank then).
        **init_kwargs: passed to ``wandb.init`` when the sink starts the run (``project``,
            ``dir``, ``mode``, ``config``, ...).

    Raises:
        ValueError: an argument is invalid (``run`` not a W&B run, ``summary_secs`` negative...), named.

    Example:
        >>> from lossscale_callbacks.wandb import WandbSink
        >>> sink = WandbSink(project="fp16", mode="offline")             # doctest: +SKIP
        >>> sink.write(100, {"loss_scale/scale": 32768.0})             # doctest: +SKIP
        >>> sink.close()                                                # doctest: +SKIP
    """

    def __init__(self, run: Any = None, *, summary_secs: float = 10.0, all_ranks: bool = False,
                 **init_kwargs: Any) -> None:
        if run is not None:
            for attr in ("log", "define_metric", "summary"):
                if not hasattr(run, attr):
                    raise ValueError(f"run must be a wandb Run (from wandb.init) or None, got {run!r}")
            if init_kwargs:
                raise ValueError("init_kwargs are for a run the sink starts; with run= given, pass none "
                                 f"(got {sorted(init_kwargs)})")
        try:
            inspect.signature(wandb.init).bind(**init_kwargs)
        except TypeError as exc:
            raise ValueError(f"init_kwargs must be arguments of wandb.init: {exc}") from None
        _check_mode(init_kwargs)
        check_number("summary_secs", summary_secs, 0.0)
        self._backend = _WandbBackend(run, dict(init_kwargs), float(summary_secs))
        super().__init__(self._backend, name="W&B", all_ranks=all_ranks)

    @property
    def run(self) -> Any:
        """The W&B run written to (None before the first write, after close, or on other ranks)."""
        return self._backend.run

    @property
    def offline_reason(self) -> str | None:
        """Why the sink fell back to an offline run, or None."""
        return self._backend.offline_reason

    def alert(self, title: str, text: str, level: str = "WARN") -> None:
        """Raise a ``wandb.alert`` (W&B sends it by Slack or e-mail for online runs).

        Args:
            title: short title (W&B keeps 63 characters).
            text: the message.
            level: ``"INFO"``, ``"WARN"`` or ``"ERROR"``.
        """
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {list(_LEVELS)}, got {level!r}")
        self._call("alert", str(title), str(text), level)

    def write_histogram(self, step: int, tag: str, edges: Sequence[float], counts: Sequence[int]) -> None:
        """A ``wandb.Histogram`` (``len(edges) == len(counts) + 1``) at ``loss_scale/step`` ``step``."""
        self._call("write_histogram", step, tag, edges, counts)

    def alert_verdict(self, verdict: Verdict) -> None:
        """Turn a health verdict into an alert (``warn`` as WARN, ``stop``/``raise`` as ERROR)."""
        self.alert(*verdict_alert(verdict))

    def __repr__(self) -> str:
        return f"WandbSink(run={self.run!r})"
