"""The batched sampler (runtime/sampling.py): distributions, seeded streams that ignore the rest of
the batch, and the overlapped step loop that feeds sampled ids back on the device (runtime/llm.py)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config

from g4rt.models.checkpoint import random_model
from g4rt.runtime.llm import LLM
from g4rt.plugins.reference import sample_noise_ref
from g4rt.runtime.sampling import BatchSampler, SamplingParams, SamplingRows

SAMPLE = BatchSampler()


def rows_of(params: list[tuple]) -> SamplingRows:
    """(temperature, top_k, top_p, seed, counter) per row."""
    return SamplingRows(*zip(*params))


def kept_distribution(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a row must sample from, computed the slow way in float64."""
    scores = logits.double().clone()
    if top_k:
        scores[scores < torch.topk(scores, top_k).values[-1]] = -math.inf
    probs = torch.softmax(scores, 0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = (sorted_p.cumsum(0) - sorted_p) >= top_p
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8), (5, 0.7)])
def test_frequencies_match_the_kept_distribution(top_k, top_p):
    """20,000 draws of one seed (counters 0..N-1, one batch) from a 12-entry row: every token outside
    the kept set is never drawn, and each frequency is within 5 standard errors of its probability."""
    torch.manual_seed(1)
    logits = torch.randn(12) * 1.5
    n = 20_000
    rows = rows_of([(1.0, top_k, top_p, 1234, c) for c in range(n)])
    tokens = SAMPLE(logits.expand(n, -1).contiguous(), rows)
    freq = torch.bincount(tokens, minlength=12).double() / n
    want = kept_distribution(logits, top_k, top_p)
    assert freq[want == 0].sum() == 0
    tol = 5 * torch.sqrt(want * (1 - want) / n) + 1e-12
    assert ((freq - want).abs() <= tol).all(), (freq, want)
    assert (want > 0).sum() > 1  # the case really samples


def test_temperature_sharpens_and_flattens():
    """Lower temperature concentrates the draws on the argmax; higher spreads them."""
    torch.manual_seed(2)
    logits = torch.randn(50)
    n = 4000
    share = {}
    for t in (0.25, 1.0, 4.0):
        tokens = SAMPLE(logits.expand(n, -1).contiguous(), rows_of([(t, 0, 1.0, 9, c) for c in range(n)]))
        share[t] = (tokens == logits.argmax()).double().mean().item()
        want = torch.softmax(logits.double() / t, 0)[logits.argmax()].item()
        assert abs(share[t] - want) < 5 * math.sqrt(want * (1 - want) / n) + 1e-3
    assert share[0.25] > share[1.0] > share[4.0]


def test_seeded_stream_ignores_the_rest_of_the_batch():
    """Each row's token for its (seed, counter) is the same alone, in a mixed batch of greedy, top-k,
    top-p and plain rows, and in any order of that batch; different seeds give different streams."""
    torch.manual_seed(3)
    vocab = 3000
    logits = torch.randn(9, vocab) * 3
    params = [(0.8, 50, 0.9, 42, 3), (1.0, 0, 1.0, 7, 0), (0.0, 0, 1.0, 1, 0), (1.3, 0, 0.5, 9, 11),
              (0.7, 5, 1.0, 2, 4), (1.0, 1000, 0.95, 3, 1), (0.5, 17, 1.0, 8, 2), (2.0, 2, 1.0, 42, 3),
              (1.0, 4096, 1.0, 5, 6)]
    together = SAMPLE(logits, rows_of(params))
    for i, p in enumerate(params):
        assert SAMPLE(logits[i:i + 1], rows_of([p])).item() == together[i].item()
    perm = torch.randperm(len(params))
    assert torch.equal(SAMPLE(logits[perm], rows_of([params[i] for i in perm])), together[perm])
    assert together[2].item() == logits[2].argmax().item()  # the greedy row
    stream = [SAMPLE(logits[1:2], rows_of([(1.0, 0, 1.0, 7, c)])).item() for c in range(20)]
    other = [SAMPLE(logits[1:2], rows_of([(1.0, 0, 1.0, 8, c)])).item() for c in range(20)]
    assert len(set(stream)) > 5 and stream != other


