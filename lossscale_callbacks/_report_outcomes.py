"""What the report says about each run it found: read and judged, read but holding no loss scale, or not read.

:func:`judge_runs` reads and judges one run at a time and hands each outcome on before reading the
next, so the report's memory does not grow with the number of runs. A run that cannot be read
(a corrupt file, a file the user may not read, a reader whose package is missing) is an outcome
like the others, with the reason and the pip command that would read it: it never stops the runs
after it.

Example:
    >>> from lossscale_callbacks._run_discovery import FoundRun
    >>> outcome = judge_run(FoundRun("no/such/run", "tensorboard"))
    >>> outcome.status, outcome.reason
    ('unreadable', 'no/such/run: no such file or folder')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from lossscale_callbacks._run_discovery import FoundRun
from lossscale_callbacks._run_readers import NoLossScaleError, RunReadError, RunSeries, read_series
from lossscale_callbacks._run_report import RunReport, build_report

__all__ = ["NO_LOSS_SCALE", "READ", "UNREADABLE", "RunOutcome", "judge_run", "judge_runs"]

READ, NO_LOSS_SCALE, UNREADABLE = "read", "no_loss_scale", "unreadable"


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One run found on disk, as the report saw it.

    Attributes:
        path: the run's folder or file.
        reader: the reader that read it or was meant to (``"tensorboard"``, ``"wandb"``), or None.
        status: :data:`READ`, :data:`NO_LOSS_SCALE` (read, but no loss-scale series on the
            optimizer-step axis) or :data:`UNREADABLE`.
        report: the run's report when it was read.
        reason: why it was not read (one sentence), or None.
        install: the pip command that installs its missing reader, or None.
    """

    path: str
    reader: str | None
    status: str
    report: RunReport | None = None
    reason: str | None = None
    install: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The run for ``--json``: the report's numbers when it was read, else why not."""
        head = {"path": self.path, "reader": self.reader, "status": self.status, "reason": self.reason,
                "install": self.install}
        return head if self.report is None else {**self.report.to_json(), **head}


def judge_run(found: FoundRun, min_scale: float | None = None) -> RunOutcome:
    """Read and judge one run; every failure becomes an outcome, never an exception."""
    if found.problem is not None:
        return RunOutcome(found.path, found.kind, UNREADABLE, reason=found.problem)
    reader = found.kind
    try:
        reader, series = read_series(found.path, found.kind)
        said = series if isinstance(series, RunSeries) else RunSeries()
        report = build_report(found.path, series, reader=reader, min_scale=min_scale, damage=said.damage,
                              notes=said.notes)
    except NoLossScaleError as exc:
        return RunOutcome(found.path, reader, NO_LOSS_SCALE, reason=str(exc))
    except RunReadError as exc:
        return RunOutcome(found.path, reader, UNREADABLE, reason=str(exc), install=exc.install)
    except OSError as exc:  # a file the user may not read, a disk error
        reason = f"{exc.filename or found.path}: cannot be read ({exc.strerror or exc})"
        return RunOutcome(found.path, reader, UNREADABLE, reason=reason)
    except Exception as exc:  # a reader tripping over an unexpected file is still this run's problem only
        return RunOutcome(found.path, reader, UNREADABLE,
                          reason=f"{found.path}: cannot be read ({type(exc).__name__}: {exc})")
    return RunOutcome(found.path, reader, READ, report=report)


def judge_runs(runs: Iterable[FoundRun], min_scale: float | None = None) -> Iterator[RunOutcome]:
    """:func:`judge_run` for each run in turn; a run is read only when the previous outcome was taken."""
    for found in runs:
        yield judge_run(found, min_scale)
