"""Read a run back and describe its loss scale: the engine of ``lossscale-callbacks report``.

A *reader* turns a run on disk into plain series, ``{tag: [(step, value), ...]}`` sorted by
step. Readers live in the sink integrations (``lossscale_callbacks.tensorboard.reader``,
``lossscale_callbacks.wandb.reader``) and are found through the ``lossscale_callbacks.readers``
entry-point group, so this core module never imports TensorBoard or W&B.

From the series, :func:`build_report` rebuilds the :class:`~lossscale_callbacks.metrics.Snapshot` s
the training run saw at each log interval and runs the same health rules over them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata as importlib_metadata
from typing import Any

from lossscale_callbacks import metrics as m
from lossscale_callbacks.forensics import totals_from_series
from lossscale_callbacks.health import HealthMonitor, Rule, Verdict, assess, default_rules
from lossscale_callbacks.metrics import MetricsTracker, Snapshot

Series = dict[str, list[tuple[int, float]]]
Reader = Callable[[str], Series]

READER_GROUP = "lossscale_callbacks.readers"

# Bounds written next to the scale by the sinks when the policy is known (not part of the
# five-metric schema, which every framework fills; these come from the policy, not the state).
MIN_SCALE = "loss_scale/min_scale"
MAX_SCALE = "loss_scale/max_scale"
# The policy's growth interval, read back from the policy a run wrote (a one-point series).
GROWTH_INTERVAL = "loss_scale/growth_interval"
DEFAULT_MIN_SCALE = 1.0


def policy_values_from_markdown(markdown: str) -> dict[str, str]:
    """The ``setting -> value`` rows of the policy table the sinks write once per run."""
    values: dict[str, str] = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("setting", "---"):
            values[cells[0]] = cells[1]
    return values


def policy_bounds_from_markdown(markdown: str) -> tuple[float, float] | None:
    """``(min_scale, max_scale)`` from the policy table the sinks write once per run, or None.

    Example:
        >>> from lossscale_callbacks.sinks import config_markdown
        >>> policy_bounds_from_markdown(config_markdown({"type": "fixed", "scale": 8.0}))
        (8.0, 8.0)
    """
    values = policy_values_from_markdown(markdown)
    try:
        if "min_scale" in values and "max_scale" in values:
            return float(values["min_scale"]), float(values["max_scale"])
        if values.get("type") == "fixed" and "scale" in values:
            return float(values["scale"]), float(values["scale"])
    except ValueError:
        return None
    return None


class RunReadError(ValueError):
    """A path holds no readable run: nothing there, no run in the folder, or a corrupt file."""


# ---------------------------------------------------------------------------------------------
# Readers through entry points


def _entry_points() -> dict[str, Any]:
    return {entry.name: entry for entry in importlib_metadata.entry_points(group=READER_GROUP)}


def available_readers() -> dict[str, Reader]:
    """The run readers installed in this environment, by name (``tensorboard``, ``wandb``, ...).

    A reader whose integration cannot be imported (its outside package is missing) is left out.
    """
    readers: dict[str, Reader] = {}
    for name, entry in _entry_points().items():
        try:
            readers[name] = entry.load()
        except Exception:  # an integration whose package is not installed is simply not offered
            continue
    return readers


def _looks_like_wandb(path: str) -> bool:
    if path.endswith(".wandb"):
        return True
    if os.path.isdir(path):
        base = os.path.basename(os.path.normpath(path))
        if base.startswith(("offline-run-", "run-")) or base == "wandb":
            return True
        return any(name.endswith(".wandb") for name in os.listdir(path)) or os.path.isdir(
            os.path.join(path, "wandb"))
    return False


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def discover_runs(root: str) -> list[str]:
    """The runs at or below ``root``: TensorBoard run folders and W&B offline runs, sorted.

    A folder that holds event files (``*tfevents*``) directly is one TensorBoard run; an
    ``offline-run-*``/``run-*`` folder or a ``.wandb`` file is one W&B run. Only regular files
    count: a FIFO or socket named like an event file is ignored (opening it would block).
    ``root`` itself, when it is a run or a file, gives ``[root]``.
    """
    if not os.path.isdir(root):
        return [root] if os.path.exists(root) else []
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        base = os.path.basename(os.path.normpath(folder))
        wandb_files = [f for f in files if f.endswith(".wandb") and _is_regular_file(os.path.join(folder, f))]
        if base.startswith(("offline-run-", "run-")) and wandb_files:
            found.append(folder)
            dirs[:] = []  # its files/ and logs/ are part of it
            continue
        if any("tfevents" in f and _is_regular_file(os.path.join(folder, f)) for f in files):
            found.append(folder)
    return found


def read_series(path: str, readers: Mapping[str, Reader] | None = None) -> tuple[str, Series]:
    """Read the run at ``path`` with the reader that fits it; return ``(reader name, series)``.

    Readers are imported only when tried (reading a TensorBoard run never imports W&B).

    Raises:
        RunReadError: the path does not exist, no reader is installed for it, or the reader
            found no run or a corrupt file.
    """
    if not os.path.exists(path):
        raise RunReadError(f"{path}: no such file or folder")
    loaders: dict[str, Callable[[], Reader]]
    if readers is None:
        loaders = {name: entry.load for name, entry in _entry_points().items()}
    else:
        loaders = {name: (lambda r=r: r) for name, r in readers.items()}
    if not loaders:
        raise RunReadError("no run reader is installed: install lossscale-callbacks[tensorboard] or [wandb]")
    # W&B runs are recognisable by name; everything else is tried as TensorBoard first.
    wandb_like = _looks_like_wandb(path)
    order = sorted(loaders, key=lambda name: 0 if (name == "wandb") == wandb_like else 1)
    errors: list[str] = []
    for name in order:
        try:
            reader = loaders[name]()
        except Exception:  # its outside package is not installed
            continue
        try:
            return name, reader(path)
        except RunReadError as exc:
            errors.append(str(exc))
    if not errors:
        raise RunReadError(f"{path}: no installed reader could be loaded ({', '.join(order)})")
    if len(errors) > 1 and all(" run here" in e for e in errors):
        raise RunReadError(f"{path}: no TensorBoard or W&B run here "
                           "(no events.out.tfevents.* file, no .wandb file)")
    # The reader that fits the path best (tried first) has the clearest message.
    raise RunReadError(errors[0])


# ---------------------------------------------------------------------------------------------
# From series to snapshots, verdicts and a report


def _find_prefix(series: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    """The tag prefix under which the run's ``loss_scale/scale`` lives.

    ``""`` for this library's sinks, Lightning's loggers and W&B; ``"train/"`` for a run folder
    read from above; ``"batch_"`` (or ``"train/batch_"``) for the per-batch series Keras'
    ``TensorBoard`` callback writes from ``logs``. Per-epoch series (``epoch_``) are refused:
    their step axis is epochs, not optimizer steps.
    """
    if m.SCALE in series:
        return ""
    prefixes = [tag[: -len(m.SCALE)] for tag in series if tag.endswith(m.SCALE)]
    usable = [p for p in prefixes if p.endswith("/") or p.endswith("batch_")]
    if not usable:
        if any(p.endswith("epoch_") for p in prefixes):
            raise RunReadError(
                "the run has only per-epoch loss-scale series (epoch_loss_scale/...), whose step axis is "
                "epochs, not optimizer steps; log per batch (Keras' TensorBoard(update_freq=<int>)) or "
                "write with LossScaleCallback(tensorboard=...)")
        raise RunReadError(f"the run has no {m.SCALE} series (tags found: "
                           f"{', '.join(sorted(series)[:8]) or 'none'})")
    # The library's own series first, then Keras' per-batch copies; the training run first.
    best = min(0 if p.endswith("/") else 1 for p in usable)
    usable = sorted(p for p in usable if (0 if p.endswith("/") else 1) == best)
    if len(usable) > 1:
        train = [p for p in usable if p.rstrip("/").removesuffix("batch_").rstrip("/").endswith("train")]
        if len(train) == 1:
            return train[0]
        names = ", ".join(p + m.SCALE for p in usable)
        raise RunReadError(f"the run has several {m.SCALE} series ({names}); name one run folder")
    return usable[0]


def _by_step(points: Sequence[tuple[int, float]]) -> dict[int, float]:
    # When a step was written twice (a resumed run), the later value wins.
    return {int(step): float(value) for step, value in points}


def snapshots_from_series(series: Mapping[str, Sequence[tuple[int, float]]],
                          min_scale: float | None = None) -> tuple[list[Snapshot], float]:
    """Rebuild the snapshots a run logged, one per log interval, from its metric series.

    The tracker sees what the integration saw at each interval: the step, the scale, the
    growth counter and the cumulative skipped steps. Returns the snapshots and the
    ``min_scale`` used (from ``min_scale``, else the run's ``loss_scale/min_scale`` series,
    else the policy default 1.0).
    """
    prefix = _find_prefix(series)
    scale = _by_step(series[prefix + m.SCALE])
    bad = next(((step, value) for step, value in sorted(scale.items())
                if not math.isfinite(value) or value <= 0), None)
    if bad is not None:
        raise RunReadError(f"the {prefix}{m.SCALE} series holds {bad[1]!r} at step {bad[0]}: "
                           "not a loss scale (a finite number > 0)")
    growth = _by_step(series.get(prefix + m.GROWTH_COUNTER, ()))
    skipped = _by_step(series.get(prefix + m.SKIPPED_STEPS, ()))
    # Runs logged on another axis (Lightning's logging step) carry the optimizer steps as a value.
    attempted = _by_step(series.get(prefix + m.STEPS, ()))
    if min_scale is None:
        bounds = series.get(prefix + MIN_SCALE)
        min_scale = float(bounds[-1][1]) if bounds else DEFAULT_MIN_SCALE
    tracker = MetricsTracker(min_scale=min_scale)
    snapshots = []
    for step in sorted(scale):
        snapshots.append(tracker.observe({
            "steps": int(attempted.get(step, step)),
            "scale": scale[step],
            "growth_counter": int(growth.get(step, 0)),
            "hysteresis_left": 0,
            "skipped_steps": int(skipped.get(step, 0)),
        }))
    return snapshots, float(min_scale)


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``lossscale-callbacks report`` says about one run.

    ``skipped_steps`` and ``skip_rate`` are ``None`` when the run did not log
    ``loss_scale/skipped_steps``: then nothing is known about skips, and the skip rules are not judged.
    """

    path: str
    reader: str
    steps: int
    skipped_steps: int | None
    skip_rate: float | None
    final_scale: float
    min_scale_seen: float
    max_scale_seen: float
    min_scale: float
    steps_at_min_scale: int
    log_points: int
    verdicts: tuple[Verdict, ...]
    series: Mapping[str, Sequence[tuple[int, float]]] = dataclasses.field(repr=False, compare=False)
    snapshots: tuple[Snapshot, ...] = dataclasses.field(default=(), repr=False, compare=False)
    health: str = ""
    max_scale: float | None = None
    forensics: Any = None

    @property
    def healthy(self) -> bool:
        return not self.verdicts

    def to_json(self) -> dict[str, Any]:
        """Plain numbers for machines (``--json``)."""
        return {
            "path": self.path,
            "reader": self.reader,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "skip_rate": self.skip_rate,
            "final_scale": self.final_scale,
            "min_scale_seen": self.min_scale_seen,
            "max_scale_seen": self.max_scale_seen,
            "min_scale": self.min_scale,
            "steps_at_min_scale": self.steps_at_min_scale,
            "log_points": self.log_points,
            "healthy": self.healthy,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "bounds": {"min_scale": self.min_scale, "max_scale": self.max_scale},
            "summary": self.text(),
            "forensics": None if self.forensics is None else {
                "causes": dict(self.forensics.causes), "layer_skips": dict(self.forensics.layer_skips)},
            "series": {tag: [[step, value] for step, value in points] for tag, points in self.series.items()},
        }

    def text(self) -> str:
        """The summary in plain words."""
        if self.steps == 0:
            return f"{self.path}: the run logged its loss scale, but no optimizer step was taken."
        lines = [
            f"Run: {self.path} (read as {self.reader}, {self.log_points} log points)",
            f"Optimizer steps attempted: {self.steps}",
            f"Skipped steps (Inf/NaN gradients): {self.skipped_steps} ({self.skip_rate:.2%})"
            if self.skipped_steps is not None and self.skip_rate is not None else
            f"Skipped steps (Inf/NaN gradients): not logged by this run (no {m.SKIPPED_STEPS} series)",
            f"Loss scale: final {self.final_scale:g} (2^{math.log2(self.final_scale):.1f}); "
            f"ranged from {self.min_scale_seen:g} to {self.max_scale_seen:g}",
        ]
        if self.steps_at_min_scale:
            lines.append(f"Steps at the minimum scale ({self.min_scale:g}): about {self.steps_at_min_scale}")
        else:
            lines.append(f"Steps at the minimum scale ({self.min_scale:g}): none seen")
        if self.healthy and self.skipped_steps is None:
            lines.append("Health: no problem seen, but only the scale was logged: skipped steps and the "
                         "skip rate could not be judged.")
        elif self.health:
            lines.append(self.health)
        else:
            lines.append(assess((), list(self.snapshots), self.verdicts))
        if self.forensics is not None:
            causes = self.forensics.causes
            named = {"loss_nonfinite": "non-finite loss", "grad_inf": "Inf gradients",
                     "grad_nan": "NaN gradients", "grad_nonfinite": "non-finite gradients (kind not told)"}
            parts = [f"{count} {named[c]}" for c, count in causes.items() if count]
            lines.append("Skip causes (overflow forensics): " + (", ".join(parts) or "none recorded"))
            ranked = sorted(self.forensics.layer_skips.items(), key=lambda item: -item[1])
            if ranked:
                lines.append("Layers with non-finite gradients in skipped steps: "
                             + ", ".join(f"`{layer}` ({count})" for layer, count in ranked[:5]))
            lines.extend(self.forensics.sentences())
        return "\n".join(lines)


