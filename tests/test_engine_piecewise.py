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
from g4rt.runtime.engines.piecewise import Staging, token_buckets
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
    assert token_buckets(1) == (1,)
    assert token_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(10**6)[-1] == 2048  # larger steps run at their own size, never replayed


@pytest.mark.parametrize("variant", ["e2b", "26b", "31b"])
def test_padded_token_rows_leave_the_real_rows_unchanged(variant):
    """What the piecewise graphs and PagedStep(pad_tokens=True) rely on: everything but the attention
    call is row-wise, so a step run on token_bucket(T) > T rows (token 0 at position 0 in the padded
    rows, the attention on the real rows only) gives the real rows' logits and K/V of the unpadded step.
    Covers per-layer inputs and KV-shared layers (E2B), MoE routing (26B-A4B), k_eq_v (31B). Also: the
    staged inputs (what the graphs read) are the batch's, padded with zeros."""
    model = random_model(tiny_config(variant), torch.float32, "cpu", seed=5)
    geometry, sched = mixed_steps(model)
    first = sched.schedule()
    arena = Arena.for_geometry(geometry, 64)
    exact, padded = PagedStep(model, geometry), PagedStep(model, geometry, pad_tokens=True)
    with torch.inference_mode():
        exact(arena.tensor, *first.batch.tensors())
    sched.commit(first, [5, 6])
    sched.add(list(range(30, 50)), SamplingParams(max_new_tokens=2), ())
    mixed = sched.schedule().batch
    t = mixed.num_tokens
    assert mixed.num_seqs == 3 and 16 < t < 32  # two decodes and a chunk of the third prompt
    staging = Staging(torch.device("cpu"))
    tokpos = torch.full((2, 32), -7, dtype=torch.int32)
    meta = staging.stage(mixed, tokpos)
    assert torch.equal(tokpos[0, :t], mixed.token_ids) and torch.equal(tokpos[1, :t], mixed.positions)
    assert not tokpos[:, t:].any()
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    with torch.inference_mode():
        want_arena = arena.tensor.clone()
        want = exact(want_arena, *mixed.tensors())
        got = padded(arena.tensor, mixed.token_ids, mixed.positions, *meta)
    assert seen == [t, 32]  # the padded step ran on 32 rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arena.tensor, want_arena, rtol=1e-5, atol=1e-5)


def test_staging_packs_every_field_and_reuses_its_buffers_in_turn():
    """Two steps in a row fill different host buffers (the first one's copy may still be in flight on
    CUDA); the metadata views equal the batch's fields, whatever the buffers held before, and each
    starts 16-byte aligned whatever the sizes before it (cu_q has B + 1 elements: here 3)."""
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
            assert got.data_ptr() % 16 == 0, name  # Triton compiles a kernel variant per alignment
        seen.append(staging._turn)
    assert seen == [1, 0, 1]
