"""A private room of the core: the logging loop (:class:`lossscale_callbacks.LoggingLoop`) and its jobs.

Nothing here is public and this package exports nothing; users reach the loop through
``lossscale_callbacks.LoggingLoop``. Inside: the loop (``_logging_loop``) and rank agreement
(``_rank_agreement``: every rank's state gathered at the interval, the rule and its words).
"""

__all__: list[str] = []
