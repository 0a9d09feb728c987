"""Test fixtures: for the plugin ops a random paged batch built from contiguous K/V; for the engines one mixed
prefill step run by the eager and the compiled engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def own_slots(self) -> torch.Tensor:
        """int32 [B]: each sequence's slot of its last key (a decode's own key, which the step writes)."""
        P = self.page_size
        pos = self.kv_lens.long() - 1
        frames = self.page_table.gather(1, (pos // P - self.first_page.long())[:, None])[:, 0]
        return (frames * P + pos % P).to(torch.int32)

    def decode_projection(self, owns: bool = True, k_eq_v: bool = False) -> tuple:
        """A decode step's inputs for the launch that norms and ropes itself (`paged_attention(norms=...)`), on the
        batch's device, in bf16: the packed q/k/v projection y [B, heads x D] (q alone where the layer does not
        `own` a cache, one K=V head where `k_eq_v`), the q and k norm weights (k's None without a cache) and the
        RoPE tables at each sequence's last position. q's weight is small: scores of a few units, so a q element an
        ulp off moves the output by far less than the tolerance (at Gemma's scale 1.0 and unit weights a score is
        ~16 and an ulp of q moves it ~0.01)."""
        B, hq, D = self.kv_lens.shape[0], self.q.shape[1], self.q.shape[2]
        dev = dict(device=self.q.device, dtype=torch.bfloat16)
        heads = hq + ((1 if k_eq_v else 2) * self.num_kv_heads if owns else 0)
        y = torch.randn(B, heads * D, **dev) * 3
        qw = 0.1 * (1 + 0.2 * torch.randn(D, **dev))
        kw = 1 + 0.2 * torch.randn(D, **dev) if owns else None
        angle = (self.kv_lens.long() - 1)[:, None].float() * torch.logspace(0, -4, D // 2, device=self.q.device)
        cos, sin = (torch.cat([f(angle)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        return y, qw, kw, cos, sin

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
        return self.arena.float().masked_fill(~self.visible(), float("nan")).to(self.arena.dtype)  # any KV dtype


def make_paged_batch(q_lens, kv_lens, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                     window_left: int = -1, resident_only: bool = False, dtype=torch.float32, device="cpu",
                     seed: int = 0, spare_frames: int = 3, scale: float = 1.0, frame_pad: int = 5,
                     kv_dtype=None) -> PagedBatch:
    """A random batch whose pages sit in shuffled frames of a fresh arena (each frame 4 pages' worth of
    elements plus `frame_pad`: the default 5 keeps the frame stride off every alignment), in `kv_dtype`
    (default `dtype`, the queries').

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
    kv_dtype = kv_dtype or dtype
    arena = torch.randn(n_frames, 4 * block + frame_pad, generator=g).to(kv_dtype)
    table = torch.zeros(len(kv_lens), max(max(n_pages), 1), dtype=torch.int32)
    seq_k, seq_v, used = [], [], 0
    k_off, v_off = 2 * block, 3 * block
    for b, (kl, f, n) in enumerate(zip(kv_lens, first, n_pages)):
        table[b, :n] = frames[used:used + n].to(torch.int32)
        used += n
        rows = n * P
        k = torch.randn(rows, H, D, generator=g).to(kv_dtype)
        v = torch.randn(rows, H, D, generator=g).to(kv_dtype)
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


def mixed_step(model):
    """A mixed prefill step of two sequences (37 and 11 tokens, 4-token pages) and its geometry."""
    from g4rt.models.layout import PageGeometry
    from g4rt.runtime.pages import FramePool
    from g4rt.runtime.sampling import SamplingParams
    from g4rt.runtime.scheduler import Scheduler, SchedulerConfig

    geometry = PageGeometry.build(model.layout, page_tokens=4)
    sched = Scheduler(geometry, FramePool(32), SchedulerConfig(max_num_batched_tokens=64, chunk=64))
    sched.add(list(range(3, 40)), SamplingParams(max_new_tokens=2), ())
    sched.add(list(range(50, 61)), SamplingParams(max_new_tokens=2), ())
    return geometry, sched.schedule().batch


def eager_and_compiled(model, scope):
    """(eager logits, eager arena, compiled logits, compiled engine) of one mixed prefill step."""
    from g4rt.runtime.arena import Arena
    from g4rt.runtime.engines.eager import EagerEngine
    from g4rt.runtime.engines.inductor import InductorEngine

    geometry, batch = mixed_step(model)
    eager_arena = Arena.for_geometry(geometry, 32)
    eager = EagerEngine(model, geometry, eager_arena).step(batch)
    compiled = InductorEngine(model, geometry, 32, compile_mode="default", compile_scope=scope)
    with torch.inference_mode():
        out = compiled.compiled(*batch.tensors())
    return eager, eager_arena, out, compiled
