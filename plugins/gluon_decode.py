"""Hopper decode attention at large batch in Gluon: a persistent kernel whose copies never stop between sequences.

Why a second decode kernel: at a serving step's batch (the 31B's sliding layers from batch 16 on, one program per
(sequence, KV head) or more per SM) each of the Triton kernel's programs reads a few tiles of keys (context
200: 13 pages), so every program pays its start (the page table, the first tile's latency) and the SMs idle
through the last wave. On the H200 that kernel reads at 69 % of the copy bandwidth at batch 64 and 82 % at 256;
its time fits 15 us a launch plus 86 % of the bandwidth (bench.kernels --decode-batch, plugins/results,
session 15).

Here a grid of a few CTAs per SM walks the (sequence, KV head) items in one flat loop over their key tiles,
each CTA a contiguous run of items (KV heads fastest: neighbours share a sequence's page table). K and V come by
tensor-memory copies into a ring of `ring` slots, one key tile (16 keys: a sliding page) of K and of V a slot,
refilled as soon as its tile is read, with the next tile's page looked up a tile ahead: the copies run on
across items, so a CTA starts once and the step has one tail, a tile long. An item's query heads (its group)
are the rows of one 16-row MMA (mma.sync: the group is at most 16 heads, the tiles 16 keys).

Numerics: fp32 scores, softmax (base 2) and accumulation; P stays fp32 (the Triton kernel casts it to the KV dtype for its MMA).
The copy reads whole 16-key tiles; keys no row sees (at or past the sequence's length: a page's unwritten tail;
left of the window), NaN in the tests, are masked out of the scores and their V rows zeroed before the second
matmul, so they never reach the output. A padded row of a decode bucket (length 0) gets zeros, as from the Triton kernel.

Scope (triton_attention.takes_persistent): decode with one key run per item (`splits` 1), 2-byte K/V, a group of
at most 16 heads, a page size that 16 divides, on a Hopper GPU (Gluon has no interpreter: CPU runs take the
Triton kernel).
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_attention import _sync, _tma_load, arena_view, kv_layout

BLOCK_N = 16  # keys a tile: one sliding page; divides every page size models/layout gives (16, 32, 160)
MAX_GROUP = 4  # query heads a KV head may have here: each thread holds its keys' products for all of them
NUM_WARPS = gl.constexpr(4)
LANE_GROUPS = gl.constexpr(2)  # a warp's lanes in groups, each group a key stream of its own (16 lanes a key)


@gluon.jit
def _pick(vec, j, idx):
    """Entry j of a per-item vector of this CTA (0 past its items)."""
    return gl.sum(gl.where(idx == j, vec, 0), 0)


@gluon.jit
def _item(j, idx, kvl_v, fst_v, i0, wl, HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Item j of this CTA: its sequence and KV head, the sequence's length and first resident page, the key its
    first tile starts at (a tile boundary at or below the window's first key) and its tile count (at least one,
    so a padded row of length 0 is written, with zeros)."""
    kvl = _pick(kvl_v, j, idx)
    fst = _pick(fst_v, j, idx)
    lo = gl.maximum(fst * PAGE, kvl - 1 - wl)
    lo = lo - lo % BLOCK_N
    return (i0 + j) // HKV, (i0 + j) % HKV, kvl, fst, lo, gl.maximum(gl.cdiv(kvl - lo, BLOCK_N), 1)


