"""A run's loss scale in plain words and numbers: what ``lossscale-callbacks report`` says about one run.

From a run's series (see :mod:`lossscale_callbacks.run_readers`), :func:`build_report` rebuilds the
:class:`~lossscale_callbacks.metrics.Snapshot` s the training run saw at each log interval and runs
the same health rules over them.

Example:
    >>> report = build_report("run", {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)]})
    >>> report.steps, report.final_scale
    (200, 2048.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lossscale_callbacks import metrics as m
from lossscale_callbacks.forensics import totals_from_series
from lossscale_callbacks.health import HealthMonitor, Rule, Verdict, assess, default_rules
from lossscale_callbacks.metrics import MetricsTracker, Snapshot
from lossscale_callbacks.run_readers import (
    GROWTH_INTERVAL,
    MAX_SCALE,
    MIN_SCALE,
    NoLossScaleError,
    RunReadError,
)

__all__ = ["RunReport", "build_report", "snapshots_from_series"]

DEFAULT_MIN_SCALE = 1.0



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
            raise NoLossScaleError(
                "the run has only per-epoch loss-scale series (epoch_loss_scale/...), whose step axis is "
                "epochs, not optimizer steps; log per batch (Keras' TensorBoard(update_freq=<int>)) or "
                "write with LossScaleCallback(tensorboard=...)")
        raise NoLossScaleError(f"the run has no {m.SCALE} series (tags found: "
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
class RunReport:
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
    damage: tuple[str, ...] = ()

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
            "damage": list(self.damage),
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
        if self.damage:
            lines.append(f"Damaged records, left out ({len(self.damage)}): " + "; ".join(self.damage[:3])
                         + ("; ..." if len(self.damage) > 3 else ""))
        return "\n".join(lines)


def build_report(path: str, series: Mapping[str, Sequence[tuple[int, float]]], reader: str = "",
                 min_scale: float | None = None, rules: Sequence[Rule] | None = None,
                 damage: Sequence[str] = ()) -> RunReport:
    """Describe a run from its series: counts, scale range, time at the minimum, health verdicts.

    ``damage`` is what the reader found damaged and left out (one sentence each); the report says it.

    Example:
        >>> series = {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)],
        ...           "loss_scale/skipped_steps": [(100, 3.0), (200, 3.0)]}
        >>> report = build_report("run", series)
        >>> report.steps, report.skipped_steps, report.final_scale, report.healthy
        (200, 3, 2048.0, True)
    """
    snapshots, min_scale = snapshots_from_series(series, min_scale)
    if not snapshots:
        raise NoLossScaleError(f"{path}: the {m.SCALE} series is empty")
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
    return RunReport(
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
        damage=tuple(damage),
    )
