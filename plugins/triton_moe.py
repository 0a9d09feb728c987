"""Triton mixture-of-experts (plugins/README.md `moe`): the chosen experts' gated-GELU MLPs, weighted
and summed per token, reading each chosen expert's weights once per step and no other expert's.

Four stages, every launch sized from shapes alone (no host sync, so they run inside CUDA graphs):

1. **align**: counts the (token, slot) assignments of each expert, pads every count up to a multiple
   of BLOCK_M, and lists the assignments grouped by expert in ascending id order (`sorted_ids`, in
   assignment order inside a group), each group starting on a block boundary. `ends[e]` (padded,
   cumulative) and `counts[e]` tell a row block its expert and which of its rows are real. An expert
   no token chose gets no block, so nothing ever reads its weights. Up to ALIGN_CHUNK assignments
   (decode) one program does it all; more (prefill, batch 64) take three launches: per-chunk counts
   (grid chunks), one program turning them into each chunk's first row per expert, and the scatter
   (grid chunks). A single program over 16k assignments took 1 ms per layer on the H200.
2. **gate_up**: grid (row blocks, I tiles). A block's rows are its expert's tokens; it multiplies
   them by that expert's gate and up rows, then forms gelu_tanh(gate) * up into `act`.
3. **down**: grid (row blocks, H tiles): act @ down[e].T, times the assignment's top-k weight.
   Each assignment's row goes to `y[token, rank]`, rank = how many of the token's experts have a
   smaller id, so a token's rows lie in ascending expert order.
4. **sum**: grid (tokens, H tiles): out[t] = y[t, 0] + y[t, 1] + ..., left to right.

Programs of the two GEMMs whose row block lies past the last expert's end return at once: the grid
is the bound `min(N, E) + (N - min(N, E)) // BLOCK_M` on the blocks N assignments can need.

Numerics are the reference's (`plugins.reference.moe_ref`, HF's eager experts) with the GEMM sums
in fp32 in another order: gate, up, gelu, their product, the down projection and its product with
the weight are each rounded to the model dtype where eager torch rounds them, and the per-token sum
runs in ascending expert order with a rounding to the model dtype after every add. fp32 inputs use
IEEE fp32 dots (no TF32). Under TRITON_INTERPRET=1 bf16 dots are wrong, so UPCAST loads tiles as fp32.

Tiles per regime (`default_config`), chosen from the bucketed assignment count per expert so that a
CUDA-graph replay padded to a power-of-two batch picks the same tiles (and so the same sum order) as
the eager step: **decode** (a few tokens per expert) takes 16-row blocks and narrow weight tiles, so
that even batch 1 (8 experts) spreads its weight reads over a few hundred programs; **prefill**
(dozens of tokens or more per expert) takes 64-row blocks and wide tiles, where the GEMMs are
compute bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .buckets import pow2_bucket
from .reference import moe_shapes
from .launch import interpreting
from .triton_norm import gelu_tanh_rounded

ALIGN_CHUNK = 128  # assignments one align program sorts at once


@triton.jit
def _chunk_experts(idx_ptr, start, N, C: tl.constexpr):
    """Assignments start .. start + C - 1: their ids, which of them exist, their experts (0 where none)."""
    i = start + tl.arange(0, C)
    ok = i < N
    return i, ok, tl.load(idx_ptr + i, mask=ok, other=0).to(tl.int32)


@triton.jit
def _chunk_counts(e, ok, NB: tl.constexpr):
    """Assignments per expert in one chunk (lanes past N, loaded as expert 0, taken back off)."""
    missing = tl.sum((ok == 0).to(tl.int32), axis=0)
    return tl.histogram(e, NB) - tl.where(tl.arange(0, NB) == 0, missing, 0)


@triton.jit
def _group_starts(counts, counts_ptr, ends_ptr, E: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store the counts and the padded cumulative ends; return each expert's first row."""
    bins = tl.arange(0, NB)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(counts_ptr + bins, counts, mask=bins < E)
    tl.store(ends_ptr + bins, ends, mask=bins < E)
    return ends - padded


