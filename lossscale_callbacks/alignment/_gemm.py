"""GEMM sizes of (batched) matmuls and two-operand einsums, from static shapes.

A batched matmul whose second operand has no batch dimensions (``[B, L, E] @ [E, N]``) is one GEMM
with ``M = B * L``: that is how cuBLAS runs it and how the token dimension should be judged.

Example:
    >>> matmul_gemm((8, 16, 200), (200, 600))
    (1, 128, 600, 200)
    >>> matmul_gemm((32, 50), (64, 50), transpose_b=True)
    (1, 32, 64, 50)
    >>> einsum_gemm("BTNH,BSNH->BNTS", (8, 16, 4, 50), (8, 16, 4, 50))
    (32, 16, 16, 50)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = Sequence[int | None]


def _prod(values) -> int:
    return int(math.prod(values))


def matmul_gemm(a: Shape, b: Shape, transpose_a: bool = False,
                transpose_b: bool = False) -> tuple[int, int, int, int] | None:
    """``(batch, M, N, K)`` of ``a @ b`` (numpy broadcasting), or ``None`` if a size is unknown."""
    if len(a) < 2 or len(b) < 2 or any(d is None for d in (*a, *b)):
        return None
    m, k = (a[-1], a[-2]) if transpose_a else (a[-2], a[-1])
    n = b[-2] if transpose_b else b[-1]
    a_batch, b_batch = _prod(a[:-2]), _prod(b[:-2])
    if b_batch == 1 and not transpose_a:
        return 1, a_batch * m, n, k  # one GEMM over all rows of a
    return max(a_batch, b_batch), m, n, k


def einsum_gemm(equation: str, a: Shape, b: Shape) -> tuple[int, int, int, int] | None:
    """``(batch, M, N, K)`` of a two-operand einsum; ``None`` for other equations or unknown sizes.

    Labels in both inputs and the output are batch, in both inputs only are contracted (K), in the
    first input and the output are M, in the second and the output are N.
    """
    eq = equation.replace(" ", "")
    if "->" not in eq or "..." in eq:
        return None
    inputs, out = eq.split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or len(parts[0]) != len(a) or len(parts[1]) != len(b):
        return None
    if any(d is None for d in (*a, *b)):
        return None
    sizes = dict(zip(parts[0], a, strict=True))
    sizes.update(zip(parts[1], b, strict=True))
    la, lb, lo = set(parts[0]), set(parts[1]), set(out)
    batch = _prod(sizes[c] for c in la & lb & lo)
    k = _prod(sizes[c] for c in (la & lb) - lo)
    m = _prod(sizes[c] for c in (la & lo) - lb)
    n = _prod(sizes[c] for c in (lb & lo) - la)
    return batch, m, n, k