def build_report(path: str, series: Mapping[str, Sequence[tuple[int, float]]], reader: str = "",
                 min_scale: float | None = None, rules: Sequence[Rule] | None = None) -> Report:
    """Describe a run from its series: counts, scale range, time at the minimum, health verdicts.

    Example:
        >>> series = {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)],
        ...           "loss_scale/skipped_steps": [(100, 3.0), (200, 3.0)]}
        >>> report = build_report("run", series)
        >>> report.steps, report.skipped_steps, report.final_scale, report.healthy
        (200, 3, 2048.0, True)
    """
    snapshots, min_scale = snapshots_from_series(series, min_scale)
    if not snapshots:
        raise RunReadError(f"{path}: the {m.SCALE} series is empty")
    prefix = _find_prefix(series)
    skips_logged = bool(series.get(prefix + m.SKIPPED_STEPS))
    interval = series.get(prefix + GROWTH_INTERVAL)
    growth_interval = int(interval[-1][1]) if interval else None
    monitor = HealthMonitor(default_rules("warn", growth_interval) if rules is None else rules)
    for snap in snapshots:
        monitor.observe(snap)
    monitor.final()
    verdicts: list[Verdict] = list(monitor.verdicts)
    upper = series.get(prefix + MAX_SCALE)
    last = snapshots[-1]
    forensics = totals_from_series({tag[len(prefix):]: points for tag, points in series.items()
                                    if tag.startswith(prefix)})
    if forensics is not None and forensics.causes["loss_nonfinite"]:
        verdicts.append(Verdict("NonFiniteLoss", "warn", last.step, forensics.sentences()[0]))
    scales = [s.scale for s in snapshots]
    return Report(
        path=path,
        reader=reader,
        steps=last.step,
        skipped_steps=last.skipped_steps if skips_logged else None,
        skip_rate=(last.skipped_steps / last.step if last.step else 0.0) if skips_logged else None,
        final_scale=last.scale,
        min_scale_seen=min(scales),
        max_scale_seen=max(scales),
        min_scale=min_scale,
        steps_at_min_scale=last.total_steps_at_min_scale,
        log_points=len(snapshots),
        verdicts=tuple(verdicts),
        series=dict(series),
        snapshots=tuple(snapshots),
        health=monitor.assessment(),
        max_scale=float(upper[-1][1]) if upper else None,
        forensics=forensics,
    )


