"""Triton paged attention over the arena (plugins/README.md): one kernel, two launch shapes.

* **Decode** (every sequence has one query token, i.e. T == B, known from shapes alone): split-K
  ("flash decoding"). Each program takes one (sequence, KV head, split): all query heads of the KV
  head's group are rows of one tile, so K/V are read once per group; the sequence's visible key
  range is cut into num_splits equal runs of tiles, each program writes an unnormalised partial
  (m, l, acc) and a small combine kernel merges them. With one split the main kernel writes
  the output directly. A decode reads its metadata and its split's first K tile, less the query's own
  key, before it waits for the kernel before it (`EARLY`; plugins/README.md says why that is safe).
* **Prefill / chunked prefill / mixed batches**: grid cdiv(T - B + 1, BLOCK_Q) x B x Hkv; T - B + 1
  bounds any sequence's q_len because each sequence has >= 1 query token, and programs past their
  sequence's q_len return at once, so no host sync is needed to size the grid. A program's rows are
  BLOCK_Q tokens x (group heads, padded to a power of two) folded into the M dimension.

Both shapes walk only the keys some row of the tile can see: from max(first_page * P, p_first -
window_left) up to p_last. Pages wholly outside the window are never touched, so a sliding layer's
time stops growing with context once context > window. Key tiles that every row of the query tile
sees whole (the interior of a long prefill chunk, all but the last tile of a decode) skip the
per-score causal/window mask; only the tiles at the two edges are masked (fp32 head-dim-512 prefill,
a reference run's one-stage tile, keeps one masked loop: see default_config).

Prefill with head dim 512 may cut the output columns across `dv_split` programs (config key): each
recomputes the scores but holds a 1/dv_split accumulator and V tile, which is what limits the tile
sizes at that head dim (registers and shared memory).

Tiles may span pages: every key row looks up its own frame in the page table (a [BLOCK_N] int32
load that mostly hits one cache line), so BLOCK_N is free of the page size (16-token sliding pages
would otherwise force 16-key tiles) and any page size works, 160 included.

Numerics: scores, softmax (base 2, with log2(e) folded into the scale) and accumulation in fp32;
P is cast to the KV dtype for the second matmul, as in FlashAttention. The scale is cast to fp32
in-kernel because Inductor passes Python floats as fp64. Under TRITON_INTERPRET=1 bf16 arithmetic
is wrong, so UPCAST loads tiles as fp32 there (set automatically).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gluon_attention
from .buckets import pow2_bucket
from .launch import await_inputs, hopper, interpreting, launch_next, pdl_launch, sm90, sm_count
from .triton_norm import joined, norm_rope, v_norm


@triton.jit
def _tile_rows(kn, k_ok, table_ptr, b, h, first, stride_frame, table_stride, HKV: tl.constexpr, D: tl.constexpr,
               PAGE: tl.constexpr):
    """Each key's offset in the arena, K or V's: its frame looked up in the page table."""
    frame = tl.load(table_ptr + b * table_stride + (kn // PAGE - first), mask=k_ok, other=0)
    return frame.to(tl.int64) * stride_frame + ((kn % PAGE) * HKV + h) * D


@triton.jit
def kv_cast(x, dtype: tl.constexpr):
    """K or V rows as an arena of `dtype` stores them: reference.to_kv's bits. A 1-byte float (e4m3) is rounded
    in fp32 arithmetic first, to 3 mantissa bits with ties to even (the magnitude scaled to its quantum, 2^(e-3),
    or 2^-9 below e4m3's normal range, then rounded by adding and subtracting 1.5 * 2^23), saturated at 448, the
    sign kept (so -0 stays -0): the conversion after it is then exact, and gives torch's bits on the GPU and under
    the Triton interpreter, whose own fp8 rounding drops the carry into the exponent. Other dtypes: a cast."""
    if dtype.primitive_bitwidth == 8:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        a = tl.minimum((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True), 448.0, propagate_nan=tl.PropagateNan.ALL)
        quantum = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) - (3 << 23), (127 - 9) << 23)
        r = (a * ((254 << 23) - quantum).to(tl.float32, bitcast=True) + 12582912.0) - 12582912.0
        r = r * quantum.to(tl.float32, bitcast=True)
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _prefetch_rows(rows, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16; none where 0) from each of `rows` (16-byte aligned): one
    `cp.async.bulk.prefetch.L2` a row, fire and forget (nothing waits for it, nothing on the SM holds the data)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [rows.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fold_scores(q, kt, qk_scale, m_i, l_i, kn, k_ok, pos, wl, MASK: tl.constexpr, UPCAST: tl.constexpr,
                 PREC: tl.constexpr):
    """A key tile's scores folded into the online softmax: (p, alpha, m_new, l_new). PREC is tl.dot's input
    precision, or "fma": the products in fp32 on the CUDA cores (a decode whose rows are its group's heads alone,
    fewer than the 16 an MMA takes)."""
    if UPCAST:
        kt = kt.to(tl.float32)
    if PREC == "fma":
        s = tl.sum(q.to(tl.float32)[:, None, :] * kt.to(tl.float32)[None, :, :], axis=2) * qk_scale
    else:
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
    if MASK:
        seen = (k_ok[None, :] & (kn[None, :] <= pos[:, None])) & (kn[None, :] >= pos[:, None] - wl)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _fold_values(acc, p, alpha, vt, UPCAST: tl.constexpr, PREC: tl.constexpr):
    if UPCAST:
        vt = vt.to(tl.float32)
    if PREC == "fma":  # P stays fp32: no MMA operand to round it for
        pv = tl.sum(p[:, :, None] * vt.to(tl.float32)[None, :, :], axis=1)
    else:
        pv = tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
    return acc * alpha[:, None] + pv


@triton.jit
def _attend_tiles(q, qk_scale, m_i, l_i, acc, lo, hi, pos, wl, arena_ptr, table_ptr, b, h, first, k_offset, v_offset,
                  stride_frame, table_stride, t_end, dv0, k_desc, v_desc,
                  HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                  TMA: tl.constexpr, PIPE: tl.constexpr = None):
    """Online softmax over the key tiles starting in [lo, hi). MASK False: every row sees every key of
    these tiles (the caller proved it), so the per-score causal/window mask is skipped; where it would
    be all true the result is the same bits. Loads stay masked at t_end (cheap: one bit per key row).
    TMA: each tile lies in one page and every key of it exists (the caller proved both), so its K and V
    come by tensor-memory copies through k_desc / v_desc ([frames, PAGE, HKV * D] views of the arena):
    one page-table lookup per tile and no per-element addresses in registers. PIPE (None: the launch's
    num_stages decides): the loop's stages for Triton's software pipeliner, which without it pipelines only
    loads that feed a tl.dot; the `fma` tile's K and V (and their page-table entries) are otherwise read by
    plain loads, one tile at a time."""
    d = tl.arange(0, D)
    dv = dv0 + tl.arange(0, DV)
    n_off = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=PIPE):
        kn = start + n_off
        k_ok = kn < t_end
        if TMA:
            page = tl.load(table_ptr + b * table_stride + (start // PAGE - first))
            kt = tl.reshape(k_desc.load([page, start % PAGE, h * D]), [BLOCK_N, D])
        else:
            base = _tile_rows(kn, k_ok, table_ptr, b, h, first, stride_frame, table_stride, HKV, D, PAGE)
            kt = tl.load(arena_ptr + k_offset + base[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
        p, alpha, m_i, l_i = _fold_scores(q, kt.to(q.dtype), qk_scale, m_i, l_i, kn, k_ok, pos, wl, MASK, UPCAST,
                                          PREC)
        if TMA:
            vt = tl.reshape(v_desc.load([page, start % PAGE, h * D + dv0]), [BLOCK_N, DV])
        else:
            vt = tl.load(arena_ptr + v_offset + base[:, None] + dv[None, :], mask=k_ok[:, None], other=0.0)
        acc = _fold_values(acc, p, alpha, vt.to(q.dtype), UPCAST, PREC)
    return m_i, l_i, acc


@triton.jit
def _store_own_key(arena_ptr, k_row, v_row, slot, mine, h, k_offset, v_offset, stride_frame,
                   HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    """A token's K and V rows of KV head h (read beside q) into the arena at its slot, cast as kv_write casts them,
    where `mine` and the slot is not -1; then a barrier of the program's threads, after which its loads see the
    rows. Only the program that writes a key reads it, so no other program waits for it."""
    d = tl.arange(0, D)
    slot = slot + tl.zeros([D], tl.int32)  # broadcast: the interpreter rejects block & scalar masks
    ok = (slot >= 0) & ((mine.to(tl.int32) + tl.zeros([D], tl.int32)) != 0)
    safe = tl.where(ok, slot, 0)
    dst = (safe // PAGE).to(tl.int64) * stride_frame + ((safe % PAGE) * HKV + h) * D + d
    dtype = arena_ptr.dtype.element_ty
    tl.store(arena_ptr + k_offset + dst, kv_cast(k_row, dtype), mask=ok)
    tl.store(arena_ptr + v_offset + dst, kv_cast(v_row, dtype), mask=ok)
    tl.debug_barrier()


@triton.jit
def _paged_attn_kernel(
    q_ptr, arena_ptr, cu_q_ptr, kv_lens_ptr, table_ptr, first_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
    scale, window_left, k_offset, v_offset, stride_frame, table_stride, num_splits, k_desc, v_desc,
    k_new_ptr, v_new_ptr, slots_ptr, stride_q, qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DV_SPLIT: tl.constexpr, INTERIOR: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    TMA: tl.constexpr = False, WRITE: tl.constexpr = False, NORM: tl.constexpr = False, K_EQ_V: tl.constexpr = False,
    PDL: tl.constexpr = False, EARLY: tl.constexpr = False, L2_V: tl.constexpr = False, PIPE: tl.constexpr = None,
):
    # num_splits is a runtime int (batch-dependent; a constexpr would compile one kernel per value);
    # SPLIT (num_splits > 1) picks the epilogue: the output itself, or a partial for the combine.
    # DV_SPLIT > 1: each program writes 1/DV_SPLIT of the output's columns (same scores, recomputed),
    # so its accumulator and V tiles are that much smaller (head dim 512 prefill).
    # WRITE (decode only): the step's K/V rows (k_new, v_new [B, HKV, D]) go to their slots first, by the one
    # program whose key run holds the query's own key, the only one that reads it (`_store_own_key`).
    # NORM (decode only): q_ptr is the layer's packed q/k/v projection (tokens stride_q apart, triton_norm's q/k/v
    # kernel's input), whose q the kernel norms and ropes itself (qw, cos, sin, eps); with WRITE the own K/V rows
    # come from it too (kw; K_EQ_V: V is the raw K), not from k_new / v_new.
    # EARLY (a decode launch: one query a sequence): the launch's metadata and its split's first key tile, less the
    # query's own key, are read before the wait (see the early tile below).
    # PIPE: the interior loop's pipeline stages (`_attend_tiles`; the fma tile's, where its config asks `pipe`).
    if not EARLY:
        await_inputs(PDL)
    ROWS: tl.constexpr = BLOCK_Q * GP
    DV: tl.constexpr = D // DV_SPLIT
    # Programs start in id order; numbered backwards, a prefill chunk's last query tiles, which see the
    # most keys, start first and the short ones fill the last wave (longest first).
    pid0 = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    if DV_SPLIT == 1:
        dv0 = 0  # a constant: V and output columns share `d`'s index vector (head dim 512 has no registers to spare)
    else:
        dv0 = (pid0 % DV_SPLIT) * DV
        pid0 = pid0 // DV_SPLIT
    mb = pid0 // num_splits
    split = pid0 % num_splits

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    m0 = mb * BLOCK_Q
    if m0 >= q_len:  # this sequence has fewer query tokens than the grid allows for
        return
    kv_len = tl.load(kv_lens_ptr + b)
    first = tl.load(first_ptr + b)

    r = tl.arange(0, ROWS)
    qi = m0 + r // GP  # query index inside the sequence
    g = r % GP  # head inside the group
    row_ok = (qi < q_len) & (g < G)
    pos = kv_len - q_len + qi  # absolute position of each row's query
    d = tl.arange(0, D)
    dv = dv0 + tl.arange(0, DV)
    q_row = (q_start + qi).to(tl.int64) * HQ + h * G + g  # row of the flat [T * HQ, D] view (the output's)
    dtype = out_ptr.dtype.element_ty
    qk_scale = tl.cast(scale, tl.float32) * 1.4426950408889634

    # The keys this tile can see: [k_lo, k_hi). A negative window_left means none; it becomes a
    # distance no position reaches so the same arithmetic serves both cases.
    wl = tl.where(window_left >= 0, window_left, 1 << 30)
    p_first = kv_len - q_len + m0
    p_last = kv_len - q_len + tl.minimum(m0 + BLOCK_Q, q_len) - 1
    k_lo = tl.maximum(first * PAGE, p_first - wl)
    k_hi = p_last + 1
    n_tiles = tl.cdiv(k_hi - k_lo, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_begin = k_lo + split * per_split * BLOCK_N
    t_end = tl.minimum(k_hi, t_begin + per_split * BLOCK_N)
    # Tiles whose every key every row sees (k <= p_first, k >= p_last - wl, k < t_end) skip the masks:
    # tiles [j0, j1) of this split's run; the ones before and after are masked.
    tiles = tl.maximum(tl.cdiv(t_end - t_begin, BLOCK_N), 0)
    j0 = tl.minimum(tl.maximum(tl.cdiv(p_last - wl - t_begin, BLOCK_N), 0), tiles)
    j1 = tl.maximum(tl.minimum((tl.minimum(p_first + 1, t_end) - t_begin) // BLOCK_N, tiles), j0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DV], tl.float32)
    if EARLY:
        # The early tile: the split's first key tile. A decode step writes one row of a layer's cache, the query's
        # own key (p_first: in this launch, or a KV-shared layer's source's); the keys before it were written by
        # earlier steps. The attention launch of the layer before, like every Triton launch of a step, lets the
        # next launch in only after its own wait, so by the time this one runs every launch before that one has
        # ended, earlier steps included, and those keys' K is read while the launches between run. The own key, q
        # and the tile's V (registers: K and V held across the wait spill) are read after the wait.
        kn = t_begin + tl.arange(0, BLOCK_N)
        k_ok = kn < t_end
        base = _tile_rows(kn, k_ok, table_ptr, b, h, first, stride_frame, table_stride, HKV, D, PAGE)
        old = (k_ok & (kn < p_first))[:, None]
        kt = tl.load(arena_ptr + k_offset + base[:, None] + d[None, :], mask=old, other=0.0)
        if L2_V:  # the tile's V asked of L2 (no registers held across the wait)
            _prefetch_rows(arena_ptr + v_offset + base + dv0,
                           tl.where(k_ok, DV * arena_ptr.dtype.element_ty.primitive_bitwidth // 8, 0))
        await_inputs(PDL)
    if WRITE:  # the step's K/V rows, read or formed, stored before any read of the own key
        t0 = q_start.to(tl.int64)
        if NORM:
            tok = tl.zeros([1], tl.int64) + t0
            one = tok >= 0
            v_head = HQ + h if K_EQ_V else HQ + HKV + h
            k_row = tl.reshape(joined(*norm_rope(q_ptr, tok * stride_q + (HQ + h) * D, tok, one, kw_ptr, cos_ptr,
                                                 sin_ptr, eps, D, dtype)), [D])
            v_row = tl.reshape(v_norm(q_ptr, tok * stride_q + v_head * D, one, eps, D, dtype), [D])
        else:
            own = (t0 * HKV + h) * D + d
            k_row, v_row = tl.load(k_new_ptr + own), tl.load(v_new_ptr + own)
        _store_own_key(arena_ptr, k_row, v_row, tl.load(slots_ptr + q_start), (p_last >= t_begin) & (p_last < t_end),
                       h, k_offset, v_offset, stride_frame, HKV, D, PAGE)
    if EARLY:
        own = (k_ok & (kn == p_first))[:, None]
        kt = tl.where(own, tl.load(arena_ptr + k_offset + base[:, None] + d[None, :], mask=own, other=0.0), kt)
        vt = tl.load(arena_ptr + v_offset + base[:, None] + dv[None, :], mask=k_ok[:, None], other=0.0)
    if NORM:
        q = joined(*norm_rope(q_ptr, (q_start + qi).to(tl.int64) * stride_q + (h * G + g) * D, q_start + qi, row_ok,
                              qw_ptr, cos_ptr, sin_ptr, eps, D, dtype))
    else:
        q = tl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif arena_ptr.dtype.element_ty.primitive_bitwidth == 8:
        # A one-byte (e4m3) arena's tiles widen to fp16, which holds every e4m3 value, in one conversion a pair
        # (to bf16 it takes three); q (normed: far inside fp16's range) and P go to fp16 with them, the sums stay
        # fp32.
        q = q.to(tl.float16)
    if EARLY:
        p, alpha, m_i, l_i = _fold_scores(q, kt.to(q.dtype), qk_scale, m_i, l_i, kn, k_ok, pos, wl, True, UPCAST, PREC)
        acc = _fold_values(acc, p, alpha, vt.to(q.dtype), UPCAST, PREC)
        m_i, l_i, acc = _attend_tiles(q, qk_scale, m_i, l_i, acc, t_begin + BLOCK_N, t_end, pos, wl, arena_ptr,
                                      table_ptr, b, h, first, k_offset, v_offset, stride_frame, table_stride, t_end,
                                      dv0, k_desc, v_desc, HKV, D, DV, PAGE, BLOCK_N, True, UPCAST, PREC, False)
    elif INTERIOR:  # the interior tiles (MASK False) take TMA where the host allowed it; edges never do
        m_i, l_i, acc = _attend_tiles(q, qk_scale, m_i, l_i, acc, t_begin, t_begin + j0 * BLOCK_N, pos, wl,
                                      arena_ptr, table_ptr, b, h, first, k_offset, v_offset, stride_frame,
                                      table_stride, t_end, dv0, k_desc, v_desc, HKV, D, DV, PAGE, BLOCK_N,
                                      True, UPCAST, PREC, False)
        m_i, l_i, acc = _attend_tiles(q, qk_scale, m_i, l_i, acc, t_begin + j0 * BLOCK_N, t_begin + j1 * BLOCK_N,
                                      pos, wl, arena_ptr, table_ptr, b, h, first, k_offset, v_offset, stride_frame,
                                      table_stride, t_end, dv0, k_desc, v_desc, HKV, D, DV, PAGE, BLOCK_N,
                                      False, UPCAST, PREC, TMA, PIPE)
        m_i, l_i, acc = _attend_tiles(q, qk_scale, m_i, l_i, acc, t_begin + j1 * BLOCK_N, t_end, pos, wl,
                                      arena_ptr, table_ptr, b, h, first, k_offset, v_offset, stride_frame,
                                      table_stride, t_end, dv0, k_desc, v_desc, HKV, D, DV, PAGE, BLOCK_N,
                                      True, UPCAST, PREC, False)
    else:  # one masked loop over every tile
        m_i, l_i, acc = _attend_tiles(q, qk_scale, m_i, l_i, acc, t_begin, t_end, pos, wl, arena_ptr, table_ptr,
                                      b, h, first, k_offset, v_offset, stride_frame, table_stride, t_end, dv0,
                                      k_desc, v_desc, HKV, D, DV, PAGE, BLOCK_N, True, UPCAST, PREC, False)

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key yields zeros
        tl.store(out_ptr + q_row[:, None] * D + dv[None, :], out.to(dtype), mask=row_ok[:, None])
    else:
        ws_row = q_row * num_splits + split
        tl.store(ws_acc_ptr + ws_row[:, None] * D + dv[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_ml_ptr + ws_row * 2, m_i, mask=row_ok)
        tl.store(ws_ml_ptr + ws_row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Merge the num_splits partial softmaxes of one (token, query head) row into the output.

    With PDL it lets the next kernel launch before its own wait, which lasts the whole split attention before it:
    the kernel after it (a layer's o_proj, copied launches whose weight slices are copied before their wait) then
    reads its weights while the attention runs, where a trigger after the wait started those reads only once the
    attention had ended. Safe as any trigger: that kernel waits for this one, which ends after the attention."""
    launch_next(PDL)
    await_inputs(PDL, LAUNCH_NEXT=False)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < num_splits
    ws_row = row * num_splits + sp
    m = tl.load(ws_ml_ptr + ws_row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ws_ml_ptr + ws_row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)
    total = tl.sum(l * w, 0)
    d = tl.arange(0, D)
    acc = tl.load(ws_acc_ptr + ws_row[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


WIDE_DECODE = 6  # programs an SM from which an unsplit head-dim-256 decode takes one-warp tiles (default_config)
FMA_GROUP = 2  # the largest group whose wide unsplit decode runs on the CUDA cores (`fma`, default_config)
PIPE_BELOW = 12  # programs an SM below which the fma tile's key loop is software-pipelined (`pipe`, default_config)


def default_config(head_dim: int, decode: bool, elem_bytes: int = 2, splits: int = 1,
                   programs_per_sm: float = 0.0, kv_bytes: int | None = None, group: int = 1) -> dict:
    """Tile shapes by head dim. Rows = query tokens x padded group heads; tl.dot needs >= 16. Each choice is the
    fastest of the H200 sweeps (`bench.kernels --prefill-only` / `--decode-batch`, `bench.compile_report`;
    numbers in plugins/results):

    * Prefill, 2-byte inputs: D=256 takes 128x64 over 8 warps, 2 stages, with unmasked interior tiles (about half
      the bf16 matmul rate at 8k). D=512 takes the Gluon kernel on a Hopper GPU (`wgmma`, gluon_attention.py:
      both matmuls over two warpgroups side by side, nothing computed twice); elsewhere (CPU, older GPUs, an
      arena the copy engine cannot take) this module's best tile, 128x32 over 8 warps with the output columns cut
      in two (`dv_split`) and interior tiles by tensor-memory copies (`tma`): 32-key tiles leave room for a second
      stage beside the 128 KB Q tile, where 64-key tiles fit one.
    * Decode: 64-key tiles at D=256 and 32 at D=512 read long runs of keys at 94-98 % of the copy bandwidth. An
      unsplit decode at D=256 (`splits` 1: a program per SM or more, e.g. the 31B's sliding layers from batch 9)
      reads a few tiles a program at a serving step's context, so its start and end weigh and small CTAs that
      share an SM cover each other: 32-key tiles over 2 warps, and from WIDE_DECODE programs an SM
      (`programs_per_sm`) 16-key tiles over one warp (the 31B's sliding layer at batch 64-256 took 7-9 % less
      time than on the two-warp tile and about 20 % less than on the split decode's; at batch 16 the one-warp
      tile made the step slower). D=512 gained nothing from smaller tiles.
    * fp32 inputs (reference runs) need twice the shared memory per tile, so their tiles are halved and D=512
      keeps whole columns (fp32 D=512 prefill at 64x32 asked for 295 KB of the H200's 227 KB); untimed, chosen
      to fit.
    * A group of at most FMA_GROUP heads (`group`; the 31B's and the 26B-A4B's sliding layers: 2) from WIDE_DECODE
      programs an SM at D=256, either arena: the `fma` tile (`rows` 1), whose rows are the group's heads alone and
      whose two products are fp32 on the CUDA cores, without an MMA's 16-row padding, 8 keys over one warp. On an
      H100 (`bench.kernels --decode-batch --decode-batch-fma`, the 31B's sliding layer at batch 64 / 128 / 256)
      bf16 took 87.2 / 148.5 / 289.6 us against the one-warp MMA tile's 87.3 / 161.6 / 312.4, e4m3 63.1 / 88.1 /
      168.5 (80-84 % of the copy bandwidth from batch 128) where its MMA tiles took 76-83 / 129 / 238. A group
      of 8 (the full layers) took 2-5x its MMA tile's time this way (export/results/README.md, session 37).
      Below PIPE_BELOW programs an SM (the 31B's batch 64: 7.8) its key loop is software-pipelined (`pipe`: the
      next tiles' K and V in flight while one is summed), 2 stages with bf16, 3 with e4m3: on an H100 at batch 64,
      context 200, 82.2 against 87.5 us (86 % of the copy bandwidth against 81 %) and 49.8 against 63.2 us; at
      batch 128 (15.5 an SM) the pipelined tile's registers (141 / 168) leave too few programs an SM and it took
      173.3 against 149.3 us and 114.5 against 88.3 (export/results/README.md, session 40).
    * A one-byte arena (`kv_bytes` 1; default `elem_bytes`) in a larger group, where the MMA tile's work per key,
      not its bytes, bounds the decode (38-41 % of the copy bandwidth on the H200): from WIDE_DECODE programs an
      SM 16-key tiles over 2 warps in 3 stages (the fastest of `bench.kernels --decode-batch --decode-batch-tiles
      --kv-dtype float8_e4m3fn` at the 31B's batch 64-256 on the H200, group 2), and an unsplit full layer's
      32-key tiles in one stage (the fastest on an H100, before the widening to fp16; session 36)."""
    one_byte = (kv_bytes or elem_bytes) == 1
    if decode and head_dim <= 256 and splits == 1 and programs_per_sm >= WIDE_DECODE and group <= FMA_GROUP:
        cfg = {"rows": 1, "block_n": 8, "num_warps": 1, "num_stages": 2, "fma": True}
        if programs_per_sm < PIPE_BELOW:
            cfg.update(pipe=True, num_stages=3 if one_byte else 2)
    elif decode and one_byte and splits == 1 and head_dim > 256:
        cfg = {"rows": 16, "block_n": 32, "num_warps": 4, "num_stages": 1}
    elif decode and one_byte and splits == 1 and programs_per_sm >= WIDE_DECODE:
        cfg = {"rows": 16, "block_n": 16, "num_warps": 2, "num_stages": 3}
    elif decode and head_dim <= 256 and splits == 1 and programs_per_sm >= WIDE_DECODE:
        cfg = {"rows": 16, "block_n": 16, "num_warps": 1, "num_stages": 2}
    elif decode and head_dim <= 256 and splits == 1:
        cfg = {"rows": 16, "block_n": 32, "num_warps": 2, "num_stages": 2}
    elif decode:
        cfg = {"rows": 16, "block_n": 64 if head_dim <= 256 else 32, "num_warps": 4, "num_stages": 2}
    elif head_dim <= 128:
        cfg = {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
    elif head_dim <= 256:
        cfg = {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}
    elif elem_bytes <= 2:
        cfg = {"rows": 128, "block_n": 32, "num_warps": 8, "num_stages": 2, "dv_split": 2, "tma": True, "wgmma": True}
    else:
        cfg = {"rows": 64, "block_n": 32, "num_warps": 8, "num_stages": 1}
    cfg["interior"] = decode or head_dim <= 256 or elem_bytes <= 2
    if elem_bytes > 2:
        cfg["block_n"] = max(16, cfg["block_n"] // 2)
        if not decode:
            cfg["rows"] = max(16, cfg["rows"] // 2)
    return cfg


SPLIT_MIN_ELEMS = 16384  # decode_splits: the fewest key elements (keys x head dim) one split reads per head
MAX_DECODE_SPLITS = 64  # decode_splits: the most key runs a decode cuts one (sequence, KV head) into


def decode_splits(batch: int, num_kv_heads: int, max_keys: int, head_dim: int, device: torch.device) -> int:
    """How many key runs each (sequence, KV head) of a decode step is cut into, from shapes only.

    Enough programs for about two waves over the SMs, but no split shorter than SPLIT_MIN_ELEMS key
    elements: 64 keys at head dim 256, 32 at 512. At batch 1 and a few hundred keys one program per
    KV head is latency-bound, and on the H200 runs that short measure fastest (bench.kernels
    --decode-short, plugins/results: 31B sliding layer at 512 keys 24.8 us unsplit, 12.6 with 8 splits;
    full layer at 1,024 keys 74.9 us, 15.3 with 16); shorter ones gain nothing over the combine.
    The caller passes the batch and table width rounded up to powers of two: the CUDA-graph engine
    pads decode batches to those buckets, and the split count sets the order of the softmax sums,
    so an eager step and a replayed one must pick the same count to compute the same bits."""
    sms = sm_count(device)
    programs = batch * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_keys * head_dim // SPLIT_MIN_ELEMS, MAX_DECODE_SPLITS))


def step_splits(batch: int, page_table: torch.Tensor, page_size: int, window_left: int, num_kv_heads: int,
                head_dim: int) -> int:
    """decode_splits for a decode launch of `batch` sequences on `page_table` (paged_attention's count, and the
    fused decode's rule in triton_kv_write.projected_attention_): the batch and the table's width by their graph
    buckets, the keys bounded by the window."""
    max_keys = pow2_bucket(page_table.shape[1]) * page_size
    if window_left >= 0:
        max_keys = min(max_keys, window_left + 1)
    return decode_splits(pow2_bucket(batch), num_kv_heads, max_keys, head_dim, page_table.device)


def takes_copies(cfg: dict, decode: bool, window_left: int, page_size: int) -> bool:
    """Whether a launch on tiles `cfg` copies its interior key tiles by tensor-memory copies, from its shape
    alone: asked (`tma`), a prefill with the unmasked interior, no window (a window's first key need not start
    a tile on a page boundary), and block_n dividing the page (a tile would cross frames). The arena must
    then suit the copy engine too (`kv_descriptors`)."""
    return (bool(cfg.get("tma")) and not decode and window_left < 0 and cfg.get("interior", True)
            and page_size % cfg["block_n"] == 0)


def takes_wgmma(cfg: dict, decode: bool, window_left: int, head_dim: int, elem_bytes: int, group: int,
                page_size: int, device: torch.device | None = None) -> bool:
    """Whether a launch goes to the Gluon kernel (gluon_attention.py), from its shape: asked (`wgmma`), a
    prefill without a window, 2-byte K/V, head dim 512 (the two warpgroups' 256 output columns each), a group
    of at most its 64 rows, a page its key tile divides; and with `device`, one of compute capability 9 (`sm90`)
    outside the interpreter. Gluon has no interpreter: CPU runs and other GPUs take this module's kernel."""
    return (bool(cfg.get("wgmma")) and not decode and window_left < 0 and head_dim == 512 and elem_bytes == 2
            and group <= gluon_attention.ROWS.value and page_size % gluon_attention.BLOCK_N == 0
            and (device is None or (sm90(device) and not interpreting())))


def query_block(rows: int, group: int) -> int:
    """Query tokens of a tile of `rows` rows: each brings its group's query heads, padded to a power of two (a
    decode's tile is padding rows but for query 0 of each sequence)."""
    return max(1, rows // triton.next_power_of_2(group))


def launch_constexprs(cfg: dict, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      num_splits: int, fp32: bool, copies: bool, decode: bool, arena_grid: tuple = (),
                      kv_bytes: int | None = None) -> dict:
    """The kernel's constexprs for a launch on tiles `cfg` (paged_attention's, and bench.compile_report's
    offline compile of the same kernel); `arena_grid`: the layer's K and V offsets and the frame stride, in
    elements of `kv_bytes` bytes, the arena's (default the query's) (`early_rows`; empty: an arena the engine
    allocates, PageGeometry's). The early tile is a decode's cut
    over its keys (`num_splits` > 1): a few latency-bound programs a head, as at batch 1, where reading the first key
    tile before the wait gained; with a program a (sequence, KV head) at serving batches it made the 31B's step
    slower (export/results/README.md, "The 31B on `next/all-norm`")."""
    group = num_q_heads // num_kv_heads
    gp = triton.next_power_of_2(group)
    early = decode and num_splits > 1 and early_rows(head_dim, kv_bytes or (4 if fp32 else 2), *arena_grid)
    return dict(HQ=num_q_heads, HKV=num_kv_heads, G=group, GP=gp, D=head_dim, PAGE=int(page_size),
                BLOCK_Q=query_block(cfg["rows"], group),
                BLOCK_N=cfg["block_n"], SPLIT=num_splits > 1, DV_SPLIT=cfg.get("dv_split", 1),
                INTERIOR=cfg.get("interior", True), UPCAST=interpreting(),
                PREC="fma" if cfg.get("fma") else "ieee" if fp32 else "tf32",
                TMA=copies, EARLY=early, L2_V=early and not interpreting(),  # the interpreter runs no inline asm
                PIPE=cfg["num_stages"] if cfg.get("pipe") else None)


def early_rows(head_dim: int, elem_bytes: int, *arena_grid: int) -> bool:
    """Whether a decode may take the early tile (`EARLY`): a key's row of the arena is whole 128-byte cache lines,
    so the early loads never bring a line holding the query's own key into L1, where the reads after the wait would
    find its bytes from before the write, and the L2 request for V (`cp.async.bulk.prefetch.L2`, which needs
    16-byte aligned addresses) is on that grid too. That takes a row of head_dim elements and `arena_grid` (the
    layer's K and V offsets and the frame stride, in elements) all multiples of 128 bytes: every arena
    layout.PageGeometry lays out, not necessarily a hand-made one."""
    return all(n * elem_bytes % 128 == 0 for n in (head_dim, *arena_grid))


def kv_descriptors(arena: torch.Tensor, k_offset: int, v_offset: int, page_size: int, num_kv_heads: int,
                   head_dim: int, block_n: int, dv: int) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Tensor-memory copy descriptors of one layer's K and V in the arena, each a [frames, page_size,
    num_kv_heads * head_dim] view read in [1, block_n, head_dim] (K) and [1, block_n, dv] (V) boxes; None
    where the copy engine cannot take them: before Hopper, an address or stride off the 16-byte grid it
    needs, or an arena that is not one contiguous [frames, frame elements] block."""
    if not (hopper(arena.device) or interpreting()):
        return None
    view = gluon_attention.arena_view(arena, k_offset, v_offset, page_size, num_kv_heads * head_dim)
    if view is None:
        return None
    flat, shape, strides = view
    return (TensorDescriptor(flat[k_offset:], shape, strides, [1, block_n, head_dim]),
            TensorDescriptor(flat[v_offset:], shape, strides, [1, block_n, dv]))


class Norms(NamedTuple):
    """What a decode launch norms and ropes its q with, and where the layer owns a cache its K/V rows, from the
    layer's packed q/k/v projection: triton_norm.qkv_norm_rope's arguments less the projection (k_weight None: a
    KV-shared layer, whose projection is q alone). cos and sin [T, head_dim] contiguous."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    num_q_heads: int
    k_eq_v: bool


def paged_attention(q: torch.Tensor, arena: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor,
                    page_table: torch.Tensor, first_page: torch.Tensor, k_offset: int, v_offset: int,
                    page_size: int, num_kv_heads: int, window_left: int, scale: float, *,
                    out: torch.Tensor | None = None, num_splits: int | None = None,
                    config: dict | None = None, decode: bool | None = None,
                    write: tuple | None = None, norms: Norms | None = None) -> torch.Tensor:
    """Launch the kernel(s); same arguments as the op. No host syncs: every launch parameter comes
    from shapes and Python ints.

    Keyword extras for tests and the bench: `out` (pre-allocated output, e.g. NaN-poisoned),
    `num_splits` (force the decode split count), `config` (tile overrides, see default_config; `maxnreg` caps the
    registers a thread, ptxas's own count where absent;
    `dv_split` > 1 cuts the output columns across programs, prefill only; `interior` False masks
    every key tile, the bench's A/B of the unmasked interior; `tma` True has a prefill without a window
    copy its interior tiles by tensor-memory copies where `takes_copies` and `kv_descriptors` allow),
    `decode` (force or forbid the decode launch shape; it needs T == B). `write`: the step's (k, v, slots), as
    kv_write_ takes them, which a decode launch writes to the arena itself before it reads them
    (triton_kv_write.kv_write_attention_ is the op's body: it writes them first where the launch is no decode).
    `norms` (a decode launch only): `q` is then a layer's packed q/k/v projection, whose q the kernel norms and
    ropes itself (`Norms`); `write` is then (None, None, slots), the rows coming from the projection too."""
    if norms is None:
        T, HQ, D = q.shape
        q = q.contiguous()
    else:
        (T, width), HQ, D = q.shape, norms.num_q_heads, norms.cos.shape[-1]
        heads = HQ + (0 if norms.k_weight is None else (1 if norms.k_eq_v else 2) * num_kv_heads)
        if q.dim() != 2 or width != heads * D or q.stride(1) != 1:
            raise ValueError(f"norms: q must be the packed projection [T, {heads} heads x {D}] with unit column "
                             f"stride, got {tuple(q.shape)} strides {q.stride()}")
        if (write is None) != (norms.k_weight is None) or (write is not None and write[0] is not None):
            raise ValueError("norms: write must be (None, None, slots) exactly where the projection holds K/V")
    B = kv_lens.shape[0]
    HKV = num_kv_heads
    if HQ % HKV or D < 16 or D & (D - 1):
        raise ValueError(f"need num_q_heads % num_kv_heads == 0 and a power-of-two head_dim >= 16, got "
                         f"Hq={HQ} Hkv={HKV} D={D}")
    for name, t in (("arena", arena), ("page_table", page_table)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")
    is_decode = (T == B) if decode is None else decode
    if is_decode and T != B:
        raise ValueError("the decode launch needs one query token per sequence (T == B)")
    if write is not None and not is_decode:
        raise ValueError("write: only a decode launch writes the step's K/V rows itself; write them first "
                         "(kv_write_) for a prefill or mixed step")
    if norms is not None and not is_decode:
        raise ValueError("norms: only a decode launch norms and ropes its q itself; run the q/k/v norm kernel "
                         "first for a prefill or mixed step")
    if is_decode and num_splits is None:
        num_splits = step_splits(B, page_table, page_size, window_left, HKV, D)
    num_splits = num_splits or 1
    # per SM, from the batch's graph bucket (as decode_splits): an eager step and its padded replay pick one tile
    per_sm = pow2_bucket(B) * HKV / sm_count(q.device) if is_decode else 0.0
    cfg = {**default_config(D, is_decode, q.element_size(), num_splits, per_sm, arena.element_size(), HQ // HKV),
           **(config or {})}
    if out is None:
        out = q.new_empty(T, HQ, D)
    if T == 0:
        return out
    if num_splits > 1:
        ws_acc = torch.empty((T * HQ * num_splits, D), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((T * HQ * num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_ml = out  # never touched
    dv_split = cfg.get("dv_split", 1)
    if dv_split < 1 or D % dv_split or (D // dv_split) < 16 or (dv_split > 1 and num_splits > 1):
        raise ValueError(f"dv_split must divide head_dim {D} into parts >= 16 and needs one split, got "
                         f"dv_split={dv_split}, num_splits={num_splits}")
    if (takes_wgmma(cfg, is_decode, window_left, D, q.element_size(), HQ // HKV, page_size, q.device)
            and arena.dtype == q.dtype):
        descs = gluon_attention.descriptors(arena, k_offset, v_offset, page_size, HKV, D)
        if descs is not None:
            return gluon_attention.prefill_attention(q, arena, cu_q, kv_lens, page_table, first_page, k_offset,
                                                     v_offset, page_size, HKV, scale, out, descs)
    descs = None
    if takes_copies(cfg, is_decode, window_left, page_size):
        descs = kv_descriptors(arena, k_offset, v_offset, page_size, HKV, D, cfg["block_n"], D // dv_split)
    consts = launch_constexprs(cfg, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=page_size,
                               num_splits=num_splits, fp32=q.dtype == torch.float32, copies=descs is not None,
                               decode=is_decode, arena_grid=(int(k_offset), int(v_offset), arena.stride(0)),
                               kv_bytes=arena.element_size())
    m_blocks = 1 if is_decode else triton.cdiv(T - B + 1, consts["BLOCK_Q"])
    _paged_attn_kernel[(m_blocks * num_splits * dv_split, B, HKV)](
        q, arena, cu_q, kv_lens, page_table, first_page, out, ws_acc, ws_ml,
        float(scale), int(window_left), int(k_offset), int(v_offset), arena.stride(0), page_table.stride(0),
        num_splits, *(descs or (None, None)), *(write or (None, None, None)), q.stride(0),
        *((norms.q_weight, norms.k_weight, norms.cos, norms.sin, float(norms.eps)) if norms else (None,) * 5),
        **consts, WRITE=write is not None, NORM=norms is not None, K_EQ_V=bool(norms and norms.k_eq_v),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg.get("maxnreg"), **pdl_launch(q.device),
    )
    if num_splits > 1:
        _combine_kernel[(T * HQ,)](ws_acc, ws_ml, out, num_splits, D=D, BLOCK_S=triton.next_power_of_2(num_splits),
                                   num_warps=4, **pdl_launch(q.device))
    return out
