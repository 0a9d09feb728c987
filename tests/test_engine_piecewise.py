"""The piecewise graphs' premise and their input staging, on CPU (the capture itself needs CUDA: the
H200 checks it through bench/engine.py's tokens against the eager engine and `g4rt bench serve`)."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from g4rt.models.checkpoint import random_model
from g4rt.models.layout import PageGeometry
from g4rt.models.paged import PagedStep
from g4rt.models.step import StepBatch
from g4rt.runtime.arena import Arena
from g4rt.runtime.engines.piecewise import MIN_TOKENS, Staging, token_buckets
from g4rt.runtime.pages import FramePool
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import Scheduler, SchedulerConfig


def mixed_steps(model, frames: int = 64):
    """A geometry and a scheduler with three requests: a prefill step, then a step mixing two decodes
    with the third request's prefill chunk."""
    geometry = PageGeometry.build(model.layout, page_tokens=4)
    sched = Scheduler(geometry, FramePool(frames), SchedulerConfig(max_num_batched_tokens=40, chunk=32))
    for n in (9, 14):
        sched.add(list(range(3, 3 + n)), SamplingParams(max_new_tokens=4), ())
    return geometry, sched


def test_token_buckets():
    assert token_buckets(1) == (MIN_TOKENS,)
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(2049)[-1] == 4096


@pytest.mark.parametrize("variant", ["e2b", "26b", "31b"])
def test_padded_token_rows_leave_the_real_rows_unchanged(variant):
    """What the piecewise graphs rely on: everything but the attention call is row-wise, so a step run
    on T' > T tokens (the staged, zero-padded tokens and positions; the attention on the real T rows
    only, its padded output rows poisoned) gives the real rows' logits and K/V of the unpadded step.
    Covers per-layer inputs and KV-shared layers (E2B), MoE routing (26B-A4B), k_eq_v (31B)."""
    model = random_model(tiny_config(variant), torch.float32, "cpu", seed=5)
    geometry, sched = mixed_steps(model)
    first = sched.schedule()
    arena = Arena.for_geometry(geometry, 64)
    step = PagedStep(model, geometry)
    with torch.inference_mode():
        step(arena.tensor, *first.batch.tensors())
    sched.commit(first, [5, 6])
    sched.add(list(range(30, 50)), SamplingParams(max_new_tokens=2), ())
    mixed = sched.schedule().batch
    t = mixed.num_tokens
    assert mixed.num_seqs == 3 and 2 < t < 32  # two decodes and a chunk of the third prompt
    staging = Staging(torch.device("cpu"))
    tokpos = torch.full((2, 32), -7, dtype=torch.int32)
    meta = staging.stage(mixed, tokpos)
    assert torch.equal(tokpos[0, :t], mixed.token_ids) and torch.equal(tokpos[1, :t], mixed.positions)
    assert not tokpos[:, t:].any()  # padded with token 0 at position 0
    with torch.inference_mode():
        want_arena = arena.tensor.clone()
        want = step(want_arena, *mixed.tensors())
        attend, _ = step.attention_over(arena.tensor, *meta[:-1])

        def attention(layer, q, k, v):
            assert q.shape[0] == 32
            o = torch.full_like(q, 1e4)  # what a padded row reads: anything a previous step left
            o[:t] = attend(layer, q[:t], None if k is None else k[:t], None if v is None else v[:t])
            return o
        hidden = model(tokpos[0], tokpos[1], attention)
        got = model.logits(hidden.index_select(0, meta[-1].long()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arena.tensor, want_arena, rtol=1e-5, atol=1e-5)


def test_staging_packs_every_field_and_reuses_its_buffers_in_turn():
    """Two steps in a row fill different host buffers (the first one's copy may still be in flight on
    CUDA); the metadata views equal the batch's fields, whatever the buffers held before."""
    model = random_model(tiny_config("31b"), torch.float32, "cpu", seed=5)
    geometry, sched = mixed_steps(model)
    batch = sched.schedule().batch
    staging = Staging(torch.device("cpu"))
    staging.reserve(64, 8)  # too small for the metadata: stage grows it
    seen = []
    for _ in range(3):
        for h in staging._host:
            h.fill_(99)
        tokpos = torch.empty(2, 32, dtype=torch.int32)
        meta = staging.stage(batch, tokpos)
        for name, got in zip(StepBatch.names()[2:], meta):
            assert torch.equal(got, getattr(batch, name)), name
        seen.append(staging._turn)
    assert seen == [1, 0, 1]
