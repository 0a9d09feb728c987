"""Paged vs linear, behind the same scheduler: identical tokens and bitwise-identical logits.

The method (seed 003): both arms run the same requests through the same scheduler, so they see the
same step batches (CPU matmuls are not batch-invariant, so nothing else could be byte-equal); the
only difference is the cache -- pages leased from a shuffled pool vs contiguous per-request rows.
The tiny model has a sliding window of 8 and pages of 4 positions, so prompts span many windows and
the sliding group returns pages all the time; the pool holds exactly the widest request's pages, so
later streams must run on frames earlier ones returned.
"""
from __future__ import annotations

import pytest
import torch

from g4rt.models.checkpoint import load_model, write_random_checkpoint
from g4rt.models.config import Gemma4Config
from g4rt.models.layout import PageGeometry
from g4rt.models.linear_cache import generate_linear
from g4rt.runtime.admission import promise_for
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

PAGE = 4
S, F = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = Gemma4Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                       head_dim=16, global_head_dim=32, vocab_size=256, sliding_window=8,
                       layer_types=(S, S, F, S, S, F), eos_token_ids=(1,), dtype="float32")
    path = write_random_checkpoint(cfg, tmp_path_factory.mktemp("tiny_eq"), seed=3, dtype="float32")
    return load_model(path, dtype=torch.float32)


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 250 + 2 for i in range(n)]


def run_both(model, prompts, params, config, num_frames=None, shuffle_seed=11):
    """Run the same requests on the paged engine and the linear reference; return both outputs."""
    geometry = PageGeometry.build(model.layout, PAGE)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    widest = max(promise_for(geometry, len(p), sp.max_new_tokens, config.chunk).frames
                 for p, sp in zip(prompts, plist))
    frames = num_frames or widest
    counting = []
    paged = LLM.paged(model, num_frames=frames, page_tokens=PAGE, config=config, shuffle_seed=shuffle_seed,
                      record_logits=True)
    inner = paged.engine.step

    def step(batch, seq_ids=(), **kw):
        counting.append(len(seq_ids))
        return inner(batch, seq_ids, **kw)

    paged.engine.step = step
    linear = LLM.reference(model, num_frames=frames, page_tokens=PAGE, config=config, record_logits=True)
    a, b = paged.generate(prompts, plist), linear.generate(prompts, plist)
    assert paged.pool.num_free == frames and paged.pool.reserved == 0, "pages leaked"
    assert linear.engine.cache._len == {}, "linear caches not dropped"
    return a, b, counting


def assert_byte_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert len(x.logits) == len(y.logits) == len(x.token_ids)
        for i, (lx, ly) in enumerate(zip(x.logits, y.logits)):
            assert lx.dtype == torch.float32 and torch.equal(lx, ly), f"logits of token {i} differ"


def test_solo_many_windows_greedy(model):
    p = prompt(37, 1)  # 37 positions: over four windows of 8, ten sliding pages
    cfg = SchedulerConfig(max_num_batched_tokens=8, chunk=5)
    a, b, _ = run_both(model, [p], SamplingParams(max_new_tokens=14, ignore_eos=True), cfg)
    assert_byte_equal(a, b)
    assert len(a[0].token_ids) == 14 and len(set(a[0].token_ids)) > 1


def test_greedy_tokens_equal_generate_linear(model):
    p = prompt(23, 2)
    cfg = SchedulerConfig(max_num_batched_tokens=64, chunk=64)  # one prefill step, like generate_linear
    a, _, _ = run_both(model, [p], SamplingParams(max_new_tokens=12, ignore_eos=True), cfg)
    ref, ref_logits = generate_linear(model, p, 12, return_logits=True)
    assert a[0].token_ids == ref
    torch.testing.assert_close(torch.stack(a[0].logits), ref_logits, rtol=1e-5, atol=1e-5)


def test_sampled(model):
    cfg = SchedulerConfig(max_num_batched_tokens=6, chunk=3)
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    a, b, _ = run_both(model, [prompt(19, 3)], sp, cfg)
    assert_byte_equal(a, b)
    again, _, _ = run_both(model, [prompt(19, 3)], sp, cfg, shuffle_seed=99)
    assert again[0].token_ids == a[0].token_ids, "same seed, other page order: same tokens"


def test_streams_share_steps(model):
    prompts = [prompt(n, i) for i, n in enumerate((5, 30, 17, 41))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=s)
              for n, t, s in ((9, 0.0, None), (6, 0.7, 5), (11, 0.0, None), (7, 1.0, 8))]
    cfg = SchedulerConfig(max_num_batched_tokens=10, chunk=4)
    a, b, sizes = run_both(model, prompts, params, cfg, num_frames=200)
    assert_byte_equal(a, b)
    assert max(sizes) >= 3, f"streams never shared a step: {sizes}"


def test_pool_of_exactly_the_widest_request_reuses_returned_pages(model):
    prompts = [prompt(n, i + 10) for i, n in enumerate((33, 12, 26, 9))]
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(4)]
    cfg = SchedulerConfig(max_num_batched_tokens=7, chunk=4)
    a, b, sizes = run_both(model, prompts, params, cfg)  # num_frames = widest promise
    assert_byte_equal(a, b)
    assert all(o.finish_reason == "length" for o in a)


def test_stop_token_ends_both_arms_alike(model):
    cfg = SchedulerConfig(max_num_batched_tokens=8, chunk=8)
    probe, _, _ = run_both(model, [prompt(10, 4)], SamplingParams(max_new_tokens=6, ignore_eos=True), cfg)
    stop = probe[0].token_ids[2]
    a, b, _ = run_both(model, [prompt(10, 4)], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)), cfg)
    assert_byte_equal(a, b)
    assert a[0].finish_reason == "stop" and a[0].token_ids[-1] == stop
    assert len(a[0].token_ids) == probe[0].token_ids.index(stop) + 1
