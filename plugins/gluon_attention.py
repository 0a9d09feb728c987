"""Hopper prefill attention for head dim 512 in Gluon (explicit layouts, warpgroup MMAs, tensor-memory copies).

Why a second kernel: at head dim 512 the Triton kernel (triton_attention.py) cannot hold a 128-row tile's
[rows, 512] fp32 accumulator, so it cuts the output columns across two programs, each computing every
score again (dv_split 2: 1.5x the useful FLOPs). With 64 rows over 8 warps Triton's compiler puts all 8
warps along the rows when one matmul feeds another, so the two warpgroups compute the same scores twice as
well. Here both matmuls are laid out over the two warpgroups side by side (`warps_per_cta` [4, 2]): for the
scores each warpgroup computes half of the key tile's columns, for the output each holds half of the 512
columns (64 x 256 fp32, 128 registers a thread). Nothing is computed twice; the softmax's row maximum is
shared between the warpgroups through shared memory, and the probabilities go to shared memory as the
second matmul's left operand.

Per key tile j: tile j+1's scores and P_j V_j go to the tensor cores back to back, and tile j+1's softmax runs
while P_j V_j does (P double-buffered); the running sums are kept per column, so the only cross-warpgroup
reduction of a tile is its row maximum. K and V arrive by tensor-memory copies into two rings of `STAGES` slots
with a barrier each; a K slot is refilled as soon as its tile's scores are done, a step before its V slot.
On the H200 the 31B's 8k chunk of a full layer takes 6.4-6.6 ms (337-343 TFLOP/s, 48-51 % of the bf16 matmul
rate measured beside it) where the Triton kernel takes 10.4 (plugins/results/README.md, "Head-dim-512 prefill in
Gluon"). What bounds it: 64 rows is all the accumulator leaves room for, so every query tile streams its KV head's
K and V from L2 (64 FLOPs a byte); only sharing tiles between CTAs (cluster multicast copies, not in Gluon 3.6)
would raise that.

Scope (triton_attention.takes_wgmma): prefill of a layer without a window, 2-byte K/V, head dim 512, a page size
the key tile divides, on a Hopper GPU (Gluon has no interpreter, so CPU runs and tests take the Triton kernel).
Keys at or past the sequence's length are never copied: the tile that holds the sequence's last key, when it
is partial, is loaded by masked element loads (zeros past the end), so a page's unwritten tail, NaN-poisoned in
the tests, never reaches a matmul. Numerics as the Triton kernel: fp32 scores and softmax in base 2, P cast to
the KV dtype, fp32 accumulation; the sums run in another order, so bits differ from it (not from run to run).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# The copy's name: `async_copy_global_to_shared` in triton 3.6 (the H200's image), `async_load` from 3.7 on.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# The CTA's barrier: `thread_barrier` in 3.6, `barrier` from 3.7 on.
_sync = getattr(gl, "thread_barrier", None) or gl.barrier

ROWS = gl.constexpr(64)  # query rows of a program (tokens x padded group heads): one warpgroup MMA's M
NUM_WARPS = gl.constexpr(8)  # two warpgroups side by side
TAIL_COLS = gl.constexpr(128)  # columns of K and V the partial tile's loads take at a time
BLOCK_N = 32  # keys a tile: two 32 KB slots each of K and V, beside Q's 64 KB, fill the shared memory
STAGES = 2


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, kn, pos):
    """One key tile's online-softmax step on its scores `s` [ROWS, BLOCK_N], causal mask by position: returns P
    (unnormalised), the accumulator's rescale, the new running max, and the running sums, kept per column
    ([ROWS, BLOCK_N]: no cross-warp sum per tile; the caller adds the columns at the end). A tile past the
    row's keys (the loop's lookahead past the last) is all masked and changes nothing."""
    s = gl.where(kn[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha[:, None] + p


@gluon.jit
def _issue_copy(j, n_full, k_lo, b, h, first, table_ptr, table_stride, desc, ring, bars, D: gl.constexpr,
                PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Ask the copy engine for key tile j of `desc` (K or V) into ring slot j % STAGES; nothing when j >= n_full."""
    ok = j < n_full
    start = k_lo + j * BLOCK_N
    page = gl.load(table_ptr + b * table_stride + (start // PAGE - first), mask=ok, other=0)
    st = j % STAGES
    mbarrier.expect(bars.index(st), BLOCK_N * D * 2, pred=ok)
    _tma_load(desc, [page, start % PAGE, h * D], bars.index(st), ring.index(st), pred=ok)


@gluon.jit
def _load_partial(dst, start, kv_len, b, h, first, arena_ptr, offset, stride_frame, table_ptr, table_stride,
                  HKV: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                  layout: gl.constexpr):
    """The key tile at `start` that holds the sequence's last key, K or V (the layer's `offset`), by masked
    element loads into `dst`: zeros past kv_len, so a page's unwritten tail never reaches a matmul. By column
    slabs (a whole [BLOCK_N, D] load would spill). The caller fences and syncs before a matmul reads it."""
    kn = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    k_ok = kn < kv_len
    frame = gl.load(table_ptr + b * table_stride + (kn // PAGE - first), mask=k_ok, other=0)
    base = frame.to(gl.int64) * stride_frame + ((kn % PAGE) * HKV + h) * D
    dc = gl.arange(0, TAIL_COLS, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(D // TAIL_COLS):
        cols = base[:, None] + (c * TAIL_COLS + dc)[None, :]
        dst.slice(c * TAIL_COLS, TAIL_COLS, dim=1).store(
            gl.load(arena_ptr + offset + cols, mask=k_ok[:, None], other=0.0))


@gluon.jit
def _paged_attn_wgmma_kernel(q_ptr, arena_ptr, cu_q_ptr, kv_lens_ptr, table_ptr, first_ptr, out_ptr, scale,
                             k_offset, v_offset, stride_frame, table_stride, k_desc, v_desc,
                             HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, GP: gl.constexpr,
                             D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    BLOCK_Q: gl.constexpr = ROWS // GP
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    ld_rows: gl.constexpr = gl.SliceLayout(1, ld_layout)
    q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.bfloat16)
    kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], gl.bfloat16)
    dtype = q_ptr.dtype.element_ty

    # Longest first: a chunk's last query tiles see the most keys.
    mb = gl.num_programs(0) - 1 - gl.program_id(0)
    b = gl.program_id(1)
    h = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + b)
    q_len = gl.load(cu_q_ptr + b + 1) - q_start
    m0 = mb * BLOCK_Q
    if m0 >= q_len:
        return
    kv_len = gl.load(kv_lens_ptr + b)
    first = gl.load(first_ptr + b)

    # Q: element loads into shared memory, the scores' left operand for every tile.
    r = gl.arange(0, ROWS, layout=ld_rows)
    qi = m0 + r // GP
    g = r % GP
    row_ok = (qi < q_len) & (g < G)
    q_row = (q_start + qi).to(gl.int64) * HQ + h * G + g
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
    q = gl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, D], q_shared, q)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_shared)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_shared)
    p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_N], p_shared)
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    # Keys [k_lo, k_hi) of this tile's rows; tiles start on multiples of BLOCK_N (k_lo is a page start and
    # BLOCK_N divides the page). Whole tiles below the sequence's length come by copies; a last partial one
    # by masked loads.
    qk_scale = scale.to(gl.float32) * 1.4426950408889634
    p_last = kv_len - q_len + gl.minimum(m0 + BLOCK_Q, q_len) - 1
    k_lo = first * PAGE
    k_hi = p_last + 1
    n_tiles = gl.cdiv(k_hi - k_lo, BLOCK_N)
    n_full = gl.minimum(n_tiles, (kv_len - k_lo) // BLOCK_N)
    pos = kv_len - q_len + m0 + gl.arange(0, ROWS, layout=s_rows) // GP
    n_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    for i in gl.static_range(STAGES):
        _issue_copy(i, n_full, k_lo, b, h, first, table_ptr, table_stride, k_desc, k_smem, k_bar, D, PAGE, BLOCK_N,
                    STAGES)
        _issue_copy(i, n_full, k_lo, b, h, first, table_ptr, table_stride, v_desc, v_smem, v_bar, D, PAGE, BLOCK_N,
                    STAGES)
    if n_full == 0 and n_tiles > 0:  # a sequence shorter than a tile
        _load_partial(k_smem.index(0), k_lo, kv_len, b, h, first, arena_ptr, k_offset, stride_frame, table_ptr,
                      table_stride, HKV, D, PAGE, BLOCK_N, ld_layout)
        _load_partial(v_smem.index(0), k_lo, kv_len, b, h, first, arena_ptr, v_offset, stride_frame, table_ptr,
                      table_stride, HKV, D, PAGE, BLOCK_N, ld_layout)
    fence_async_shared()
    _sync()

    m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # Tile j sits in ring slot j % STAGES: whole tiles by copies (barriers), the partial one (j == n_full) by
    # loads just before its scores are issued. A K slot is free once its tile's scores are done, a step before
    # its V slot, and its next copy is issued then. Lookahead past the last tile reads a slot that holds no
    # tile, and its all-masked softmax changes nothing.
    mbarrier.wait(k_bar.index(0), 0, pred=n_full > 0)
    s_cur = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_cur, ))
    _sync()
    _issue_copy(STAGES, n_full, k_lo, b, h, first, table_ptr, table_stride, k_desc, k_smem, k_bar, D, PAGE, BLOCK_N,
                STAGES)  # K slot 0 is free once tile 0's scores are done
    # Per step j: tile j+1's scores and P_j (in p_smem[j % 2]) times V_j go to the tensor cores back to back;
    # tile j+1's softmax runs once its scores are done, while P_j V_j still runs.
    p, alpha, m_i, l_i = _softmax(s_cur, m_i, l_i, qk_scale, k_lo + n_off, pos)
    p_smem.index(0).store(p.to(dtype))
    for j in range(n_tiles):
        st = j % STAGES
        nxt = j + 1
        if nxt == n_full and n_full < n_tiles:
            _load_partial(k_smem.index(nxt % STAGES), k_lo + nxt * BLOCK_N, kv_len, b, h, first, arena_ptr,
                          k_offset, stride_frame, table_ptr, table_stride, HKV, D, PAGE, BLOCK_N, ld_layout)
            _load_partial(v_smem.index(nxt % STAGES), k_lo + nxt * BLOCK_N, kv_len, b, h, first, arena_ptr,
                          v_offset, stride_frame, table_ptr, table_stride, HKV, D, PAGE, BLOCK_N, ld_layout)
        fence_async_shared()
        _sync()  # P_j whole in p_smem from both warpgroups (and a partial tile's loads)
        mbarrier.wait(k_bar.index(nxt % STAGES), (nxt // STAGES) & 1, pred=nxt < n_full)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        mbarrier.wait(v_bar.index(st), (j // STAGES) & 1, pred=j < n_full)
        acc = warpgroup_mma(p_smem.index(j % 2), v_smem.index(st), acc, is_async=True)
        s_next = warpgroup_mma_wait(1, deps=(s_next, ))
        p, alpha, m_i, l_i = _softmax(s_next, m_i, l_i, qk_scale, k_lo + nxt * BLOCK_N + n_off, pos)
        p_smem.index(nxt % 2).store(p.to(dtype))
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        _sync()  # both warpgroups are done with V slot st, K slot nxt % STAGES and p_smem[j % 2]
        _issue_copy(j + STAGES, n_full, k_lo, b, h, first, table_ptr, table_stride, v_desc, v_smem, v_bar, D, PAGE,
                    BLOCK_N, STAGES)
        _issue_copy(j + STAGES + 1, n_full, k_lo, b, h, first, table_ptr, table_stride, k_desc, k_smem, k_bar, D,
                    PAGE, BLOCK_N, STAGES)

    l_i = gl.sum(l_i, 1)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))
    l_o = gl.convert_layout(l_i, o_rows)
    out = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]  # a row that saw no key yields zeros
    ro = gl.arange(0, ROWS, layout=o_rows)
    qo = m0 + ro // GP
    go = ro % GP
    o_row = (q_start + qo).to(gl.int64) * HQ + h * G + go
    do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + o_row[:, None] * D + do[None, :], out.to(dtype),
             mask=((qo < q_len) & (go < G))[:, None])



