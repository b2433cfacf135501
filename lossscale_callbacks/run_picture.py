"""The picture of a run: the scale on a log2 axis with skipped steps marked, and the skip rate per interval.

matplotlib (the ``[plot]`` extra) is imported when a picture is drawn, never by the report itself.

Example:
    >>> from lossscale_callbacks.run_report import build_report
    >>> report = build_report("run", {"loss_scale/scale": [(100, 1024.0), (200, 2048.0)]})
    >>> write_png(report, "scale.png")  # doctest: +SKIP
    'scale.png'
"""

from __future__ import annotations

from lossscale_callbacks import metrics as m
from lossscale_callbacks.extras import require
from lossscale_callbacks.run_report import RunReport, snapshots_from_series

__all__ = ["write_png"]

def write_png(report: RunReport, path: str, fmt: str = "png") -> str:
    """Draw the run: the scale on a log2 axis with skipped steps marked, and the skip rate per interval
    (a run that skipped nothing says "no skipped steps" on that panel).

    ``fmt`` is the picture format (``"png"``, ``"svg"``, ``"pdf"``); the CLI takes it from the file
    name. matplotlib is imported here only. The figure is drawn with matplotlib's object API and
    saved by its Agg renderer: no display is needed and pyplot's global backend is left alone.

    Raises:
        MissingExtraError: matplotlib (the ``[plot]`` extra) is not installed.
        OSError: the picture cannot be written to ``path``.
    """
    Figure = require("matplotlib.figure", "plot", feature="the report's picture").Figure
    snapshots, used_min = report.snapshots, report.min_scale
    if not snapshots:  # a RunReport built by hand, not by build_report
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
    if not skipped:  # an empty panel would look like a drawing that failed
        words = "skipped steps not logged" if report.skipped_steps is None else "no skipped steps"
        bottom.text(0.5, 0.5, words, transform=bottom.transAxes, ha="center", va="center", color="grey")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format=fmt)
    return path