def test_filters_that_leave_one_token_are_greedy():
    torch.manual_seed(4)
    logits = torch.randn(16, 700)
    for params in ((1.0, 1, 1.0), (1.0, 0, 1e-6), (3.0, 40, 1e-6)):
        rows = rows_of([(*params, 5, c) for c in range(16)])
        assert torch.equal(SAMPLE(logits, rows), logits.argmax(-1))


def test_noise_is_gumbel_and_keyed_by_vocabulary_id():
    """Mean and spread of Gumbel(0, 1) over 2^18 draws; a row's noise depends on its own (seed, counter)
    only, and another counter or seed gives other noise."""
    seeds, counters = torch.tensor([11, 12, 11]), torch.tensor([0, 0, 1])
    g = sample_noise_ref(seeds, counters, 1 << 18).double()
    assert abs(g[0].mean().item() - 0.5772) < 0.01 and abs(g[0].std().item() - math.pi / math.sqrt(6)) < 0.01
    assert torch.equal(sample_noise_ref(seeds[:1], counters[:1], 1 << 18)[0], g[0].float())
    assert torch.equal(sample_noise_ref(seeds[:1], counters[:1], 70001)[0], g[0, :70001].float())
    assert (g[0] != g[1]).float().mean() > 0.99 and (g[0] != g[2]).float().mean() > 0.99


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="2 rows"):
        SAMPLE(torch.zeros(3, 10), rows_of([(0.0, 0, 1.0, 0, 0)] * 2))
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingRows([1.0, 0.0], [0, 0], [1.0, 1.0], [1, 2], [0])


def test_a_seed_outside_int64_is_refused_when_the_request_is_made():
    """Seeds travel as int64: one of 2**63 would fail the whole step of every request in the batch."""
    for bad in (2**63, -1, 1.5):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=1.0, seed=bad)
    assert SamplingParams(temperature=1.0, seed=2**63 - 1).seed == 2**63 - 1


def test_rows_pack_layout():
    """The packed settings are what the op reads: float64 bits of temperature and top_p, then top_k,
    seed and counter, one column per row (no rows: an empty [5, 0])."""
    pack = rows_of([(0.7, 5, 0.9, -3, 2), (0, 0, 1, 2 ** 62, 7)]).pack
    assert pack.dtype == torch.int64 and pack.shape == (5, 2)
    assert pack[:2].view(torch.float64).tolist() == [[0.7, 0.0], [0.9, 1.0]]
    assert pack[2:].tolist() == [[5, 0], [-3, 2 ** 62], [2, 7]]
    assert SamplingRows([], [], [], [], []).pack.shape == (5, 0)
    assert rows_of([(0.7, 5, 0.9, -3, 2)]).nucleus and not rows_of([(0.7, 5, 1.0, -3, 2)]).nucleus
    assert rows_of([(0.7, 5, 0.9, -3, 2)]).top_k and not rows_of([(0.7, 0, 0.9, -3, 2)]).top_k


