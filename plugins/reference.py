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
        arena[frame[:, None], idx] = src[keep].reshape(-1, width).to(arena.dtype)


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
