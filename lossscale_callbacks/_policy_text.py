"""The policy table the sinks write once per run (``loss_scale/policy``), read back by the run readers.

The sinks write the policy as a two-column markdown table
(:func:`lossscale_callbacks._sinks.config_markdown`);
TensorBoard keeps it as a text summary. The readers turn it back into the policy's bounds and
growth interval, so that ``lossscale-callbacks report`` judges a run against the policy it ran with.

Example:
    >>> from lossscale_callbacks._sinks import config_markdown
    >>> text = config_markdown({"type": "dynamic", "min_scale": 1.0, "max_scale": 16777216.0,
    ...                         "growth_interval": 2000})
    >>> policy_bounds_from_markdown(text), policy_values_from_markdown(text)["growth_interval"]
    ((1.0, 16777216.0), '2000')
"""

from __future__ import annotations

__all__ = ["policy_bounds_from_markdown", "policy_values_from_markdown"]


def policy_values_from_markdown(markdown: str) -> dict[str, str]:
    """The ``setting -> value`` rows of the policy table, as the text written.

    Example:
        >>> policy_values_from_markdown("| setting | value |\\n|---|---|\\n| type | fixed |")
        {'type': 'fixed'}
    """
    values: dict[str, str] = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("setting", "---"):
            values[cells[0]] = cells[1]
    return values


def policy_bounds_from_markdown(markdown: str) -> tuple[float, float] | None:
    """``(min_scale, max_scale)`` from the policy table, or None when the table does not say.

    A fixed policy's bounds are its one scale.

    Example:
        >>> from lossscale_callbacks._sinks import config_markdown
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
