"""A private room of the core: skip truth, what happened to each optimizer step and what follows it.

Nothing here is public and this package exports nothing. Inside: the outcome of each step (applied, or
skipped and why) and the per-interval record an integration reads from its device ring
(``_outcomes``), the opt-in loss-spike rule (``_spike``), and the check that an LR scheduler, an EMA
or a trainer's step counter advanced only on applied steps (``_followers``).
"""

__all__: list[str] = []
