"""The two fp8 formats of training, and what one cast does to a value: kept, saturated or underflowed.

A value ``x`` is cast as ``x * scale`` (the scale multiplies, as in TransformerEngine and torchao; Keras
keeps its reciprocal and divides). The cast **saturates** it when ``|x * scale|`` lies beyond the format's
largest value by more than the rounding at the top (``max + step / 2``: 464 for e4m3, 61440 for e5m2):
such a value comes back smaller than rounding alone would make it, clipped to ``±max``. It **underflows**
when it is not zero and ``|x * scale|`` falls under the smallest normal value (2^-6, 2^-14): it keeps fewer
significant bits (a subnormal) or none (zero, under half the smallest subnormal).

Example:
    >>> E4M3.saturates(470.0), E4M3.saturates(460.0), E4M3.underflows(2.0**-7)
    (True, False, True)
    >>> fp8_format("float8_e5m2").max
    57344.0
"""

from __future__ import annotations

import dataclasses

__all__ = ["E4M3", "E5M2", "FORMATS", "ROLES", "Fp8Format", "fp8_format"]

# The three tensors of a linear layer that fp8 training casts, in the order of the step.
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One fp8 format: its name, largest value, the step between the two largest, smallest normal and
    subnormal values."""

    name: str
    max: float
    top_step: float
    min_normal: float
    min_subnormal: float

    @property
    def saturation(self) -> float:
        """``|x * scale|`` from which a value is clipped rather than rounded."""
        return self.max + self.top_step / 2

    @property
    def zero(self) -> float:
        """``|x * scale|`` under which a value becomes zero."""
        return self.min_subnormal / 2

    def saturates(self, scaled: float) -> bool:
        return abs(scaled) >= self.saturation

    def underflows(self, scaled: float) -> bool:
        return scaled != 0 and abs(scaled) < self.min_normal


E4M3 = Fp8Format("e4m3", 448.0, 32.0, 2.0**-6, 2.0**-9)
E5M2 = Fp8Format("e5m2", 57344.0, 8192.0, 2.0**-14, 2.0**-16)
FORMATS = {f.name: f for f in (E4M3, E5M2)}
_ALIASES = {"float8_e4m3fn": "e4m3", "float8_e4m3": "e4m3", "e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def fp8_format(name: str) -> Fp8Format:
    """The format named ``name`` (``"e4m3"``, ``"e5m2"`` or a framework's dtype name such as
    ``"float8_e4m3fn"``).

    Raises:
        ValueError: naming the allowed names.
    """
    key = str(name).rsplit(".", 1)[-1].lower()
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FORMATS) + sorted(_ALIASES)}, got {name!r}")
    return FORMATS[key]
