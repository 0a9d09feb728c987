"""Torch reference of the plugin math: the oracle every kernel and cache backend is compared with.

`attend` is the single definition of Gemma 4's attention over one sequence's keys. The model's
linear cache and the paged reference op both call it, so paged and linear runs are byte-equal when
they hold the same keys. `rms_norm`, `gelu_tanh_mul`, `apply_rope` and the two fused blocks built from
them (`qkv_norm_rope`, `add_rms_norm`) are the decoder's elementwise math, written as HF writes it; the
model runs them on CPU and their Triton kernels stand in on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def window_left(window: int | None) -> int:
    """Gemma's window W counts the current token (a query at p sees p-W+1 .. p); kernels take the
    inclusive left distance W-1 (FlashInfer's `window_left`). -1 means no window."""
    return -1 if window is None else window - 1


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1). CUDA-graph decode pads batch size and table widths
    to these buckets, and the decode kernel picks its split count from them, so a padded replay and an
    eager step sum in the same order."""
    return 1 << max(0, n - 1).bit_length()


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm over the last dim: fp32 math, times the plain `weight` (not 1 + weight; None
    for v_norm and the router's norm), cast back to x's dtype."""
    x32 = x.float()
    # torch.pow(..., -0.5) rather than rsqrt, as HF does, so the fp32 results agree bit for bit.
    y = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of every Gemma 4 MLP, expert and PLE gate: gelu_tanh(gate) * up."""
    return F.gelu(gate, approximate="tanh") * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] in x's dtype; rotate_half pairs dims (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, k_eq_v: bool):
    """A packed q/k/v projection's output [T, (Hq + Hkv [+ Hkv]) * D] -> (q, k, v) [T, H, D]: q and k normed
    with their weights and roped, v normed without weight. k_eq_v: there is no v block; v is the raw k."""
    T, D = qkv.shape[0], cos.shape[-1]
    blocks = qkv.split([num_q_heads * D] + [num_kv_heads * D] * (1 if k_eq_v else 2), dim=-1)
    q, k = blocks[0].view(T, -1, D), blocks[1].view(T, -1, D)
    v = k if k_eq_v else blocks[2].view(T, -1, D)
    return (apply_rope(rms_norm(q, q_weight, eps), cos, sin), apply_rope(rms_norm(k, k_weight, eps), cos, sin),
            rms_norm(v, None, eps))


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's post-norm residual step followed by the next pre-norm: h = residual + norm(x) * x_weight,
    returned with norm(h) * out_weight."""
    h = residual + rms_norm(x, x_weight, eps)
    return h, rms_norm(h, out_weight, eps)


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
# Fixtures: a random paged batch built from contiguous K/V, for the tests and for checking kernels.
# ---------------------------------------------------------------------------------------------

@dataclass
class PagedBatch:
    """One layer's paged batch plus the contiguous K/V it was scattered from.

    The layer under test is the *second* cache-owning layer of its frames (k_offset > 0) and the
    frames carry a few elements of padding, so offsets and frame strides are exercised."""
    q: torch.Tensor
    arena: torch.Tensor
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    first_page: torch.Tensor
    k_offset: int
    v_offset: int
    page_size: int
    num_kv_heads: int
    window_left: int
    scale: float
    seq_k: list  # per sequence, [kv_len - first_page*P, Hkv, D]: positions first_page*P .. kv_len-1
    seq_v: list

    def args(self) -> tuple:
        """The op's arguments, in contract order."""
        return (self.q, self.arena, self.cu_q, self.kv_lens, self.page_table, self.first_page, self.k_offset,
                self.v_offset, self.page_size, self.num_kv_heads, self.window_left, self.scale)

    def visible(self) -> torch.Tensor:
        """Bool mask over the arena: the K/V elements some query of the batch may read. Everything
        else (other layers, padding, page tails past kv_len, keys left of every query's window,
        frames of no sequence) a kernel must never let into its result."""
        mask = torch.zeros_like(self.arena, dtype=torch.bool)
        width = self.num_kv_heads * self.q.shape[2]
        for b in range(len(self.kv_lens)):
            kv_len = int(self.kv_lens[b])
            q_len = int(self.cu_q[b + 1] - self.cu_q[b])
            lo = int(self.first_page[b]) * self.page_size
            if self.window_left >= 0:
                lo = max(lo, kv_len - q_len - self.window_left)
            for pos in range(lo, kv_len):
                frame = int(self.page_table[b, pos // self.page_size - int(self.first_page[b])])
                row = pos % self.page_size
                for off in (self.k_offset, self.v_offset):
                    mask[frame, off + row * width: off + (row + 1) * width] = True
        return mask

    def poisoned_arena(self) -> torch.Tensor:
        """The arena with NaN wherever `visible()` is False: NaN in a kernel's output then proves it
        read something outside its keys (a dot with NaN stays NaN even when the score is masked)."""
        return self.arena.masked_fill(~self.visible(), float("nan"))


def make_paged_batch(q_lens, kv_lens, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                     window_left: int = -1, resident_only: bool = False, dtype=torch.float32, device="cpu",
                     seed: int = 0, spare_frames: int = 3, scale: float = 1.0) -> PagedBatch:
    """A random batch whose pages sit in shuffled frames of a fresh arena.

    `resident_only` (sliding layers): a sequence's table starts at the first page that can hold a
    key some query still sees, and first_page says which logical page that is."""
    g = torch.Generator().manual_seed(seed)
    P, H, D = page_size, num_kv_heads, head_dim
    block = P * H * D
    first = []
    for ql, kl in zip(q_lens, kv_lens):
        lo = max(0, kl - ql - window_left) if (resident_only and window_left >= 0) else 0
        first.append(lo // P)
    n_pages = [-(-kl // P) - f for kl, f in zip(kv_lens, first)]
    n_frames = sum(n_pages) + spare_frames
    frames = torch.randperm(n_frames, generator=g)
    arena = torch.randn(n_frames, 4 * block + 5, generator=g).to(dtype)
    table = torch.zeros(len(kv_lens), max(max(n_pages), 1), dtype=torch.int32)
    seq_k, seq_v, used = [], [], 0
    k_off, v_off = 2 * block, 3 * block
    for b, (kl, f, n) in enumerate(zip(kv_lens, first, n_pages)):
        table[b, :n] = frames[used:used + n].to(torch.int32)
        used += n
        rows = n * P
        k = torch.randn(rows, H, D, generator=g).to(dtype)
        v = torch.randn(rows, H, D, generator=g).to(dtype)
        for j in range(n):
            arena[int(table[b, j]), k_off:k_off + block] = k[j * P:(j + 1) * P].reshape(-1)
            arena[int(table[b, j]), v_off:v_off + block] = v[j * P:(j + 1) * P].reshape(-1)
        seq_k.append(k[:kl - f * P])
        seq_v.append(v[:kl - f * P])
    cu = torch.tensor([0] + list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, D, generator=g).to(dtype)
    dev = torch.device(device)
    return PagedBatch(q.to(dev), arena.to(dev), cu.to(dev), torch.tensor(kv_lens, dtype=torch.int32, device=dev),
                      table.to(dev), torch.tensor(first, dtype=torch.int32, device=dev), k_off, v_off, P,
                      num_kv_heads, window_left, scale, [k.to(dev) for k in seq_k], [v.to(dev) for v in seq_v])
