"""A private room of the core: what ``lossscale-callbacks report`` reads and says about a run.

Nothing here is public and this package exports nothing; what a reader's author needs is in
:mod:`lossscale_callbacks.extend` (``Reader``, ``Series``, ``RunReadError``). Inside: the run readers
and their entry points (``_run_readers``), the run model that rebuilds the snapshots and judges them
(``_run_report``), the ``report`` command and its printing (``_report_cli``, ``_printable``), other
engines' logs (``_engine_logs``, ``_engine_parsers``, ``_engine_formats``, ``_records``) and the
thinning of long series (``_series_thinning``).
"""

__all__: list[str] = []