# ---------------------------------------------------------------------------------------------
# The picture


def write_png(report: Report, path: str, fmt: str = "png") -> str:
    """Draw the run: the scale on a log2 axis with skipped steps marked, and the skip rate per interval.

    ``fmt`` is the picture format (``"png"``, ``"svg"``, ``"pdf"``); the CLI takes it from the file
    name. matplotlib is imported here only. The figure is drawn with matplotlib's object API and
    saved by its Agg renderer: no display is needed and pyplot's global backend is left alone.

    Raises:
        RunReadError: matplotlib is not installed.
        OSError: the picture cannot be written to ``path``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RunReadError("--png needs matplotlib (pip install matplotlib)") from None
    snapshots, used_min = report.snapshots, report.min_scale
    if not snapshots:  # a Report built by hand, not by build_report
        snapshots, used_min = snapshots_from_series(report.series, report.min_scale)
    steps = [s.step for s in snapshots]
    scales = [s.scale for s in snapshots]
    skipped = [s for s in snapshots if s.skipped_in_interval > 0]

    fig = Figure(figsize=(9, 6), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.step(steps, scales, where="post", color="tab:blue", label="loss scale")
    top.set_yscale("log", base=2)
    if skipped:
        top.scatter([s.step for s in skipped], [s.scale for s in skipped], marker="v", color="tab:red",
                    zorder=3, label="interval with skipped steps")
    top.axhline(used_min, color="grey", linestyle=":", linewidth=1, label=f"min_scale {used_min:g}")
    top.set_ylabel("loss scale (log2)")
    skips = ("skipped steps not logged" if report.skipped_steps is None or report.skip_rate is None
             else f"{report.skipped_steps} skipped ({report.skip_rate:.2%})")
    top.set_title(f"Loss scale: {report.steps} steps, {skips}"
                  + ("" if report.healthy else f", {len(report.verdicts)} health problem(s)"))
    top.legend(loc="best", fontsize="small")
    top.grid(True, which="major", alpha=0.3)

    starts = [s.step - s.interval_steps for s in snapshots]
    widths = [s.interval_steps for s in snapshots]
    bottom.bar(starts, [s.skip_rate for s in snapshots], width=widths, align="edge", color="tab:red",
               alpha=0.7)
    bottom.set_ylabel("skip rate per interval")
    bottom.set_xlabel(m.STEP_AXIS)
    bottom.set_ylim(0, max(0.05, max((s.skip_rate for s in snapshots), default=0.0) * 1.1))
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format=fmt)
    return path
