"""The paged reference ops against straightforward computations (no Triton involved)."""
from __future__ import annotations

import pytest
import torch

from g4rt.plugins import ops, window_left
from fixtures import make_paged_batch
from g4rt.plugins.reference import (attend, gather_kv, kv_write_ref, kv_write_ref_,
                                    paged_attention_ref)


def naive_attention(batch) -> torch.Tensor:
    """float64, one query and one head at a time, keys chosen by an explicit position loop."""
    q = batch.q.double()
    out = torch.zeros_like(q)
    group = q.shape[1] // batch.num_kv_heads
    for b in range(len(batch.kv_lens)):
        q0, q1 = int(batch.cu_q[b]), int(batch.cu_q[b + 1])
        kv_len = int(batch.kv_lens[b])
        lo = int(batch.first_page[b]) * batch.page_size
        k, v = batch.seq_k[b].double(), batch.seq_v[b].double()
        for i in range(q1 - q0):
            p = kv_len - (q1 - q0) + i
            keys = [kp for kp in range(lo, kv_len)
                    if kp <= p and (batch.window_left < 0 or kp >= p - batch.window_left)]
            if not keys:
                continue
            idx = torch.tensor(keys) - lo
            for hq in range(q.shape[1]):
                kh = k[idx, hq // group]
                w = torch.softmax(kh @ q[q0 + i, hq] * batch.scale, dim=0)
                out[q0 + i, hq] = w @ v[idx, hq // group]
    return out


CASES = [
    # q_lens, kv_lens, Hq, Hkv, D, P, window_left, resident_only
    ([1], [1], 2, 1, 16, 4, -1, False),
    ([3, 1, 5], [3, 20, 13], 4, 2, 16, 4, -1, False),  # ragged: prefill from 0, decode, chunk
    ([1, 1], [17, 9], 8, 1, 8, 8, 5, False),  # window, whole table
    ([4, 1, 2], [30, 25, 11], 4, 2, 16, 4, 6, True),  # window, resident-only tables (first_page > 0)
    ([6], [40], 2, 2, 16, 16, window_left(8), True),  # chunk straddling the window edge
]


@pytest.mark.parametrize("case", CASES)
def test_paged_reference_matches_naive(case):
    q_lens, kv_lens, hq, hkv, d, p, wl, resident = case
    batch = make_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
                             window_left=wl, resident_only=resident, seed=len(q_lens), scale=0.3)
    if resident:
        assert int(batch.first_page.max()) > 0, "case meant to exercise first_page > 0"
    got = paged_attention_ref(*batch.args())
    torch.testing.assert_close(got.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_paged_reference_ignores_everything_outside_the_table():
    """Frames not in any table (and other layers' blocks, padding) are NaN: the result stays finite."""
    batch = make_paged_batch([2, 1], [21, 9], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                             window_left=5, resident_only=True, spare_frames=4)
    args = list(batch.args())
    in_table = torch.zeros_like(batch.arena, dtype=torch.bool)
    width = batch.num_kv_heads * 16
    for b in range(2):
        n = -(-int(batch.kv_lens[b]) // 4) - int(batch.first_page[b])
        for f in batch.page_table[b, :n].tolist():
            # only positions a query can reach: tails of last pages must not be read either
            in_table[f, batch.k_offset:batch.k_offset + 4 * width] = True
            in_table[f, batch.v_offset:batch.v_offset + 4 * width] = True
    poisoned = batch.arena.masked_fill(~in_table, float("nan"))
    # page tails past kv_len are in the table but hold no key: poison those too
    for b in range(2):
        kv_len, first = int(batch.kv_lens[b]), int(batch.first_page[b])
        for pos in range(kv_len, -(-kv_len // 4) * 4):
            f = int(batch.page_table[b, pos // 4 - first])
            for off in (batch.k_offset, batch.v_offset):
                poisoned[f, off + (pos % 4) * width: off + (pos % 4 + 1) * width] = float("nan")
    args[1] = poisoned
    got = paged_attention_ref(*args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_attention_ref(*batch.args()), atol=0, rtol=0)


def test_query_seeing_no_key_yields_zeros():
    # first_page 1 with P=4: keys start at 4; the chunk's first query sits at 3 and sees nothing.
    batch = make_paged_batch([3], [6], num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4, window_left=1,
                             resident_only=False)
    batch.first_page[0] = 1
    batch.page_table[0, 0] = batch.page_table[0, 1]
    batch.seq_k[0], batch.seq_v[0] = batch.seq_k[0][4:], batch.seq_v[0][4:]
    got = paged_attention_ref(*batch.args())
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.double(), naive_attention(batch), atol=1e-6, rtol=1e-6)
    assert got[1].abs().sum() > 0


def test_paged_equals_linear_attend_bitwise():
    """Same keys, same `attend` call: paged and linear caches must agree exactly."""
    batch = make_paged_batch([5], [37], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    got = paged_attention_ref(*batch.args())
    q_pos = torch.arange(32, 37)
    want = attend(batch.q, batch.seq_k[0], batch.seq_v[0], q_pos, torch.arange(37), -1, 1.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_round_trip(dtype):
    P, H, D, frames = 4, 2, 8, 6
    arena = torch.randn(frames, 2 * P * H * D + 3).to(dtype)
    before = arena.clone()
    k = torch.randn(7, H, D).to(dtype)
    v = torch.randn(7, H, D).to(dtype)
    # positions 0..6 of one sequence in frames 4, 1 (shuffled), two tokens skipped with -1
    table = torch.tensor([4, 1], dtype=torch.int32)
    pos = torch.arange(7)
    slots = (table[pos // P].long() * P + pos % P).to(torch.int32)
    slots[2] = -1
    slots[5] = -1
    new = kv_write_ref(arena, k, v, slots, 0, P * H * D, P)
    assert torch.equal(arena, before), "functional write must not touch its input"
    kk, vv, kpos = gather_kv(new, table, 0, 7, 0, P * H * D, P, H, D)
    assert torch.equal(kpos, pos)
    written = slots >= 0
    assert torch.equal(kk[written], k[written]) and torch.equal(vv[written], v[written])
    # skipped slots keep the old contents
    ok, ov, _ = gather_kv(before, table, 0, 7, 0, P * H * D, P, H, D)
    assert torch.equal(kk[~written], ok[~written]) and torch.equal(vv[~written], ov[~written])
    # nothing outside the written rows changed
    changed = (new != before).any(dim=1)
    assert set(torch.nonzero(changed).flatten().tolist()) <= {1, 4}
    kv_write_ref_(arena, k, v, slots, 0, P * H * D, P)
    assert torch.equal(arena, new)


def test_ops_dispatch_to_reference_on_cpu():
    """CPU tensors default to the reference; an unknown `kernels` value is refused by name."""
    assert ops.default_kernels("cpu") == "reference"
    batch = make_paged_batch([2, 1], [9, 5], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                             window_left=3)
    assert torch.equal(ops.paged_attention(*batch.args()), paged_attention_ref(*batch.args()))
    k = torch.randn(3, 2, 16)
    slots = torch.tensor([0, -1, 6], dtype=torch.int32)
    offs = (batch.k_offset, batch.v_offset, 4)
    want = kv_write_ref(batch.arena, k, -k, slots, *offs)
    got = ops.kv_write(batch.arena, k, -k, slots, *offs)
    assert torch.equal(got, want) and not torch.equal(got, batch.arena)
    arena = batch.arena.clone()
    assert ops.kv_write_(arena, k, -k, slots, *offs) is None
    assert torch.equal(arena, want)
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of triton, reference"):
        ops.paged_attention(*batch.args(), kernels="cuda")


class _Layer(torch.nn.Module):
    def forward(self, arena, q, k, v, slots, cu_q, kv_lens, table, first):
        arena = ops.kv_write(arena, k, v, slots, 256, 384, 4)  # make_paged_batch's offsets for P=4,H=2,D=16
        return ops.paged_attention(q, arena, cu_q, kv_lens, table, first, 256, 384, 4, 2, 3, 1.0), arena


def test_export_and_compile_see_one_node_per_op():
    batch = make_paged_batch([2, 1], [9, 5], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    k = torch.randn(3, 2, 16)
    slots = torch.tensor([1, 2, 9], dtype=torch.int32)
    args = (batch.arena, batch.q, k, -k, slots, batch.cu_q, batch.kv_lens, batch.page_table, batch.first_page)
    ep = torch.export.export(_Layer(), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.g4rt.kv_write.default) == 1
    assert targets.count(torch.ops.g4rt.paged_attention.default) == 1
    eager = _Layer()(*args)
    compiled = torch.compile(_Layer(), backend="aot_eager", fullgraph=True)(*args)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