def arena_view(arena: torch.Tensor, k_offset: int, v_offset: int, page_size: int, row: int):
    """One layer's K and V in the arena as the copy engine reads them: (flat arena, [frames, page_size, row]
    shape, its strides), `row` the elements of a key (KV heads x head dim); None where the engine cannot take
    them: an address or stride off its 16-byte grid, or an arena that is not one contiguous [frames, frame
    elements] block. Shared with triton_attention.kv_descriptors."""
    size = arena.element_size()
    if arena.dim() != 2 or not arena.is_contiguous() or (arena.stride(0) * size) % 16 or (row * size) % 16 \
            or any((arena.data_ptr() + off * size) % 16 for off in (k_offset, v_offset)):
        return None
    return arena.view(-1), [arena.shape[0], page_size, row], [arena.stride(0), row, 1]


def descriptors(arena: torch.Tensor, k_offset: int, v_offset: int, page_size: int, num_kv_heads: int,
                head_dim: int):
    """Copy descriptors of one layer's K and V (`arena_view`) read in [1, BLOCK_N, head_dim] boxes, or None."""
    view = arena_view(arena, k_offset, v_offset, page_size, num_kv_heads * head_dim)
    if view is None:
        return None
    flat, shape, strides = view
    block, layout = [1, BLOCK_N, head_dim], kv_layout(head_dim)
    return (TensorDescriptor(flat[k_offset:], shape, strides, block, layout),
            TensorDescriptor(flat[v_offset:], shape, strides, block, layout))


