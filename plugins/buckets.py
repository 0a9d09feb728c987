"""Power-of-two shape buckets, shared by the decode kernel, the paged step and the CUDA-graph engine.

The decode kernel picks its split count (and so the order of its softmax sums) from the bucketed
batch size and table width, and the CUDA-graph engine pads decode batches to the same buckets, so an
eager step and a replayed one compute the same bits.

The same goes for the token axis: cuBLAS picks its matmul kernel (and so the order of its sums) by
the number of rows, and bf16 results of 133 rows and of 256 differ in their last bits (on the H200,
E2B: 300 vs 512, 40 vs 64 and 129 vs 256 rows differed, 17 vs 32 and 700 vs 1,024 did not). The
inductor engine replays steps padded to `token_bucket` rows (piecewise graphs, decode graphs), so the
paged step pads its token axis the same way (PagedStep(pad_tokens=True)) and every torch engine
computes the same bits for the same step.
"""
from __future__ import annotations


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


TOKEN_BUCKETS_UP_TO = 2048  # steps of more tokens run at their own size (compiled, never replayed)


def token_bucket(n: int) -> int:
    """The row count a step of `n` tokens is computed at: pow2_bucket(n) up to TOKEN_BUCKETS_UP_TO, else n."""
    return pow2_bucket(n) if n <= TOKEN_BUCKETS_UP_TO else n
