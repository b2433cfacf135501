"""A private room of the core: the ledger of bad steps.

Nothing here is public and this package exports nothing. Inside: one record per skipped step and per
non-finite loss (``_entry``), the sample identities a pipeline hands over on the host (``_samples``),
the replay's verdict in words (``_words``), the bounded book written beside the dashboards, one file per
rank (``_book``), the skip list and the sampler wrapper that consumes it (``_skip``), and the reading and
merging of every rank's ledger for ``report`` (``_read``). The integrations capture the identities and
replay the steps; the records, the words and the files live here.
"""

__all__: list[str] = []