@functools.cache
def kv_layout(head_dim: int):
    """The shared-memory layout of a [1, BLOCK_N, head_dim] box of 2-byte keys (the descriptors', built once,
    not on every launch; and the signature bench.compile_report compiles against)."""
    return gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, head_dim], gl.bfloat16)


def launch_constexprs(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> dict:
    """The kernel's constexprs for a launch (prefill_attention's, and bench.compile_report's offline compile)."""
    group = num_q_heads // num_kv_heads
    return dict(HQ=num_q_heads, HKV=num_kv_heads, G=group, GP=triton.next_power_of_2(group), D=head_dim,
                PAGE=int(page_size), BLOCK_N=BLOCK_N, STAGES=STAGES)


def prefill_attention(q, arena, cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads,
                      scale, out, descs) -> torch.Tensor:
    """Launch over the prefill grid (query tiles x sequences x KV heads), as the Triton kernel's."""
    T, HQ, D = q.shape
    B = kv_lens.shape[0]
    consts = launch_constexprs(HQ, num_kv_heads, D, page_size)
    grid = (triton.cdiv(T - B + 1, ROWS.value // consts["GP"]), B, num_kv_heads)
    _paged_attn_wgmma_kernel[grid](q, arena, cu_q, kv_lens, page_table, first_page, out, float(scale), int(k_offset),
                                   int(v_offset), arena.stride(0), page_table.stride(0), *descs, **consts,
                                   num_warps=NUM_WARPS.value)
    return out
