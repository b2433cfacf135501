"""Element sizes, required and recommended multiples, GPU targets, tile and wave quantization.

The rules follow NVIDIA's Deep Learning Performance Guide ("Matrix Multiplication Background",
"Tensor Core Requirements"): Tensor Cores are used most efficiently when the GEMM dimensions, and
above all the contiguous ones, are multiples of 16 bytes: 8 elements in float16/bfloat16, 4 in TF32,
16 in int8/fp8. On A100 and H100 the guide recommends multiples of 128 bytes (64 float16 elements)
for the best cuBLAS/cuDNN kernel choice. A GEMM is computed in output tiles (256x128 for large
problems) spread over the SMs in waves; the last, partial tile and the last, partial wave waste
work ("tile quantization" and "wave quantization").

Example:
    >>> required_multiple("float16"), required_multiple("tfloat32"), required_multiple("int8")
    (8, 4, 16)
    >>> recommended_multiple("float16", "a100")
    64
    >>> next_multiple(50257, 8)
    50264
    >>> round(wave_efficiency(1024, 1024, "a100"), 3)
    0.296
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "tfloat32": 4, "int8": 1, "float8": 1}
REQUIRED_BYTES = 16


@dataclass(frozen=True)
class Target:
    """A GPU the report is written for: SM count and the recommended alignment in bytes."""

    name: str
    sm_count: int
    recommended_bytes: int


# SM counts of the shipping parts (H100 and H200 SXM, B200, L4, RTX 4090); the 128-byte
# recommendation applies from Ampere on, where cuBLAS' largest Tensor Core tiles need it.
TARGETS = {
    "v100": Target("v100", 80, REQUIRED_BYTES),
    "t4": Target("t4", 40, REQUIRED_BYTES),
    "a10": Target("a10", 72, 128),
    "a100": Target("a100", 108, 128),
    "l4": Target("l4", 58, 128),
    "rtx4090": Target("rtx4090", 128, 128),
    "h100": Target("h100", 132, 128),
    "h200": Target("h200", 132, 128),
    "b200": Target("b200", 148, 128),
}
GEMM_TILE = (256, 128)


def get_target(target: str | Target | None) -> Target | None:
    """Validate the ``target`` argument; ``None`` means "no particular GPU"."""
    if target is None or isinstance(target, Target):
        return target
    key = str(target).lower().replace(" ", "").replace("-", "").replace("_", "")
    if key not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)} or None, got {target!r}")
    return TARGETS[key]


def required_multiple(dtype: str) -> int | None:
    """Elements per 16 bytes, or ``None`` when ``dtype`` never runs on Tensor Cores (float32 without TF32)."""
    size = ELEMENT_BYTES.get(dtype)
    return None if size is None else REQUIRED_BYTES // size


def recommended_multiple(dtype: str, target: str | Target | None) -> int | None:
    """The target's recommended multiple in elements (``None`` when it adds nothing to the required one)."""
    tgt = get_target(target)
    size = ELEMENT_BYTES.get(dtype)
    if tgt is None or size is None or tgt.recommended_bytes <= REQUIRED_BYTES:
        return None
    return tgt.recommended_bytes // size


def next_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return int(math.ceil(value / multiple) * multiple)


def wave_efficiency(m: int, n: int, target: str | Target, tile: tuple[int, int] = GEMM_TILE) -> float:
    """Useful fraction of the work launched for an ``M x N`` output: tile and wave quantization together.

    ``m * n / (tiles_per_wave_rounded_up * sm_count * tile_m * tile_n)``: 1.0 means every tile is full and
    the last wave keeps every SM busy.
    """
    tgt = get_target(target)
    if tgt is None:
        raise ValueError("target must name a GPU for wave quantization")
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    waves = math.ceil(tiles / tgt.sm_count)
    return (m * n) / (waves * tgt.sm_count * tile[0] * tile[1])
