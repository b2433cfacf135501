"""What a terminal and a paste do to a log, undone: scales printed rounded, colours, wrapped words, bars.

A loss scale printed in full (``65536.0``, ``1.4582244039112795e-303``) is that number. One printed
rounded is a range: fairseq's ``loss_scale=0.062`` (three decimals) is any number that rounds to it, and a
dynamic scale is a power of two, so it is 0.0625; ``0.000`` is any power of two below 0.0005, a bound
and no number; Megatron's ``loss scale: 0.1`` (one decimal) is 0.0625 or 0.125. :func:`printed` turns
the text into a :class:`Level` that says which. A value within no power of two's rounding (fairseq's
``loss_scale=1399``, an interval's mean) is no level at all.

Lines: colours are dropped (sent, ``\\x1b[32m``, or as ``cat -v`` shows them, ``^[[32m``), a word a
terminal broke with its padding is joined again, and the progress counters a line holds are found with
where they sit, so that a message glued after a bar is read after it (:func:`counters`).

Example:
    >>> printed("0.062", decimals_of("0.062")).to_json()
    0.0625
    >>> printed("0.000", 3).to_json()
    {'below': 0.0005}
    >>> printed("0.1", 1).to_json()
    {'between': [0.0625, 0.125]}
    >>> printed("1399", 0) is None
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lossscale_callbacks.report import _engine_formats as f

__all__ = ["Level", "cleaned", "counters", "decimals_of", "exact", "printed", "split_at_counters",
           "unwrapped"]


@dataclasses.dataclass(frozen=True)
class Level:
    """A loss scale as the log showed it: exact (``low == high == value``), one of the powers of two from
    ``low`` to ``high``, or (``below``) a power of two no higher than the bound ``below``.

    ``value`` stands for the level where one number is needed (a series, a picture): the exact value,
    the lowest power of two in the range, or the highest one under the bound.
    """

    value: float
    low: float
    high: float
    below: float | None = None

    @property
    def exact(self) -> bool:
        return self.below is None and self.low == self.high

    def to_json(self) -> Any:
        """The level for ``--json``: a number, ``{"below": bound}`` or ``{"between": [low, high]}``."""
        if self.below is not None:
            return {"below": self.below}
        return self.value if self.exact else {"between": [self.low, self.high]}

    def words(self) -> str:
        if self.below is not None:
            return f"below {self.below:g}"
        return f"{self.value:g}" if self.exact else f"{self.low:g} or {self.high:g}"


def exact(value: float) -> Level:
    return Level(value, value, value)


def decimals_of(text: str) -> int:
    """The decimals a number was printed to: ``"0.062"`` 3, ``"1399"`` 0, ``"1.04858e+06"`` -1 (``{:g}``
    keeps six significant digits)."""
    mantissa, _, exponent = text.lower().partition("e")
    digits = len(mantissa.partition(".")[2])
    return digits - int(exponent) if exponent else digits


def printed(text: str, decimals: int | None = None) -> Level | None:
    """The level a scale printed as ``text`` stands for; ``decimals``: how many it was rounded to (None:
    printed in full). None when the text is no loss scale (negative, NaN, Inf) or, rounded, lies within
    no power of two's rounding (a mean of several levels)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        return None
    if decimals is None:
        return exact(value) if value > 0 else None
    half = 0.5 * 10.0 ** -decimals
    low, high = value - half, value + half
    if low <= 0:  # rounds to zero: any power of two up to the bound
        return Level(2.0 ** math.floor(math.log2(high)), 0.0, high, below=high)
    # the powers of two that print as this text (Python rounds a tie to even: 0.5 prints as "0")
    shown = round(value, decimals)
    powers = [2.0**k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)
              if low <= 2.0**k <= high and round(2.0**k, decimals) == shown]
    if not powers:
        return None
    return exact(powers[0]) if len(powers) == 1 else Level(powers[0], powers[0], powers[-1])


def cleaned(line: str) -> str:
    """``line`` without its colours (only looked for where an escape is)."""
    if "\x1b" in line or "^[" in line:
        return f.ANSI.sub("", line)
    return line


def unwrapped(line: str) -> str:
    """``line`` with the words a terminal broke with a run of padding spaces joined again."""
    return f.WRAPPED.sub("", line)


def counters(line: str) -> list[tuple[int, int, int, str]]:
    """The progress counters in ``line``, in order: ``(position, steps done, total, kind)``.

    A tqdm bar's ``n/total`` (the steps done); apex's ImageNet ``Epoch: [e][ i/n]`` and the logs modelled
    on it (epoch and batch counted from 0: ``e * n + i + 1`` done); DLLogger's ``Training Iteration: n``.
    """
    found = [(m.start(), int(m["n"]), int(m["total"]), "tqdm") for m in f.TQDM_COUNTER.finditer(line)]
    found += [(m.start(), int(m["epoch"]) * int(m["n"]) + int(m["i"]) + 1, int(m["n"]), "epoch-bracket")
              for m in f.EPOCH_BRACKET_COUNTER.finditer(line)]
    found += [(m.start(), int(m["step"]), 0, "dllogger") for m in f.DLLOGGER_COUNTER.finditer(line)]
    return sorted(found)


def split_at_counters(line: str) -> list[tuple[str, tuple[int, int, str] | None]]:
    """``line`` cut where its counters are: ``(text before, counter or None)`` pairs, in order (the last
    one's counter None). A message glued after a bar is read in the text after it."""
    found = counters(line)
    if not found:
        return [(line, None)]
    parts, start = [], 0
    for position, done, total, kind in found:
        parts.append((line[start:position], (done, total, kind)))
        start = position
    parts.append((line[start:], None))
    return parts

