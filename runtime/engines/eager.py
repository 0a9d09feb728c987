"""The two engines that run a model in memory: `EagerEngine` over the paged arena, and `LinearEngine`
over the contiguous reference cache.

Byte equality, and why it needs *the same step batches*: CPU (and GPU) matmuls are not
batch-invariant -- the same row can round differently inside a batch of 3 tokens than inside a batch
of 7. So a paged run and a linear run only produce identical bits when both see the same token
batches in the same order. Running both engines behind the one scheduler guarantees that; what is
then left to differ is exactly the cache (pages vs contiguous rows), which is what the test checks.
"""
from __future__ import annotations

from typing import Sequence

import torch

from g4rt.models.layout import PageGeometry, torch_dtype
from g4rt.models.linear_cache import LinearCache
from g4rt.models.paged import PagedStep, padded_forward
from g4rt.models.step import StepBatch

from ..arena import Arena
from . import Feed


class EagerEngine:
    """The model in torch eager mode over the paged arena (torch.ops.g4rt kv_write_/paged_attention)."""

    def __init__(self, model, geometry: PageGeometry, arena: Arena):
        if arena.frame_elems != geometry.frame_elems:
            raise ValueError(f"arena frames hold {arena.frame_elems} elements, geometry needs {geometry.frame_elems}")
        self.model, self.geometry, self.arena = model, geometry, arena
        self.config = model.config
        self.paged = PagedStep(model, geometry, pad_tokens=True)  # the rows the inductor engine's graphs run
        self.device = arena.device

    takes_feed = True

    @torch.inference_mode()
    def step(self, batch: StepBatch, seq_ids: Sequence[int] = (), feed: Feed | None = None) -> torch.Tensor:
        batch = batch.to(self.device)
        if feed is not None:
            feed.apply(batch.token_ids)
        return self.paged(self.arena.tensor, *batch.tensors())

    def release(self, seq_id: int) -> None:
        """Nothing to do: the runtime owns the pages."""


class LinearEngine:
    """The contiguous reference cache behind the same step interface (tests and `--reference`).

    It keeps one linear cache per request id and runs the same varlen batches as the paged engine,
    so its logits are the bitwise reference for the paged path.
    """

    def __init__(self, model, geometry: PageGeometry):
        self.model, self.geometry, self.config = model, geometry, model.config
        self.cache = LinearCache(torch_dtype(geometry.layout.dtype, kv=True))  # rows stored as the arena's
        self.device = next(model.parameters()).device

    takes_feed = True

    @torch.inference_mode()
    def step(self, batch: StepBatch, seq_ids: Sequence[int] = (), feed: Feed | None = None) -> torch.Tensor:
        if len(seq_ids) != batch.num_seqs:
            raise ValueError(f"LinearEngine needs one seq id per sequence: got {len(seq_ids)} for {batch.num_seqs}")
        q_lens = (batch.cu_q[1:] - batch.cu_q[:-1]).tolist()
        self.cache.begin_step(list(seq_ids), q_lens)
        for sid, n, kv_len in zip(seq_ids, q_lens, batch.kv_lens.tolist()):
            if self.cache.seq_len(sid) != kv_len - n:
                raise ValueError(f"sequence {sid}: the linear cache holds {self.cache.seq_len(sid)} positions, "
                                 f"the batch continues at {kv_len - n}")
        b = batch.to(self.device)
        if feed is not None:
            feed.apply(b.token_ids)
        hidden = padded_forward(self.model, b.token_ids, b.positions, self.cache)  # the rows EagerEngine runs
        return self.model.logits(hidden[b.logits_rows.long()])

    def release(self, seq_id: int) -> None:
        self.cache.drop(seq_id)
