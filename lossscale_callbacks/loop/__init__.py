"""A private room of the core: the logging loop (:class:`lossscale_callbacks.LoggingLoop`) and its jobs.

Nothing here is public and this package exports nothing; users reach the loop through
``lossscale_callbacks.LoggingLoop``. Inside: the loop (``_logging_loop``), which orchestrates, and its jobs,
each in a module of its own: the interval clock (``_clock``), the run's sinks (``_run_sinks``), segments and
the sinks' steps (``_segments``), rank agreement (``_rank_agreement``), the health rules' and the
forensics' verdicts (``_verdicts``) and the summary (``_summary``). ``_logging_loop``'s docstring says where
a new job plugs in.
"""

__all__: list[str] = []
