"""Triton KV page write: scatter this step's K and V rows into their arena slots in one launch.

Grid (T, cdiv(Hkv * D, BLOCK)): one program copies a BLOCK-wide piece of one token's K row and the
same piece of its V row. A position's Hkv * D elements are contiguous in both the source and the
page (README layout), so every access is a straight vector copy. Slot -1 writes nothing; the mask
does it, so there is no host-side filtering and no sync. `kv_write_attention_` is a cache-owning layer's write
and attention: a decode step's in the attention launch alone (triton_attention's WRITE), any other's in two.
`projected_attention_` is a layer's q/k/v norms and RoPE, its write and its attention from its packed projection:
a decode step cut over its keys in the attention launch alone (WRITE and NORM), any other as the q/k/v norm kernel
and then the one or two; registered here as the op `g4rt::projected_attention_` (Triton only: models/paged.py calls it with the Triton
kernels, and norms by the model's reference blocks otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import await_inputs, pdl_launch
from .triton_attention import Norms, kv_cast, paged_attention, step_splits
from .triton_norm import q_norm_rope, qkv_norm_rope


@triton.jit
def _kv_write_kernel(arena_ptr, k_ptr, v_ptr, slots_ptr, k_offset, v_offset, stride_frame,
                     PAGE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t) + tl.zeros([BLOCK], tl.int32)  # broadcast: the interpreter rejects
    ok = (c < WIDTH) & (slot >= 0)                                 # block & scalar masks
    safe = tl.where(slot >= 0, slot, 0)
    dst = (safe // PAGE).to(tl.int64) * stride_frame + (safe % PAGE) * WIDTH + c
    src = t.to(tl.int64) * WIDTH + c
    dtype = arena_ptr.dtype.element_ty
    tl.store(arena_ptr + k_offset + dst, kv_cast(tl.load(k_ptr + src, mask=ok), dtype), mask=ok)
    tl.store(arena_ptr + v_offset + dst, kv_cast(tl.load(v_ptr + src, mask=ok), dtype), mask=ok)


def kv_write_block(width: int) -> int:
    """Elements one program copies of a token's `width`-element K (and V) row: all of it up to 1,024, a power of
    two (tl.arange's)."""
    return min(1024, triton.next_power_of_2(width))


def kv_write_(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_offset: int,
              v_offset: int, page_size: int) -> None:
    """In-place write (the op's contract); k/v [T, Hkv, D], slots int32 [T]."""
    T = k.shape[0]
    if T == 0:
        return
    if arena.stride(1) != 1:
        raise ValueError("arena must be contiguous in its last dim")
    width = k.shape[1] * k.shape[2]
    block = kv_write_block(width)
    k, v = k.contiguous(), v.contiguous()
    grid = (T, triton.cdiv(width, block))
    _kv_write_kernel[grid](arena, k, v, slots, int(k_offset), int(v_offset), arena.stride(0),
                           PAGE=int(page_size), WIDTH=width, BLOCK=block, num_warps=4, **pdl_launch(arena.device))


def kv_write_attention_(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                        q: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                        first_page: torch.Tensor, k_offset: int, v_offset: int, page_size: int, num_kv_heads: int,
                        window_left: int, scale: float) -> torch.Tensor:
    """kv_write_ then paged_attention (the op `kv_write_attention_`): a decode step (one query token a sequence,
    T == B) in one launch, whose attention kernel writes the rows itself; any other step in the two launches."""
    args = (q, arena, cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads,
            window_left, scale)
    if q.shape[0] == kv_lens.shape[0]:
        return paged_attention(*args, write=(k.contiguous(), v.contiguous(), slots))
    kv_write_(arena, k, v, slots, k_offset, v_offset, page_size)
    return paged_attention(*args)


def projected_attention_(arena: torch.Tensor, y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor | None,
                         eps: float, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, k_eq_v: bool,
                         slots: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                         first_page: torch.Tensor, k_offset: int, v_offset: int, page_size: int, num_kv_heads: int,
                         window_left: int, scale: float) -> torch.Tensor:
    """A layer's attention from its packed q/k/v projection y (triton_norm.qkv_norm_rope's input; q alone where
    k_weight is None, a KV-shared layer, which writes nothing): a decode cut over its keys (`step_splits` > 1: a few
    latency-bound programs a head, as at batch 1) in one launch, any other step as the q/k/v norm kernel and then
    kv_write_attention_ (paged_attention on a KV-shared layer). On the H200 the one launch took the E2B's batch-1 step
    from 2.18 to 2.00 ms with the early key tile; at the 31B's serving batches, a program a (sequence, KV head), its
    norm held q's rows through the key loop and the step lost 2.4-3.7 % (export/results/README.md, "The 31B on
    `next/all-norm`")."""
    rest = (cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads, window_left, scale)
    B = kv_lens.shape[0]
    if y.shape[0] == B and (splits := step_splits(B, page_table, page_size, window_left, num_kv_heads,
                                                  cos.shape[-1])) > 1:
        norms = Norms(q_weight, k_weight, eps, cos.contiguous(), sin.contiguous(), num_q_heads, k_eq_v)
        return paged_attention(y, arena, *rest, num_splits=splits, norms=norms,
                               write=None if k_weight is None else (None, None, slots))
    if k_weight is None:
        return paged_attention(q_norm_rope(y, q_weight, eps, cos, sin), arena, *rest)
    q, k, v = qkv_norm_rope(y, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads, k_eq_v)
    return kv_write_attention_(arena, k, v, slots, q, *rest)


_projected_attention_op = torch.library.custom_op("g4rt::projected_attention_", projected_attention_,
                                                 mutates_args=("arena",))


@_projected_attention_op.register_fake
def _(arena, y, q_weight, k_weight, eps, cos, sin, num_q_heads, k_eq_v, slots, cu_q, kv_lens, page_table, first_page,
      k_offset, v_offset, page_size, num_kv_heads, window_left, scale):
    return y.new_empty(y.shape[0], num_q_heads, cos.shape[-1])