@triton.jit
def _scatter_chunk(sorted_ptr, i, ok, e, first, NB: tl.constexpr, C: tl.constexpr):
    """Write each assignment of a chunk to its row: first[e] (the chunk's first row of its expert, a
    [NB] vector) plus how many earlier assignments of the chunk chose the same expert."""
    r = tl.arange(0, C)
    at = tl.sum(tl.where(e[:, None] == tl.arange(0, NB)[None, :], first[None, :], 0), axis=1)
    earlier = (e[None, :] == e[:, None]) & (r[None, :] < r[:, None])
    tl.store(sorted_ptr + at + tl.sum(earlier.to(tl.int32), axis=1), i, mask=ok)


@triton.jit
def _moe_align_kernel(idx_ptr, counts_ptr, ends_ptr, sorted_ptr, N, E: tl.constexpr, NB: tl.constexpr,
                      BLOCK_M: tl.constexpr, C: tl.constexpr):
    # All N <= C assignments in one program: count, place the groups, scatter.
    i, ok, e = _chunk_experts(idx_ptr, 0, N, C)
    first = _group_starts(_chunk_counts(e, ok, NB), counts_ptr, ends_ptr, E, NB, BLOCK_M)
    _scatter_chunk(sorted_ptr, i, ok, e, first, NB, C)


@triton.jit
def _moe_count_kernel(idx_ptr, chunk_ptr, N, NB: tl.constexpr, C: tl.constexpr):
    c = tl.program_id(0)
    i, ok, e = _chunk_experts(idx_ptr, c * C, N, C)
    tl.store(chunk_ptr + c * NB + tl.arange(0, NB), _chunk_counts(e, ok, NB))


