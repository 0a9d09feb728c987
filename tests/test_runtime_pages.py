"""Allocator, admission and scheduler properties, with a model-free engine that checks page contents.

`RecordingEngine` stands in for the model: it writes (request, position, token) into a per-slot
shadow arena through the batch's slots and, for every query, reads back every key the attention
would see through the batch's page tables (`first_page`, window for the sliding group). A frame
reused while still readable, a wrong slot, a missing page or a stale table entry all show up as a
wrong tag -- the bookkeeping is checked end to end, not just counted.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from g4rt.models.config import Gemma4Config
from g4rt.models.layout import KVLayout, PageGeometry
from g4rt.runtime.admission import RequestTooLarge, promise_for
from g4rt.runtime.llm import LLM
from g4rt.runtime.pages import FramePool, PastPagesError, PoolError, RequestPages
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import Scheduler, SchedulerConfig

VOCAB = 50
WINDOW = 8


def tiny_geometry(page_tokens: int = 4) -> PageGeometry:
    cfg = Gemma4Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, global_head_dim=16, vocab_size=VOCAB,
                       sliding_window=WINDOW, dtype="float32",
                       layer_types=("sliding_attention", "sliding_attention", "full_attention"))
    return PageGeometry.build(KVLayout.from_config(cfg), page_tokens=page_tokens, align=2)


class RecordingEngine:
    def __init__(self, geometry: PageGeometry, num_frames: int, fail_on: set[int] = frozenset()):
        self.geometry = geometry
        self.window = geometry.layout.sliding.window
        self.shadow = {g: {} for g in ("sliding", "full")}  # slot -> (seq, position, token)
        self.history: dict[int, list[int]] = {}  # seq -> tokens written so far, by position
        self.fail_on = set(fail_on)  # seq ids whose first step raises
        self.num_frames = num_frames
        self.released: list[int] = []

    def step(self, batch, seq_ids):
        if self.fail_on & set(seq_ids):
            raise RuntimeError("injected engine failure")
        cu = batch.cu_q.tolist()
        slots = {"sliding": batch.sliding_slots.tolist(), "full": batch.full_slots.tolist()}
        for g in slots:
            live = [s for s in slots[g] if s >= 0]
            assert len(live) == len(set(live)), f"{g}: two rows write one slot"
            assert all(0 <= s < self.num_frames * self.geometry.page_tokens[g] for s in live)
        for b, sid in enumerate(seq_ids):
            hist = self.history.setdefault(sid, [])
            for row in range(cu[b], cu[b + 1]):
                pos, tok = int(batch.positions[row]), int(batch.token_ids[row])
                assert pos == len(hist), f"seq {sid}: position {pos} written out of order"
                hist.append(tok)
                for g in slots:
                    self.shadow[g][slots[g][row]] = (sid, pos, tok)
        for b, sid in enumerate(seq_ids):
            kv_len, first = int(batch.kv_lens[b]), int(batch.sliding_first[b])
            for row in range(cu[b], cu[b + 1]):
                p = int(batch.positions[row])
                self._check_reads("full", batch.full_table[b].tolist(), 0, sid, range(0, p + 1))
                lo = max(0, p - self.window + 1)
                assert first * self.geometry.page_tokens["sliding"] <= lo, "sliding window starts below first page"
                self._check_reads("sliding", batch.sliding_table[b].tolist(), first, sid, range(lo, p + 1))
            assert kv_len == len(self.history[sid])
        rows = batch.logits_rows.tolist()
        flat_seq = [sid for b, sid in enumerate(seq_ids) for _ in range(cu[b], cu[b + 1])]
        logits = torch.zeros(len(rows), VOCAB)
        for i, r in enumerate(rows):  # deterministic in (seq history): next token = hash, never 0
            h = hash((flat_seq[r], tuple(self.history[flat_seq[r]]))) % (VOCAB - 1) + 1
            logits[i, h] = 1.0
        return logits

    def _check_reads(self, g, table, first_page, sid, positions):
        P = self.geometry.page_tokens[g]
        for k in positions:
            frame = table[k // P - first_page]
            got = self.shadow[g].get(frame * P + k % P)
            assert got == (sid, k, self.history[sid][k]), f"{g} key {k} of seq {sid} reads {got}"

    def release(self, seq_id):
        self.released.append(seq_id)


def assert_pool_consistent(sched: Scheduler, pool: FramePool) -> None:
    owned = []
    for seq in sched.running:
        owned += seq.pages.sliding.frames + seq.pages.full.frames
        assert seq.pages.held == len(seq.pages.sliding.frames) + len(seq.pages.full.frames)
        assert seq.pages.held <= seq.pages.promised
        bound = sched.geometry.sliding_pages_per_request(sched.config.chunk)
        assert len(seq.pages.sliding.frames) <= bound, "sliding residency above the admission bound"
    assert len(owned) == len(set(owned)), "a frame is held twice"
    assert sorted(owned) == sorted(pool._leased)
    assert pool.num_free + pool.num_leased == pool.num_frames
    assert len(set(pool.free_frames())) == pool.num_free
    assert pool.reserved == sum(s.pages.promised for s in sched.running) <= pool.num_frames


request = st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6),  # prompt, max_new, arrival step
                    st.sampled_from(["run", "run", "cancel", "fail"]), st.integers(0, 10))  # fate, when


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=7), extra=st.integers(0, 30), chunk=st.integers(1, 12),
       budget_extra=st.integers(0, 16), seed=st.integers(0, 2**16), page_tokens=st.sampled_from([2, 4]))
def test_random_workloads_never_double_lease_and_return_everything(reqs, extra, chunk, budget_extra, seed,
                                                                   page_tokens):
    geometry = tiny_geometry(page_tokens)
    widest = max(promise_for(geometry, p, n, chunk).frames for p, n, *_ in reqs)
    frames = widest + extra
    engine = RecordingEngine(geometry, frames)
    llm = LLM(engine, frames, SchedulerConfig(max_num_batched_tokens=chunk + budget_extra, chunk=chunk,
                                              max_num_seqs=4), shuffle_seed=seed)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    ids, outs, step = {}, {}, 0
    while pending or llm.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (p, n, _, fate, when) = pending.pop(0)
            prompt = [(i * 7 + j) % (VOCAB - 1) + 1 for j in range(p)]
            ids[i] = llm.add_request(prompt, SamplingParams(max_new_tokens=n))
            if fate == "fail":
                engine.fail_on.add(ids[i]) if when % 2 else None
        for i, (p, n, _, fate, when) in enumerate(reqs):
            if fate == "cancel" and when == step and i in ids and ids[i] not in outs:
                llm.cancel(ids[i])
        try:
            finished = llm.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            engine.fail_on.clear()
            finished = llm.take_finished()
        for o in finished:
            outs[o.request_id] = o
        assert_pool_consistent(llm.scheduler, llm.pool)
        step += 1
        assert step < 2000, "no progress"
    assert set(outs) == set(ids.values())
    assert llm.pool.num_free == frames and llm.pool.reserved == 0 and not llm.pool._leased
    for i, (p, n, *_rest) in enumerate(reqs):
        o = outs[ids[i]]
        assert o.finish_reason in ("length", "cancelled", "error")
        if o.finish_reason == "length":
            assert len(o.token_ids) == n
        else:
            assert len(o.token_ids) <= n
    assert set(engine.released) >= set(ids.values()), "engine not told every request ended"


def test_request_too_large_is_refused_with_the_numbers():
    geometry = tiny_geometry()
    need = promise_for(geometry, 30, 10, 4)
    pool = FramePool(need.frames - 1)
    sched = Scheduler(geometry, pool, SchedulerConfig(max_num_batched_tokens=8, chunk=4))
    with pytest.raises(RequestTooLarge) as e:
        sched.add(list(range(1, 31)), SamplingParams(max_new_tokens=10))
    msg = str(e.value)
    assert f"needs {need.frames} frames" in msg and f"only {need.frames - 1} frames" in msg
    assert "prompt 30" in msg and "max_new_tokens 10" in msg
    assert not sched.has_unfinished() and pool.reserved == 0
    smaller = 30 - geometry.page_tokens["full"]  # one full page fewer fits exactly
    assert promise_for(geometry, smaller, 10, 4).frames == need.frames - 1
    sched.add(list(range(1, smaller + 1)), SamplingParams(max_new_tokens=10))
    assert len(sched.waiting) == 1


def test_request_that_fits_later_waits_instead_of_failing():
    geometry = tiny_geometry()
    one = promise_for(geometry, 12, 6, 4).frames
    engine = RecordingEngine(geometry, one + 1)
    llm = LLM(engine, one + 1, SchedulerConfig(max_num_batched_tokens=8, chunk=4))
    a = llm.add_request(list(range(1, 13)), SamplingParams(max_new_tokens=6))
    b = llm.add_request(list(range(2, 14)), SamplingParams(max_new_tokens=6))
    llm.step()
    assert [s.seq_id for s in llm.scheduler.running] == [a]
    assert [s.seq_id for s in llm.scheduler.waiting] == [b], "b must wait while a holds the pool"
    outs = {}
    while llm.has_unfinished():
        outs.update({o.request_id: o for o in llm.step()})
    assert outs[a].finish_reason == outs[b].finish_reason == "length"
    assert outs[b].ttft_s > outs[a].ttft_s
    assert llm.pool.num_free == one + 1


def test_sliding_pages_return_to_the_pool_as_the_window_moves():
    geometry = tiny_geometry(page_tokens=4)
    pool = FramePool(64)
    pages = RequestPages(geometry, pool, promised=40)
    pages.prepare(0, 12)  # positions 0..11: sliding pages 0,1,2 (4 positions each)
    assert pages.sliding.first_page == 0 and len(pages.sliding.frames) == 3
    pages.trim(12)  # next query at 12 sees keys >= 5: page 0 (0..3) is dead, page 1 (4..7) is not
    assert pages.sliding.first_page == 1 and len(pages.sliding.frames) == 2
    assert pool.num_leased == 2 + len(pages.full.frames)
    pages.prepare(12, 1)
    assert pages.sliding.end_page == 4 and pages.full.end_page == -(-13 // geometry.page_tokens["full"])
    with pytest.raises(PastPagesError, match="position 3 is on page 0"):
        pages.slots("sliding", range(3, 4))  # below the window: never silently aliased
    with pytest.raises(PastPagesError, match="position 16"):
        pages.slots("full", range(16, 17))  # past the leased pages
    pages.release()
    pages.release()  # idempotent
    assert pool.num_free == 64 and pool.reserved == 0


def test_a_run_of_slots_is_the_slot_of_each_position():
    """PageTable.slots builds a chunk's slots a page at a time: the same as slot() per position for runs
    that start and end inside pages or on their edges; runs past either end of the leased pages raise."""
    from g4rt.runtime.pages import PageTable
    table = PageTable(page_tokens=4, frames=[9, 2, 7, 5], first_page=3)  # positions 12..27
    for run in (range(12, 28), range(13, 14), range(14, 23), range(16, 20), range(27, 28), range(20, 20)):
        assert table.slots(run) == [table.slot(p) for p in run], run
    for run in (range(11, 14), range(26, 29)):
        with pytest.raises(PastPagesError):
            table.slots(run)
    with pytest.raises(ValueError, match="step 2"):
        table.slots(range(12, 20, 2))


def test_leases_beyond_the_promise_are_refused_before_taking_a_frame():
    geometry = tiny_geometry()
    pool = FramePool(16)
    pages = RequestPages(geometry, pool, promised=2)
    with pytest.raises(PoolError, match="promised 2"):
        pages.prepare(0, 20)
    assert pages.held == pool.num_leased <= 2
    pages.release()
    assert pool.num_free == 16
    with pytest.raises(PoolError, match="double free"):
        pool.give(0)
    with pytest.raises(PoolError, match="cannot promise 17"):
        RequestPages(geometry, pool, promised=17)


def test_shuffled_pool_hands_out_every_frame_once_in_a_seeded_order():
    a, b = FramePool(32, shuffle_seed=5), FramePool(32, shuffle_seed=5)
    order = [a.take() for _ in range(32)]
    assert sorted(order) == list(range(32)) and order != list(range(32))
    assert order == [b.take() for _ in range(32)]


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="chunk"):
        SchedulerConfig(max_num_batched_tokens=4, chunk=8)
    sched = Scheduler(tiny_geometry(), FramePool(8), SchedulerConfig(max_num_batched_tokens=8, chunk=4))
    with pytest.raises(ValueError, match="prompt"):
        sched.add([], SamplingParams())


def test_forget_refuses_a_running_request_and_keeps_it():
    sched = Scheduler(tiny_geometry(), FramePool(16), SchedulerConfig(max_num_batched_tokens=8, chunk=4))
    seq = sched.add([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=f"request {seq.seq_id} is still running"):
        sched.forget(seq.seq_id)
    assert sched.seqs[seq.seq_id] is seq  # still known: it can be finished and handed out later
    sched.cancel(seq.seq_id)
    sched.forget(seq.seq_id)
    assert seq.seq_id not in sched.seqs


def test_a_scheduling_error_fails_the_running_requests_and_returns_their_pages(monkeypatch):
    """`LLM.step` treats an error while building a step like an engine error: every running request
    ends with it, its pages and promise go back, and the LLM serves the next requests."""
    frames = 32
    engine = RecordingEngine(tiny_geometry(), frames)
    llm = LLM(engine, frames, SchedulerConfig(max_num_batched_tokens=8, chunk=4, max_num_seqs=4))
    a = llm.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=4))
    b = llm.add_request([7, 8], SamplingParams(max_new_tokens=4))
    assert llm.step() == [] and len(llm.scheduler.running) == 2

    def broken(plan):
        raise PoolError("injected scheduling failure")
    monkeypatch.setattr(llm.scheduler, "_build", broken)
    with pytest.raises(PoolError, match="injected"):
        llm.step()
    monkeypatch.undo()
    assert not llm.scheduler.running and llm.pool.num_free == frames and llm.pool.reserved == 0
    outs = {o.request_id: o for o in llm.take_finished()}
    assert {outs[a].finish_reason, outs[b].finish_reason} == {"error"}
    assert "PoolError: injected scheduling failure" in outs[a].error
    assert {a, b} <= set(engine.released)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [-1, VOCAB + 1, 2.0, True, "3"])
def test_logprobs_outside_the_vocabulary_are_refused_when_added(bad):
    """The top-n of a step is one op over every row that asked: a bad n must not reach it (it would fail
    every request of the step), so add_request refuses it, naming the field and the value."""
    llm = LLM(RecordingEngine(tiny_geometry(), 16), 16)
    with pytest.raises(ValueError, match=rf"logprobs must be None or an integer in \[0, {VOCAB}\].*got {bad!r}"):
        llm.add_request([1, 2], SamplingParams(max_new_tokens=1), logprobs=bad)
    assert not llm.has_unfinished() and not llm.scheduler.seqs
    rid = llm.add_request([1, 2], SamplingParams(max_new_tokens=1), logprobs=VOCAB)  # every entry: allowed
    (out,) = llm.step()
    assert out.request_id == rid and len(out.logprobs[0][1]) == VOCAB
