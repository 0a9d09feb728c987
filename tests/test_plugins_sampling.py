"""The Triton sampler (plugins/triton_sampling.py) against its torch reference (plugins/reference.py
`sample_ref`), under the Triton interpreter: the same token for every row, whatever else is in the
batch. The reference's distributions are checked in tests/test_runtime_sampling.py."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; `make test` sets it too

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.plugins import ops, reference  # noqa: E402
from g4rt.plugins import triton_sampling as ts  # noqa: E402
from g4rt.runtime.sampling import SamplingRows  # noqa: E402

# (temperature, top_k, top_p, seed, counter): greedy, plain, top-k, top-p (large and tiny), both, a k
# of the whole vocabulary and beyond, k = 1, a negative seed, a large counter.
PARAMS = [(0.0, 0, 1.0, 1, 0), (1.0, 0, 1.0, 7, 0), (0.7, 5, 1.0, 2, 4), (1.3, 0, 0.5, 9, 11),
          (0.8, 50, 0.9, 42, 3), (1.0, 0, 1e-6, 5, 6), (2.0, 0, 0.97, 3, 1), (1.0, 1000, 1.0, 5, 6),
          (1.0, 1, 1.0, 8, 2), (3.0, 300, 0.99, -5, 7), (0.5, 17, 0.3, 2 ** 40 + 3, 2 ** 30), (4.0, 0, 0.2, 6, 9)]


def pack(params) -> torch.Tensor:
    return SamplingRows(*zip(*params)).pack


def logits_for(rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[1, :37] = float("-inf")  # a masked part of the vocabulary
    return x.to(dtype)


@pytest.mark.parametrize("vocab,block,dtype", [(700, 64, torch.float32), (333, 128, torch.bfloat16),
                                               (2500, 1024, torch.float32)])
def test_kernel_matches_reference(vocab, block, dtype):
    """Every kind of row, the vocabulary cut into several tiles (the last one partial)."""
    x = logits_for(len(PARAMS), vocab, vocab, dtype)
    rows = pack(PARAMS)
    want = reference.sample_ref(x, rows)
    assert torch.equal(ts.sample(x, rows, block=block), want)
    assert want[0].item() == x[0].float().argmax().item()
    assert want[8].item() == x[8].float().argmax().item()  # top_k = 1
    assert want[5].item() == x[5].float().argmax().item()  # a nucleus of one


@pytest.mark.parametrize("splits", [1, 3])
def test_many_seeds_match_reference(splits):
    """64 sampled rows of one logits row under 16 seeds x 4 settings, with one program per row and
    with the first pass and top-p rounds cut over 3: the kernel draws what the reference draws (its
    noise, cut and race; some of these top-p rows take 1, 2 and 3 rounds), and the draws vary."""
    x = logits_for(2, 300, 1)[0].expand(64, -1).contiguous()
    params = [(t, k, p, seed, 2) for seed in range(16) for t, k, p in ((1.0, 0, 1.0), (1.0, 20, 1.0),
                                                                     (1.5, 0, 0.6), (0.9, 40, 0.8))]
    rows = pack(params)
    got = ts.sample(x, rows, block=64, splits=splits)
    assert torch.equal(got, reference.sample_ref(x, rows))
    assert len(set(got.tolist())) > 15


def test_a_rows_token_ignores_the_rest_of_the_batch():
    x = logits_for(len(PARAMS), 500, 4)
    together = ts.sample(x, pack(PARAMS), block=128)
    for i in (1, 4, 9):
        assert ts.sample(x[i:i + 1], pack(PARAMS[i:i + 1]), block=128).item() == together[i].item()
    perm = torch.randperm(len(PARAMS), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ts.sample(x[perm], pack([PARAMS[i] for i in perm]), block=128), together[perm])


@pytest.mark.parametrize("splits", [1, 3])
def test_greedy_takes_the_first_of_tied_maxima(splits):
    """Within a tile, across tiles, and across the chunks of a split first pass (3 chunks of 128)."""
    x = torch.zeros(3, 300)
    x[0, [7, 250]] = 2.0
    x[1, [130, 131]] = 1.0
    x[2, 299] = 0.5
    got = ts.sample(x, pack([(0.0, 0, 1.0, 0, 0)] * 3), block=64, splits=splits)
    assert got.tolist() == [7, 130, 299]


def test_split_first_pass_changes_no_token():
    """A row's first pass, top-k gathering pass and top-p rounds cut over several programs (what few rows get)
    draw what one program draws, and so do the split passes without the split rounds (`nucleus` False) or the
    gathering pass (`top_k` False), which leave those rows' rounds or cut to their row's program."""
    x = logits_for(len(PARAMS), 600, 6)
    rows = pack(PARAMS)
    want = reference.sample_ref(x, rows)
    for splits in (1, 5):
        assert torch.equal(ts.sample(x, rows, block=64, splits=splits), want)
    for nucleus, top_k in ((False, True), (True, False), (False, False)):
        assert torch.equal(ts.sample(x, rows, block=64, splits=5, nucleus=nucleus, top_k=top_k), want)


def test_rows_that_outlast_the_split_rounds_go_on_alone(monkeypatch):
    """With one split top-p round, the rows that need more (here some need 2 and 3) finish in their row's program
    from where the split round left them (top-k rows run theirs over their gathered entries): the reference's
    tokens for both kinds of row."""
    monkeypatch.setattr(ts, "SPLIT_ROUNDS", 1)
    x = logits_for(2, 300, 1)[0].expand(64, -1).contiguous()
    params = [(t, k, p, seed, 2) for seed in range(32) for t, k, p in ((1.5, 0, 0.6), (0.9, 40, 0.8))]
    rows = pack(params)
    assert torch.equal(ts.sample(x, rows, block=64, splits=3), reference.sample_ref(x, rows))


def test_the_gathered_entries_are_the_likeliest_and_hold_the_top_k():
    """The first pass's group maxima and the gathering pass, launched as `sample()` launches them (a row cut in 5
    chunks of 19 tiles, a group a lane): each top-k row gathers exactly the entries whose cut key is at most some
    pivot, those hold every entry whose key is at most the k-th smallest, and they are few more than k (the
    pivot is about the k-th largest of 320 group maxima); rows without top-k gather nothing."""
    R, V, block = 4, 6000, 64
    x = logits_for(R, V, 11)
    rows = pack([(1.0, 50, 0.9, 1, 0), (0.7, 5, 1.0, 2, 0), (1.0, 0, 0.9, 3, 0), (1.5, 64, 1.0, 4, 0)])
    chunk = 19 * block
    splits = -(-V // chunk)
    assert splits == 5
    groups, sp = ts.pivot_groups(splits, block), 8
    part = torch.full((2 * R * splits,), float("nan"))
    wins = torch.full((R * splits,), -1, dtype=torch.int32)
    lanes = torch.full((groups * R * splits,), float("nan"))
    count = torch.full((R,), -1, dtype=torch.int32)
    cand = torch.full((R * ts.LISTED,), -1, dtype=torch.int32)
    args = (R, V, x.stride(0), chunk, splits)
    ts._first_pass_kernel[(R, splits)](x, rows, part, wins, lanes, count, *args, G=groups, BLOCK=block)
    ts._gather_kernel[(R, splits)](x, rows, part, lanes, count, cand, *args, G=groups, SP=sp, L=ts.LISTED,
                                   BLOCK=block)
    inv = (1.0 / rows[0].view(torch.float64)).float()
    scores = x * inv[:, None]
    keys, _ = reference.sample_keys_ref(scores, scores.max(dim=-1).values)
    assert count[2].item() == 0
    for r in (0, 1, 3):
        k = rows[2, r].item()
        got = cand.view(R, -1)[r, :count[r]].tolist()
        assert len(set(got)) == len(got) and k <= len(got) <= 2 * k
        pivot = keys[r, got].max()
        assert set(got) == set(torch.nonzero(keys[r] <= pivot)[:, 0].tolist())
        assert pivot >= keys[r].sort().values[k - 1]


@pytest.mark.parametrize("listed", [16384, 32])
def test_rows_whose_gathered_entries_overflow_cut_their_list_or_whole_row(listed, monkeypatch):
    """With room for 32 gathered entries in registers, the top-k rows that gather more (k = 40, 50, 300) find their
    cut over their gathered list in memory, or (with room for 32 there too) over their whole row, in their own
    program, as do the rows of a step told no row has top-k: the reference's tokens, split and whole, beside rows
    that fit."""
    monkeypatch.setattr(ts, "CANDIDATES", 32)
    monkeypatch.setattr(ts, "LISTED", listed)
    x = logits_for(2, 3000, 1)[0].expand(64, -1).contiguous()
    params = [(t, k, p, seed, 2) for seed in range(16) for t, k, p in ((1.0, 40, 1.0), (0.9, 5, 0.8),
                                                                     (1.5, 300, 0.6), (0.9, 50, 0.9))]
    rows = pack(params)
    want = reference.sample_ref(x, rows)
    for splits in (1, 3):
        assert torch.equal(ts.sample(x, rows, block=256, splits=splits), want)
    assert torch.equal(ts.sample(x, rows, block=256, splits=3, top_k=False), want)


@pytest.mark.parametrize("room,listed", [(1024, 16384), (4, 16384), (4, 4)])
def test_the_cut_keeps_ties_and_the_whole_row(room, listed, monkeypatch):
    """The cut on rows whose keys tie across the k-th (every kept tie may win), whose k-th key is the saturated
    bottom one (2^24 - 1: scores 256 or more below the top), and whose k is all but one entry, split and whole,
    over the gathered entries in registers, (with room for 4 there) in their list, and (room for 4 in both) over the
    whole row: the reference's tokens. Rows 2-4 have a k above the pivot's groups (64 a row at 1 chunk, 192 at 3),
    so they list their own entries (the last, which row 4's top is, included) or cut their whole row."""
    monkeypatch.setattr(ts, "CANDIDATES", room)
    monkeypatch.setattr(ts, "LISTED", listed)
    x = torch.zeros(5, 500)
    x[0, ::7] = 1.0  # 72 tied tops, k = 5 of them
    x[1, :3] = 400.0  # three far above the rest: the k-th (k = 10) key saturates
    x[2] = torch.arange(500.0) / 1000  # k = 499
    x[3, 250:] = -1e-6  # two tied halves, k = 260
    x[4] = torch.arange(500.0) * 10  # the last id far above the rest, k = 499
    rows = pack([(1.0, 5, 1.0, 1, 0), (1.0, 10, 0.95, 2, 1), (1.3, 499, 1.0, 3, 2), (1.0, 260, 1.0, 4, 3),
                 (1.0, 499, 1.0, 5, 4)])
    want = reference.sample_ref(x, rows)
    for splits in (1, 3):
        assert torch.equal(ts.sample(x, rows, block=64, splits=splits), want)
    assert want[0].item() % 7 == 0 and want[1].item() < 3 and want[4].item() == 499


def test_op_dispatch():
    """`g4rt::sample` runs either implementation by its `kernels` argument, with a fake for tracing."""
    x = logits_for(len(PARAMS), 200, 5)
    rows = pack(PARAMS)
    assert torch.equal(ops.sample(x, rows, kernels="triton"), ops.sample(x, rows, kernels="reference"))
    torch.library.opcheck(torch.ops.g4rt.sample.default, (x, rows, True, True, "reference"),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="kernels"):
        ops.sample(x, rows, kernels="cuda")
