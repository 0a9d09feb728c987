"""Torch reference of the plugin ops: the oracle every kernel and cache backend is compared with.

`attend` is the single definition of Gemma 4's attention over one sequence's keys. The model's
linear cache and the paged reference op both call it, so paged and linear runs are byte-equal when
they hold the same keys. The model's own elementwise math (norms, RoPE, the gated GELU) lives with the
model, in models/blocks.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def window_left(window: int | None) -> int:
    """Gemma's window W counts the current token (a query at p sees p-W+1 .. p); kernels take the
    inclusive left distance W-1 (FlashInfer's `window_left`). -1 means no window."""
    return -1 if window is None else window - 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window_left: int, scale: float = 1.0, probs_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], positions int [Tq] / [Tk] -> [Tq, Hq, D] in q's dtype.

    Causal (k_pos <= q_pos) and, when window_left >= 0, k_pos >= q_pos - window_left. Scores,
    softmax and the weighted sum are fp32 (`probs_dtype` rounds the probabilities first, as the
    Triton kernel does; only diagnostics use it). A query that sees no key returns zeros.
    """
    if window_left >= 0 and k_pos.numel():
        # Drop keys no query can see before the matmul. CPU matmuls round differently for different
        # key counts, so trimming here makes a paged cache (resident pages only) and a linear cache
        # (every position) feed identical operands and agree to the bit.
        keep = k_pos >= q_pos.min() - window_left
        k, v, k_pos = k[keep], v[keep], k_pos[keep]
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Tk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        allowed = allowed & (k_pos[None, :] >= q_pos[:, None] - window_left)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: all -inf -> nan -> 0
    if probs_dtype is not None:  # mimic a flash kernel, which feeds P to the P.V product in bf16
        probs = probs.to(probs_dtype).float()
    out = torch.matmul(probs, vf)  # [Hq, Tq, D]
    return out.transpose(0, 1).to(q.dtype)


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as a cache of `dtype` stores them: the nearest value (ties to even), and for a 1-byte float
    the format's largest finite value where `x` lies beyond it (the GPU's `satfinite` conversion; e4m3 has no
    infinity). Every cache (the paged arena's kernels and references, the linear cache) stores through this."""
    if dtype.itemsize == 1:
        top = torch.finfo(dtype).max
        x = x.float().clamp(-top, top)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# Paged reference ops: the oracle for the Triton kernels and the CPU implementation of the ops.
# They read the arena exactly as plugins/README.md describes; speed does not matter here.
# ---------------------------------------------------------------------------------------------

def _block(arena: torch.Tensor, frames: torch.Tensor, offset: int, page_size: int, num_kv_heads: int,
           head_dim: int) -> torch.Tensor:
    """The K (or V) block at element `offset` of each frame in `frames`, as [len(frames)*P, Hkv, D]."""
    n = page_size * num_kv_heads * head_dim
    rows = arena[frames.long(), offset:offset + n]
    return rows.reshape(-1, num_kv_heads, head_dim)