@triton.jit
def _moe_prefix_kernel(chunk_ptr, counts_ptr, ends_ptr, n_chunks, E: tl.constexpr, NB: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    # One program: the counts over all chunks, then each chunk's row of counts becomes its first row
    # per expert (the expert's start plus the assignments of earlier chunks).
    bins = tl.arange(0, NB)
    total = tl.zeros([NB], dtype=tl.int32)
    for c in range(n_chunks):
        total += tl.load(chunk_ptr + c * NB + bins)
    first = _group_starts(total, counts_ptr, ends_ptr, E, NB, BLOCK_M)
    for c in range(n_chunks):
        row = tl.load(chunk_ptr + c * NB + bins)
        tl.store(chunk_ptr + c * NB + bins, first)
        first += row


@triton.jit
def _moe_scatter_kernel(idx_ptr, chunk_ptr, sorted_ptr, N, NB: tl.constexpr, C: tl.constexpr):
    c = tl.program_id(0)
    i, ok, e = _chunk_experts(idx_ptr, c * C, N, C)
    _scatter_chunk(sorted_ptr, i, ok, e, tl.load(chunk_ptr + c * NB + tl.arange(0, NB)), NB, C)


@triton.jit
def _block_rows(counts_ptr, ends_ptr, sorted_ptr, E: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The expert of this program's row block (E: past the last expert), its rows, which of them are
    real, and their assignment ids (0 where not real)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    es = tl.arange(0, EP)
    ends = tl.load(ends_ptr + es, mask=es < E, other=2147483647)
    e = tl.sum((ends <= tl.program_id(0) * BLOCK_M).to(tl.int32), axis=0)
    safe = tl.minimum(e, E - 1)
    count = tl.load(counts_ptr + safe)
    start = tl.load(ends_ptr + safe) - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    real = rows - start < count  # all False past the last expert: those rows lie beyond its end
    ids = tl.load(sorted_ptr + rows, mask=real, other=0)
    return e, rows, real, ids


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, counts_ptr, ends_ptr, sorted_ptr, act_ptr, H, I,
                        TOPK: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    e, rows, real, ids = _block_rows(counts_ptr, ends_ptr, sorted_ptr, E, EP, BLOCK_M)
    if e >= E:
        return
    tok = (ids // TOPK).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w_e = w_ptr + e.to(tl.int64) * 2 * I * H
    gate_rows = w_e + n.to(tl.int64)[:, None] * H
    up_rows = gate_rows + I * H
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(x_ptr + tok[:, None] * H + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        wm = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + k[None, :], mask=wm, other=0.0)
        wu = tl.load(up_rows + k[None, :], mask=wm, other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PREC)
        acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PREC)
    dtype = act_ptr.dtype.element_ty
    # Eager rounds the projection to the model dtype before the activation reads it.
    act = gelu_tanh_rounded(acc_g.to(dtype).to(tl.float32), acc_u.to(dtype).to(tl.float32), act_ptr)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * I + n[None, :], act, mask=real[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, counts_ptr, ends_ptr, sorted_ptr, idx_ptr, topw_ptr, y_ptr, H, I,
                     TOPK: tl.constexpr, KP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    e, rows, real, ids = _block_rows(counts_ptr, ends_ptr, sorted_ptr, E, EP, BLOCK_M)
    if e >= E:
        return
    tok = ids // TOPK
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_rows = w_ptr + e.to(tl.int64) * H * I + n.to(tl.int64)[:, None] * I
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * I
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(a_rows + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(topw_ptr + ids, mask=real, other=0.0).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    s = tl.arange(0, KP)
    chosen = tl.load(idx_ptr + tok[:, None] * TOPK + s[None, :], mask=real[:, None] & (s < TOPK)[None, :], other=E)
    rank = tl.sum((chosen.to(tl.int32) < e).to(tl.int32), axis=1)
    y_rows = (tok * TOPK + rank).to(tl.int64)
    tl.store(y_ptr + y_rows[:, None] * H + n[None, :], y, mask=real[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    dtype = out_ptr.dtype.element_ty
    rows = y_ptr + t * TOPK * H + c
    acc = tl.load(rows, mask=ok, other=0.0).to(tl.float32)
    for j in range(1, TOPK):
        acc = (acc + tl.load(rows + j * H, mask=ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * H + c, acc.to(dtype), mask=ok)


@triton.jit
def _moe_route_kernel(logits_ptr, scale_ptr, w_ptr, idx_ptr, T, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                      KP: tl.constexpr, ROWS: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t_ok = t < T
    e = tl.arange(0, EP)
    logits = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=t_ok[:, None] & (e < E)[None, :],
                     other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    s = tl.arange(0, KP)
    w = tl.zeros([ROWS, KP], dtype=tl.float32)
    chosen = tl.zeros([ROWS, KP], dtype=tl.int32)
    for j in tl.static_range(K):  # the K largest, in descending order (the lowest id among equals first)
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], e[None, :], EP), axis=1)
        w = tl.where(s[None, :] == j, best[:, None], w)
        chosen = tl.where(s[None, :] == j, pick[:, None], chosen)
        p = tl.where(e[None, :] == pick[:, None], -1.0, p)
    ok = t_ok[:, None] & (s < K)[None, :]
    w = w / tl.sum(w, axis=1)[:, None] * tl.load(scale_ptr + chosen, mask=ok, other=0.0).to(tl.float32)
    out = t.to(tl.int64)[:, None] * K + s[None, :]
    tl.store(w_ptr + out, w, mask=ok)
    tl.store(idx_ptr + out, chosen.to(tl.int64), mask=ok)


def route(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's routing (models.blocks.route: fp32 softmax over all experts, top-k, renormalise, times
    per_expert_scale) in one launch, where ATen takes about eight; (w fp32 [T, k], idx int64 [T, k])."""
    T, E = logits.shape
    logits = logits.contiguous()
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        rows = 4
        _moe_route_kernel[(triton.cdiv(T, rows),)](logits, per_expert_scale, w, idx, T, E=E, EP=triton.next_power_of_2(E),
                                                   K=top_k, KP=triton.next_power_of_2(top_k), ROWS=rows, num_warps=4)
    return w, idx


DECODE = dict(block_m=16, gate_up_n=64, gate_up_k=128, down_n=64, down_k=64, num_warps=4, num_stages=4)
PREFILL = dict(block_m=64, gate_up_n=64, gate_up_k=64, down_n=128, down_k=64, num_warps=4, num_stages=3)
# Assignments per expert (bucketed) from which the prefill tiles win: 64-row blocks stop being mostly padding.
PREFILL_FROM = 32


def default_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """The tiles for a step of `num_tokens` tokens, from its power-of-two bucket (see module docstring)."""
    per_expert = pow2_bucket(num_tokens) * top_k / num_experts
    return dict(PREFILL if per_expert >= PREFILL_FROM else DECODE)


def max_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """The most row blocks `assignments` (token, slot) pairs can need: each of the m <= min(N, E) experts
    chosen takes cdiv(n_e, BLOCK_M) blocks, at most m + (N - m) // BLOCK_M in all, largest at m = min(N, E)."""
    m = min(assignments, num_experts)
    return m + (assignments - m) // block_m


def align(idx: torch.Tensor, num_experts: int, block_m: int, poison: bool = False):
    """(counts [E], ends [E], sorted_ids [max_blocks * block_m]) of the align stage (module docstring) for
    the expert ids `idx` [T, k]. Rows of sorted_ids past their group's count are left unwritten
    (`poison`: filled with -1 first, for tests)."""
    n_assign, E, dev = idx.numel(), num_experts, idx.device
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max_blocks(n_assign, E, block_m) * block_m, dtype=torch.int32, device=dev)
    if poison:
        sorted_ids.fill_(-1)
    nb, chunks = triton.next_power_of_2(E), triton.cdiv(n_assign, ALIGN_CHUNK)
    if chunks == 1:
        _moe_align_kernel[(1,)](idx, counts, ends, sorted_ids, n_assign, E=E, NB=nb, BLOCK_M=block_m,
                                C=triton.next_power_of_2(n_assign), num_warps=4)
    else:
        per_chunk = torch.empty(chunks, nb, dtype=torch.int32, device=dev)
        _moe_count_kernel[(chunks,)](idx, per_chunk, n_assign, NB=nb, C=ALIGN_CHUNK, num_warps=4)
        _moe_prefix_kernel[(1,)](per_chunk, counts, ends, chunks, E=E, NB=nb, BLOCK_M=block_m, num_warps=4)
        _moe_scatter_kernel[(chunks,)](idx, per_chunk, sorted_ids, n_assign, NB=nb, C=ALIGN_CHUNK, num_warps=4)
    return counts, ends, sorted_ids


def moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *,
        out: torch.Tensor | None = None, config: dict | None = None, poison_scratch: bool = False) -> torch.Tensor:
    """Run the four stages; same arguments as the op. Every launch parameter comes from shapes.

    Keyword extras for tests and the bench: `out` (pre-allocated output, e.g. NaN-poisoned), `config`
    (tile overrides, see default_config), `poison_scratch` (fill the intermediates with NaN, so a read of
    a row no kernel wrote shows in the output)."""
    T, H, I, E, K = moe_shapes(x, idx, w, gate_up, down)
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("moe: gate_up and down must be contiguous (a copy would read every expert)")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"moe: x, gate_up and down must share the model dtype; got {x.dtype}, {gate_up.dtype}, "
                         f"{down.dtype}")
    x, idx, w = x.contiguous(), idx.contiguous(), w.contiguous()
    if out is None:
        out = torch.empty_like(x)
    if T == 0:
        return out
    cfg = {**default_config(T, K, E), **(config or {})}
    bm = cfg["block_m"]
    counts, ends, sorted_ids = align(idx, E, bm, poison_scratch)
    blocks = sorted_ids.shape[0] // bm
    act = x.new_empty(blocks * bm, I)
    y = x.new_empty(T, K, H)
    if poison_scratch:
        for t in (act, y):
            t.fill_(float("nan"))
    upcast = interpreting()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    ep = triton.next_power_of_2(E)
    common = dict(E=E, EP=ep, BLOCK_M=bm, UPCAST=upcast, PREC=prec, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    _moe_gate_up_kernel[(blocks, triton.cdiv(I, cfg["gate_up_n"]))](
        x, gate_up, counts, ends, sorted_ids, act, H, I, TOPK=K, BLOCK_N=cfg["gate_up_n"],
        BLOCK_K=cfg["gate_up_k"], **common)
    _moe_down_kernel[(blocks, triton.cdiv(H, cfg["down_n"]))](
        act, down, counts, ends, sorted_ids, idx, w, y, H, I, TOPK=K, KP=triton.next_power_of_2(K),
        BLOCK_N=cfg["down_n"], BLOCK_K=cfg["down_k"], **common)
    block = min(1024, triton.next_power_of_2(H))
    _moe_sum_kernel[(T, triton.cdiv(H, block))](y, out, H, TOPK=K, BLOCK=block, num_warps=4)
    return out


@torch.library.custom_op("g4rt::route", mutates_args=())
def _route_op(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` as an opaque op, so the eager and the compiled engine run the same kernel (models/blocks.py)."""
    return route(logits, per_expert_scale, top_k)


@_route_op.register_fake
def _(logits, per_expert_scale, top_k):
    T = logits.shape[0]
    return logits.new_empty(T, top_k, dtype=torch.float32), logits.new_empty(T, top_k, dtype=torch.int64)
