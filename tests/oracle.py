"""An independent, plain-Python model of the loss-scale semantics, for the property tests.

Written from the issue's prose, not from the library's code: scalar Python, ``if``
statements, float32 rounding done by ``struct``.
"""

from __future__ import annotations

import struct


def f32(x: float) -> float:
    """Round a Python float to the nearest float32, as IEEE single precision does."""
    return struct.unpack("f", struct.pack("f", x))[0]


class Oracle:
    def __init__(self, *, scale, interval, growth, backoff, hysteresis, min_scale, max_scale, dynamic=True):
        self.dynamic = dynamic
        self.scale = f32(scale)
        self.interval, self.hysteresis = interval, hysteresis
        self.growth, self.backoff = f32(growth), f32(backoff)
        self.min_scale, self.max_scale = f32(min_scale), f32(max_scale)
        self.growth_counter = 0
        self.hysteresis_left = hysteresis if dynamic else 0
        self.skipped_steps = 0
        self.steps = 0

    def step(self, finite: bool) -> None:
        self.steps += 1
        if not self.dynamic:
            self.skipped_steps += 0 if finite else 1
            return
        if finite:
            self.growth_counter += 1
            if self.growth_counter == self.interval:
                # a product of two float32 values is exact in float64, so one rounding suffices
                self.scale = min(f32(self.scale * self.growth), self.max_scale)
                self.growth_counter = 0
                self.hysteresis_left = self.hysteresis
        else:
            self.skipped_steps += 1
            self.growth_counter = 0
            if self.hysteresis_left > 0:
                self.hysteresis_left -= 1
            if self.hysteresis_left == 0:
                self.scale = max(f32(self.scale * self.backoff), self.min_scale)

    def values(self) -> tuple:
        return (self.scale, self.growth_counter, self.hysteresis_left, self.skipped_steps, self.steps)


def oracle_for(policy) -> Oracle:
    """The oracle for a core policy (read through its public fields only)."""
    if not policy.dynamic:
        return Oracle(scale=policy.scale, interval=1, growth=1.0, backoff=1.0, hysteresis=0,
                      min_scale=policy.scale, max_scale=policy.scale, dynamic=False)
    return Oracle(scale=policy.initial_scale, interval=policy.growth_interval, growth=policy.growth_factor,
                  backoff=policy.backoff_factor, hysteresis=policy.hysteresis,
                  min_scale=policy.min_scale, max_scale=policy.max_scale)
