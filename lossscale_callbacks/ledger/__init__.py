"""The ledger of bad steps: a room of the core (private, framework-free).

One record per skipped step and per non-finite loss (:mod:`._entry`), the sample identities a pipeline
hands over on the host (:mod:`._samples`), the replay's verdict in words (:mod:`._words`), the bounded
book written beside the dashboards (:mod:`._book`), the skip list and the sampler wrapper that consumes
it (:mod:`._skip`), and the reading and merging of every rank's ledger for ``report`` (:mod:`._read`).
The integrations reach it through the contract module only.
"""
