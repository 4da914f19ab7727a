"""Integer helpers for sizes and tiles, shared by every op (one copy of each)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
