"""Power-of-two shape buckets, shared by the decode kernel and the CUDA-graph engine.

The decode kernel picks its split count (and so the order of its softmax sums) from the bucketed
batch size and table width, and the CUDA-graph engine pads decode batches to the same buckets, so an
eager step and a replayed one compute the same bits.
"""
from __future__ import annotations


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