@gluon.jit
def _next_tile(j, tile, b, h, kvl, fst, lo, nt, idx, kvl_v, fst_v, i0, wl, HKV: gl.constexpr, PAGE: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """A cursor's step to the next key tile of the CTA's flat walk, into the next item after an item's last."""
    tile = tile + 1
    if tile == nt:
        j = j + 1
        tile = tile * 0
        b, h, kvl, fst, lo, nt = _item(j, idx, kvl_v, fst_v, i0, wl, HKV, PAGE, BLOCK_N)
    return j, tile, b, h, kvl, fst, lo, nt


@gluon.jit
def _tile_keys(layout: gl.constexpr, NW: gl.constexpr, LG: gl.constexpr, KPL: gl.constexpr):
    """A tile's key offsets [warps, lane groups, keys a lane] in `layout`: warp w, lane group g hold keys
    (w * LG + g) * KPL .. + KPL - 1."""
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    g = gl.arange(0, LG, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    k = gl.arange(0, KPL, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    return (w[:, None, None] * LG + g[None, :, None]) * KPL + k[None, None, :]


@gluon.jit
def _load_q(q_ptr, j, count, i0, rows, d, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr):
    """Item j's query rows (its group's heads; zeros in the padding rows and past the CTA's items)."""
    b = (i0 + j) // HKV
    h = (i0 + j) % HKV
    q_row = b.to(gl.int64) * HQ + h * G + rows
    return gl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=((rows < G) & (j < count))[:, None], other=0.0)


@gluon.jit
def _issue(u, total, page, key, h, k_desc, v_desc, k_ring, v_ring, bars, D: gl.constexpr, PAGE: gl.constexpr,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Ask the copy engine for flat tile u's K and V (page `page`, keys from `key`) into ring slot u % STAGES;
    nothing past the CTA's last tile."""
    ok = u < total
    st = u % STAGES
    mbarrier.expect(bars.index(st), 2 * BLOCK_N * D * 2, pred=ok)
    _tma_load(k_desc, [page, key % PAGE, h * D], bars.index(st), k_ring.index(st), pred=ok)
    _tma_load(v_desc, [page, key % PAGE, h * D], bars.index(st), v_ring.index(st), pred=ok)


@gluon.jit
def _paged_decode_kernel(q_ptr, kv_lens_ptr, table_ptr, first_ptr, out_ptr, scale, window_left, table_stride,
                         n_items, k_desc, v_desc, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr,
                         GP: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, MAX_ITEMS: gl.constexpr):
    LG: gl.constexpr = LANE_GROUPS
    LD: gl.constexpr = 32 // LANE_GROUPS  # lanes along the head dim
    KPL: gl.constexpr = BLOCK_N // (NUM_WARPS * LANE_GROUPS)  # keys of a tile a lane holds
    # [group heads, warps, lane groups, keys a lane, head dim]: the heads and a lane's keys in registers, the head
    # dim over LD lanes. Each (warp, lane group) keeps its own running softmax over its keys: a tile's scores
    # need LD-lane sums and nothing crosses a warp; the streams are merged once an item, at its end.
    l5: gl.constexpr = gl.BlockedLayout([GP, 1, 1, KPL, D // LD], [1, 1, LG, 1, LD], [1, NUM_WARPS, 1, 1, 1],
                                        [4, 3, 2, 1, 0])
    kv_l: gl.constexpr = gl.SliceLayout(0, l5)  # a K or V tile [warps, lane groups, keys a lane, D]
    s_l: gl.constexpr = gl.SliceLayout(4, l5)  # scores [heads, warps, lane groups, keys a lane]
    m_l: gl.constexpr = gl.SliceLayout(3, s_l)  # running max and sum [heads, warps, lane groups]
    acc_l: gl.constexpr = gl.SliceLayout(3, l5)  # accumulator [heads, warps, lane groups, D]
    am_l: gl.constexpr = gl.SliceLayout(3, acc_l)  # [heads, warps, lane groups], to scale the accumulator
    q_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l5)))  # a query [heads, D]
    o_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, acc_l))  # an output [heads, D]
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    dtype = q_ptr.dtype.element_ty

    # This CTA's items: a contiguous run of the flat (sequence, KV head) list, runs differing by one at most.
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    i0 = pid * n_items // grid
    count = (pid + 1) * n_items // grid - i0
    idx = gl.arange(0, MAX_ITEMS, layout=vec_l)
    own = idx < count
    b_v = (i0 + idx) // HKV
    kvl_v = gl.load(kv_lens_ptr + b_v, mask=own, other=0)
    fst_v = gl.load(first_ptr + b_v, mask=own, other=0)
    wl = gl.where(window_left >= 0, window_left, 1 << 30)  # no window: a distance no position reaches
    lo_v = gl.maximum(fst_v * PAGE, kvl_v - 1 - wl)
    lo_v = lo_v - lo_v % BLOCK_N
    total = gl.sum(gl.where(own, gl.maximum(gl.cdiv(kvl_v - lo_v, BLOCK_N), 1), 0), 0)

    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_shared)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_shared)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    # The producer's cursor (the next tile to copy) fills the ring; the consumer's trails it by STAGES tiles.
    zero = i0 * 0
    pj, pt = zero, zero
    pb, ph, pkvl, pfst, plo, pnt = _item(zero, idx, kvl_v, fst_v, i0, wl, HKV, PAGE, BLOCK_N)
    for i in gl.static_range(STAGES):
        key = plo + pt * BLOCK_N
        page = gl.load(table_ptr + pb * table_stride + (key // PAGE - pfst), mask=i < total, other=0)
        _issue(i, total, page, key, ph, k_desc, v_desc, k_ring, v_ring, bars, D, PAGE, BLOCK_N, STAGES)
        pj, pt, pb, ph, pkvl, pfst, plo, pnt = _next_tile(pj, pt, pb, ph, pkvl, pfst, plo, pnt, idx, kvl_v, fst_v,
                                                          i0, wl, HKV, PAGE, BLOCK_N)
    cj, ct = zero, zero
    cb, ch, ckvl, cfst, clo, cnt = _item(zero, idx, kvl_v, fst_v, i0, wl, HKV, PAGE, BLOCK_N)

    qr = gl.arange(0, GP, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    q_next = _load_q(q_ptr, zero, count, i0, qr, qd, HQ, HKV, G, D)
    q = q_next.to(gl.float32)
    qk_scale = scale.to(gl.float32) * 1.4426950408889634
    m_i = gl.full([GP, NUM_WARPS, LG], float("-inf"), gl.float32, m_l)
    l_i = gl.zeros([GP, NUM_WARPS, LG], gl.float32, m_l)
    acc = gl.zeros([GP, NUM_WARPS, LG, D], gl.float32, acc_l)
    n_s = _tile_keys(gl.SliceLayout(0, s_l), NUM_WARPS, LG, KPL)  # a tile's keys as scores see them
    n_v = _tile_keys(gl.SliceLayout(3, kv_l), NUM_WARPS, LG, KPL)  # and as V rows
    ro = gl.arange(0, GP, layout=gl.SliceLayout(1, o_l))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))

    for t in range(total):
        st = t % STAGES
        u = t + STAGES
        # The page of the tile this iteration will copy, asked for now: its latency runs under the tile's math.
        key = plo + pt * BLOCK_N
        page = gl.load(table_ptr + pb * table_stride + (key // PAGE - pfst), mask=u < total, other=0)
        if ct == 0:  # a new item: its query (loaded an item ahead), a fresh softmax
            q = q_next.to(gl.float32)
            q_next = _load_q(q_ptr, cj + 1, count, i0, qr, qd, HQ, HKV, G, D)
            m_i = gl.full([GP, NUM_WARPS, LG], float("-inf"), gl.float32, m_l)
            l_i = gl.zeros([GP, NUM_WARPS, LG], gl.float32, m_l)
            acc = gl.zeros([GP, NUM_WARPS, LG, D], gl.float32, acc_l)
        mbarrier.wait(bars.index(st), (t // STAGES) & 1)
        k = k_ring.index(st).reshape([NUM_WARPS, LG, KPL, D]).load(kv_l).to(gl.float32)
        s = gl.sum(q[:, None, None, None, :] * k[None, :, :, :, :], 4)
        kn = clo + ct * BLOCK_N + n_s
        seen = (kn < ckvl) & (kn >= ckvl - 1 - wl)
        s = gl.where(seen[None, :, :, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 3))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # streams that have seen nothing yet
        p = gl.exp2(s - m_safe[:, :, :, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 3)
        kv = clo + ct * BLOCK_N + n_v
        v = v_ring.index(st).reshape([NUM_WARPS, LG, KPL, D]).load(kv_l)
        # keys no row sees (a page's unwritten tail, left of the window): zeros, so NaN there never reaches acc
        v = gl.where(((kv < ckvl) & (kv >= ckvl - 1 - wl))[:, :, :, None], v.to(gl.float32), 0.0)
        pv = gl.sum(p[:, :, :, :, None] * v[None, :, :, :, :], 3)
        acc = acc * gl.convert_layout(alpha, am_l)[:, :, :, None] + pv
        m_i = m_new
        if ct == cnt - 1:  # the item's last tile: its streams merged, its output
            m_all = gl.max(gl.max(m_i, 2), 1)
            w = gl.exp2(m_i - gl.where(m_all == float("-inf"), 0.0, m_all)[:, None, None])
            l_all = gl.sum(gl.sum(l_i * w, 2), 1)
            o = gl.sum(gl.sum(acc * gl.convert_layout(w, am_l)[:, :, :, None], 2), 1)
            o = o / gl.convert_layout(gl.where(l_all > 0, l_all, 1.0), gl.SliceLayout(1, o_l))[:, None]
            o_row = cb.to(gl.int64) * HQ + ch * G + ro
            gl.store(out_ptr + o_row[:, None] * D + do[None, :], o.to(dtype), mask=(ro < G)[:, None])
        cj, ct, cb, ch, ckvl, cfst, clo, cnt = _next_tile(cj, ct, cb, ch, ckvl, cfst, clo, cnt, idx, kvl_v, fst_v,
                                                          i0, wl, HKV, PAGE, BLOCK_N)
        _sync()  # every warp is done with slot st
        _issue(u, total, page, key, ph, k_desc, v_desc, k_ring, v_ring, bars, D, PAGE, BLOCK_N, STAGES)
        pj, pt, pb, ph, pkvl, pfst, plo, pnt = _next_tile(pj, pt, pb, ph, pkvl, pfst, plo, pnt, idx, kvl_v, fst_v,
                                                          i0, wl, HKV, PAGE, BLOCK_N)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def descriptors(arena, k_offset: int, v_offset: int, page_size: int, num_kv_heads: int, head_dim: int):
    """Copy descriptors of one layer's K and V read in [1, BLOCK_N, head_dim] boxes (one tile), or None where the
    copy engine cannot take the arena (gluon_attention.arena_view)."""
    view = arena_view(arena, k_offset, v_offset, page_size, num_kv_heads * head_dim)
    if view is None:
        return None
    flat, shape, strides = view
    block, layout = [1, BLOCK_N, head_dim], kv_layout(head_dim, BLOCK_N)
    return (TensorDescriptor(flat[k_offset:], shape, strides, block, layout),
            TensorDescriptor(flat[v_offset:], shape, strides, block, layout))


def launch(batch: int, num_kv_heads: int, programs: int) -> tuple[int, int]:
    """The grid (CTAs) and MAX_ITEMS (the most items a CTA takes, a power of two) of a launch over `batch`
    sequences with at most `programs` CTAs."""
    n_items = batch * num_kv_heads
    grid = max(1, min(n_items, programs))
    return grid, triton.next_power_of_2(triton.cdiv(n_items, grid))


def launch_constexprs(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, ring: int,
                      max_items: int) -> dict:
    """The kernel's constexprs (decode_attention's, and bench.compile_report's offline compile)."""
    group = num_q_heads // num_kv_heads
    return dict(HQ=num_q_heads, HKV=num_kv_heads, G=group, GP=triton.next_power_of_2(group), D=head_dim,
                PAGE=int(page_size), BLOCK_N=BLOCK_N, STAGES=ring, MAX_ITEMS=max_items)


def decode_attention(q, kv_lens, page_table, first_page, page_size: int, num_kv_heads: int, window_left: int,
                     scale: float, out, descs, *, ring: int, programs: int):
    """Launch over `programs` CTAs at most (triton_attention.paged_attention picks them per SM); q is [B, Hq, D]."""
    B, HQ, D = q.shape
    grid, max_items = launch(B, num_kv_heads, programs)
    _paged_decode_kernel[(grid,)](q, kv_lens, page_table, first_page, out, float(scale), int(window_left),
                                  page_table.stride(0), B * num_kv_heads, *descs,
                                  **launch_constexprs(HQ, num_kv_heads, D, page_size, ring, max_items),
                                  num_warps=NUM_WARPS.value)
    return out