def test_overlapped_loop_matches_one_step_at_a_time(report):
    """The overlapped loop (step n+1 launched before step n's ids reach the host, its placeholder
    tokens fed on the device) gives the same tokens as the loop that commits every step before the
    next, for greedy and seeded sampled requests that stop on length and on a stop token; and it
    really overlapped (placeholders were fed)."""
    model = random_model(tiny_config("e2b"), torch.float32, "cpu", seed=5)
    prompts = [list(range(3, 3 + n)) for n in (9, 23, 5, 14)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=9, temperature=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=7, temperature=1.2, top_k=20, top_p=0.9, seed=2, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True)]
    outs, fed = {}, {}
    for overlap in (False, True):
        llm = LLM.paged(model, num_frames=64, page_tokens=4, overlap=overlap)
        inner, counts = llm.engine.step, []

        def step(batch, seq_ids=(), feed=None, inner=inner, counts=counts):
            counts.append(0 if feed is None else len(feed.index))
            return inner(batch, seq_ids, feed=feed)

        llm.engine.step = step
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, params)]
        fed[overlap] = sum(counts)
    # A stop token from the first run's output: the request must stop there in both loops.
    stop = outs[False][0][4]
    for overlap in (False, True):
        llm = LLM.paged(model, num_frames=64, page_tokens=4, overlap=overlap)
        out = llm.generate(prompts[:1], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True))[0]
        assert out.finish_reason == "stop" and out.token_ids == outs[False][0][:outs[False][0].index(stop) + 1]
        assert llm.pool.num_free == 64 and llm.pool.reserved == 0
    assert outs[True] == outs[False]
    assert fed[False] == 0 and fed[True] > 20
    report(f"overlapped loop: {fed[True]} tokens fed on the device, tokens equal to the serial loop")


def test_scheduler_config_for_device():
    """The measured CUDA settings (a 2,048-token chunk and budget, 256 sequences); CPU keeps the
    defaults; overrides win and are still validated."""
    from g4rt.runtime.scheduler import SchedulerConfig

    cuda = SchedulerConfig.for_device("cuda")
    assert (cuda.chunk, cuda.max_num_batched_tokens, cuda.max_num_seqs) == (2048, 2048, 256)
    assert SchedulerConfig.for_device("cpu") == SchedulerConfig()
    assert SchedulerConfig.for_device("cuda:0", max_num_seqs=8).max_num_seqs == 8
    with pytest.raises(ValueError, match="chunk"):
        SchedulerConfig.for_device("cuda", chunk=4096)


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_are_the_log_softmax_of_the_sampled_rows(overlap):
    """`logprobs=n`: per sampled token its log-probability and the n likeliest ids, equal to the
    log-softmax of the logits row it was sampled from, in either loop; other requests record none."""
    model = random_model(tiny_config("e2b"), torch.float32, "cpu", seed=5)
    llm = LLM.paged(model, num_frames=64, page_tokens=4, overlap=overlap, record_logits=True)
    asked = llm.add_request(list(range(3, 12)), SamplingParams(max_new_tokens=6, temperature=0.9, seed=1,
                                                               ignore_eos=True), logprobs=3)
    other = llm.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    outs = {}
    while llm.has_unfinished():
        outs.update((o.request_id, o) for o in llm.step())
    out = outs[asked]
    assert len(out.logprobs) == 6 and outs[other].logprobs is None
    for token, row, (chosen, top) in zip(out.token_ids, out.logits, out.logprobs):
        lp = torch.log_softmax(row.float(), -1)
        assert abs(lp[token].item() - chosen) < 1e-5
        assert [t for t, _ in top] == lp.topk(3).indices.tolist()


def test_the_kernels_choice_reaches_the_sampler():
    """`kernels` picks the sampler's implementation as it does the model's: LLM.paged sets both, an LLM
    over any engine takes it for its sampler (the CLI's --kernels passes it to either)."""
    model = random_model(tiny_config("e2b"), torch.float32, "cpu", seed=5)
    assert LLM.paged(model, num_frames=8, page_tokens=4, kernels="reference").sampler.kernels == "reference"
    assert LLM.paged(model, num_frames=8, page_tokens=4).sampler.kernels is None  # the device's default
    llm = LLM.paged(model, num_frames=8, page_tokens=4)
    assert LLM(llm.engine, 8, kernels="triton").sampler.kernels == "triton"
    with pytest.raises(ValueError, match="BatchSampler.kernels"):
        LLM(llm.engine, 8, kernels="cuda")