def gather_kv(arena: torch.Tensor, page_row: torch.Tensor, first_page: int, kv_len: int, k_offset: int,
              v_offset: int, page_size: int, num_kv_heads: int, head_dim: int):
    """One sequence's keys and values as contiguous tensors.

    Returns (k, v, k_pos): k/v [n, Hkv, D] for positions first_page*P .. kv_len-1, read through the
    sequence's page-table row (entry j holds logical page first_page + j)."""
    lo = first_page * page_size
    n = max(kv_len - lo, 0)
    npages = -(-n // page_size)
    frames = page_row[:npages]
    k = _block(arena, frames, k_offset, page_size, num_kv_heads, head_dim)[:n]
    v = _block(arena, frames, v_offset, page_size, num_kv_heads, head_dim)[:n]
    k_pos = torch.arange(lo, lo + n, device=arena.device)
    return k, v, k_pos


def paged_attention_ref(q: torch.Tensor, arena: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor,
                        page_table: torch.Tensor, first_page: torch.Tensor, k_offset: int, v_offset: int,
                        page_size: int, num_kv_heads: int, window_left: int, scale: float) -> torch.Tensor:
    """`paged_attention` of plugins/README.md, one sequence at a time through `attend`.

    Each sequence's resident pages are gathered into contiguous K/V and handed to `attend` with
    their absolute positions, so a paged run and the linear cache give identical results when they
    hold the same keys. Host-side loops and `.tolist()`: an oracle, not a kernel."""
    head_dim = q.shape[2]
    out = torch.zeros_like(q)
    cu = cu_q.tolist()
    lens = kv_lens.tolist()
    firsts = first_page.tolist()
    for b in range(len(lens)):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        k, v, k_pos = gather_kv(arena, page_table[b], firsts[b], lens[b], k_offset, v_offset, page_size,
                                num_kv_heads, head_dim)
        q_pos = torch.arange(lens[b] - (q1 - q0), lens[b], device=q.device)
        out[q0:q1] = attend(q[q0:q1], k, v, q_pos, k_pos, window_left, scale)
    return out


def kv_write_ref_(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_offset: int,
                  v_offset: int, page_size: int) -> None:
    """Scatter rows k[t], v[t] ([T, Hkv, D]) into slot `slots[t]` of the arena, in place; -1 skips."""
    keep = slots >= 0
    s = slots[keep].long()
    frame, row = s // page_size, s % page_size
    width = k.shape[1] * k.shape[2]  # one position of one layer: Hkv * D elements
    cols = torch.arange(width, device=arena.device)
    for offset, src in ((k_offset, k), (v_offset, v)):
        idx = offset + row[:, None] * width + cols[None, :]
        arena[frame[:, None], idx] = to_kv(src[keep].reshape(-1, width), arena.dtype)


def kv_write_ref(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_offset: int,
                 v_offset: int, page_size: int) -> torch.Tensor:
    """Functional `kv_write`: a new arena with the rows written; the input arena is untouched."""
    new = arena.clone()
    kv_write_ref_(new, k, v, slots, k_offset, v_offset, page_size)
    return new


# ---------------------------------------------------------------------------------------------
# Mixture of experts: the oracle for triton_moe.py and the CPU implementation of `g4rt::moe`.
# ---------------------------------------------------------------------------------------------

def moe_shapes(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(T, H, I, E, k) of a `moe` call, or a ValueError naming the argument whose shape does not fit."""
    if x.dim() != 2 or gate_up.dim() != 3:
        raise ValueError(f"moe: x must be [T, H] and gate_up [E, 2I, H]; got x {tuple(x.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}")
    (T, H), (E, two_i, _) = x.shape, gate_up.shape
    I = two_i // 2
    k = idx.shape[-1] if idx.dim() == 2 else 0
    for name, t, want in (("gate_up", gate_up, (E, 2 * I, H)), ("down", down, (E, H, I)), ("idx", idx, (T, k)),
                          ("w", w, (T, k))):
        if tuple(t.shape) != want:
            raise ValueError(f"moe: {name} has shape {tuple(t.shape)}, expected {want} "
                             f"(x [T, H], idx and w [T, k], gate_up [E, 2I, H], down [E, H, I])")
    if not 1 <= k <= E:
        raise ValueError(f"moe: idx chooses k = {k} experts per token, need 1 <= k <= E = {E}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe: idx must be int32 or int64, got {idx.dtype}")
    return T, H, I, E, k


def moe_ref(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """`moe` of plugins/README.md exactly as HF's eager experts compute it (Gemma4TextExperts with
    experts_implementation="eager"): for each expert some token chose, in ascending id order, its tokens'
    gelu_tanh(gate) * up MLP (each step in the model dtype), times their top-k weight, cast to the model
    dtype and `index_add_`ed into a model-dtype accumulator. The gated GELU is models/blocks.py's
    `gelu_tanh_mul` formula (plugins cannot import models). Data-dependent host loop: an oracle."""
    moe_shapes(x, idx, w, gate_up, down)
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        token, slot = torch.where(idx == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, down[e]) * w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# ---------------------------------------------------------------------------------------------
# Sampling: the oracle for triton_sampling.py and the CPU implementation of `g4rt::sample`.
# ---------------------------------------------------------------------------------------------

SAMPLE_KEY_SCALE = 1 << 16  # a row's cut keys: how far below the row's top score, in units of 2^-16
SAMPLE_KEY_MAX = (1 << 24) - 1  # ... saturating here (256 score units below the top: one tied bottom key)
SAMPLE_MASS_SCALE = 1 << 18  # top-p counts probability in integers: exp(score - top) in units of 2^-18
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for 32-bit unsigned a (int64 tensor) and b, without leaving int64."""
    lo_prod = a * (b & 0xFFFF)
    mid = a * (b >> 16) + (lo_prod >> 16)  # < 2^49
    return mid >> 16, ((mid & 0xFFFF) << 16 | (lo_prod & 0xFFFF)) & _M32


def philox_ref(seeds: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton's `tl.randint4x(seed, c1 * 2^32 + c0)`: Philox-4x32 with 10 rounds, key = the 64-bit seed,
    counter (c0, c1, 0, 0). seeds int64 [R]; c0, c1 int64 broadcastable to [R, N] holding 32-bit values.
    Returns the four 32-bit outputs as int64 tensors in [0, 2^32)."""
    k0, k1 = (seeds & _M32)[:, None], ((seeds >> 32) & _M32)[:, None]
    x0, x1 = torch.broadcast_tensors(c0 & _M32, c1 & _M32)
    x2 = x3 = torch.zeros_like(x0)
    for _ in range(10):
        hi_b, lo_b = _mul32(x2, _PHILOX_ROUND[1])
        hi_a, lo_a = _mul32(x0, _PHILOX_ROUND[0])
        x0, x1, x2, x3 = hi_b ^ x1 ^ k0, lo_b, hi_a ^ x3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _M32, (k1 + _PHILOX_KEY[1]) & _M32
    return x0, x1, x2, x3


def sample_noise_ref(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise G(seed, counter, id) for ids 0..vocab-1, float32 [R, vocab]: Philox with key `seed`
    and counter (id // 4, counter), output id % 4, made uniform as `tl.rand` does, then -log(-log u).
    A pure function of (seed, counter, id): the same whatever else is sampled."""
    n = torch.arange((vocab + 3) // 4, device=seeds.device)
    words = torch.stack(philox_ref(seeds, n[None, :], counters[:, None]), dim=-1).flatten(1)[:, :vocab]
    signed = torch.where(words >= 1 << 31, words - (1 << 32), words)
    u = torch.where(signed < 0, ~signed, signed).float() * torch.tensor(4.6566127342e-10, dtype=torch.float32)
    return -torch.log(-torch.log(u))


def sample_keys_ref(scores: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cut key, integer mass) of every entry of `scores` [R, V] float32 whose row maxima are `top` [R]:
    key = floor((top - s) * 2^16) saturated at SAMPLE_KEY_MAX (smaller is likelier), mass =
    floor(exp(s - top) * 2^18)."""
    d = top[:, None] - scores
    keys = (d * SAMPLE_KEY_SCALE).clamp(max=SAMPLE_KEY_MAX).to(torch.int32)
    mass = (torch.exp(-d) * SAMPLE_MASS_SCALE).to(torch.int64)
    return keys, mass


def sample_ref(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`sample` of plugins/README.md: one token id per row of `logits` [R, V], int64 [R].

    rows: int64 [5, R], per row temperature and top_p (float64 bits), top_k, seed, draw counter.
    Temperature 0: the first argmax of the logits. Otherwise s = logits * fp32(1 / T) (the reciprocal in
    float64) and the token is the first argmax over the kept set of s + G(seed, counter, id); kept are
    the entries whose cut key is <= the k-th smallest key (top_k in 1..V-1; ties kept), and of those,
    with top_p < 1, the ones whose likelier entries (strictly smaller key) weigh less than top_p of the
    kept mass. Sorts the keys: an oracle, not a kernel."""
    R, V = logits.shape
    temp, top_p = rows[0].view(torch.float64), rows[1].view(torch.float64)
    top_k, seeds, counters = rows[2], rows[3], rows[4]
    greedy = logits.argmax(dim=-1)
    sampled = temp > 0
    if not bool(sampled.any()):
        return greedy
    inv = (1.0 / torch.where(sampled, temp, 1.0)).float()
    scores = logits.float() * inv[:, None]
    keys, mass = sample_keys_ref(scores, scores.max(dim=-1).values)
    sorted_keys, order = keys.sort(dim=-1)
    cut_k = torch.where((top_k > 0) & (top_k < V), sorted_keys.gather(1, (top_k.clamp(1, V) - 1)[:, None])[:, 0],
                        SAMPLE_KEY_MAX)
    kept = keys <= cut_k[:, None]
    below = torch.cumsum(mass.gather(1, order), dim=-1)  # mass of the j+1 likeliest entries
    likelier = torch.searchsorted(sorted_keys, keys, side="left")  # entries with a strictly smaller key
    above = torch.where(likelier > 0, below.gather(1, (likelier - 1).clamp(min=0)), 0)
    kept_mass = (mass * kept).sum(dim=-1)
    nucleus = above.double() < top_p[:, None] * kept_mass.double()[:, None]
    kept &= nucleus | (top_p >= 1.0)[:, None]
    race = (scores + sample_noise_ref(seeds, counters, V)).masked_fill(~kept, float("-inf"))
    return torch.where(sampled, race.argmax(dim=-1), greedy)
