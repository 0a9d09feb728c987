"""The Gluon head-dim-512 prefill kernel (plugins/gluon_attention.py) against the torch reference, on a Hopper GPU.

Gluon has no interpreter, so on CPU (CI) these tests are skipped with that reason; what CI checks of this kernel
is that it compiles for sm_90 within the registers and shared memory a block may have
(tests/test_bench_compile_report.py). On the H200: `python -m pytest tests/test_plugins_gluon.py` without
TRITON_INTERPRET. As in test_plugins_triton.py, each launch reads a poisoned arena (NaN wherever no query may
read: page tails past a sequence's length, other layers, frames of no sequence) into a NaN-filled output.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.plugins import gluon_attention as ga  # noqa: E402
from g4rt.plugins import launch  # noqa: E402
from g4rt.plugins import triton_attention as ta  # noqa: E402
from fixtures import make_paged_batch  # noqa: E402
from g4rt.plugins.reference import paged_attention_ref  # noqa: E402

pytestmark = pytest.mark.skipif(
    launch.interpreting() or not torch.cuda.is_available() or not launch.hopper(torch.device("cuda")),
    reason="the Gluon kernel runs on a Hopper GPU only (no interpreter); CI compiles it for sm_90 instead")

# (q_lens, kv_lens, q heads, KV heads, page): partial last tiles (kv_len % 32 != 0), a sequence shorter than a
# tile, whole tiles only, chunks after a prefix, one-token rows of a mixed batch, groups of 8, 4 and 6 (padded).
CASES = [
    ([300, 1, 77, 40, 33], [300, 161, 237, 40, 353], 32, 4, 160),
    ([20, 64], [20, 320], 32, 4, 160),
    ([2048], [2048 + 480], 32, 4, 160),
    ([129, 5], [129, 517], 8, 2, 64),
    ([100], [131], 12, 2, 32),
]


@pytest.mark.parametrize("q_lens, kv_lens, hq, hkv, page", CASES)
def test_gluon_prefill_matches_reference(monkeypatch, q_lens, kv_lens, hq, hkv, page):
    taken = []
    launch = ga.prefill_attention
    monkeypatch.setattr(ga, "prefill_attention", lambda *a: taken.append(1) or launch(*a))
    batch = make_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=512, page_size=page,
                             dtype=torch.bfloat16, device="cuda", seed=len(q_lens) + page, scale=512 ** -0.5,
                             frame_pad=8)
    want = paged_attention_ref(*batch.args())
    args = list(batch.args())
    args[1] = batch.poisoned_arena()
    out = torch.full_like(batch.q, float("nan"))
    got = ta.paged_attention(*args, out=out, config={"wgmma": True})
    assert taken == [1], "the launch did not take the Gluon kernel"
    assert got is out and torch.isfinite(got).all(), "a row left unwritten or a poisoned key read"
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    again = ta.paged_attention(*args, out=torch.full_like(batch.q, float("nan")), config={"wgmma": True})
    assert torch.equal(got, again)  # fixed order of sums: the same bits every launch
    triton_kernel = ta.paged_attention(*args, config={"wgmma": False})
    assert taken == [1, 1]
    torch.testing.assert_close(got.float(), triton_kernel.float(), atol=2e-2, rtol=2e-2)


def test_gluon_prefill_refusals(monkeypatch):
    """A window, a decode, a head dim other than 512, an arena off the copy engine's 16-byte grid, a page the
    key tile does not divide or `wgmma` false keep the Triton kernel; the default config takes the Gluon one."""
    taken = []
    launch = ga.prefill_attention
    monkeypatch.setattr(ga, "prefill_attention", lambda *a: taken.append(1) or launch(*a))

    def run(q_lens, kv_lens, d=512, page=160, wl=-1, frame_pad=8, decode=None, config=None):
        b = make_paged_batch(q_lens, kv_lens, num_q_heads=8, num_kv_heads=2, head_dim=d, page_size=page,
                             window_left=wl, dtype=torch.bfloat16, device="cuda", scale=d ** -0.5,
                             frame_pad=frame_pad)
        got = ta.paged_attention(*b.args(), config=config or {"wgmma": True}, decode=decode)
        torch.testing.assert_close(got.float(), paged_attention_ref(*b.args()).float(), atol=2e-2, rtol=2e-2)

    run([40], [100], wl=29)
    run([1, 1], [100, 7], decode=True)
    run([40], [100], d=256)
    run([40], [100], frame_pad=5)
    run([40], [100], page=48)
    run([40], [100], config={"wgmma": False})
    assert taken == []
    run([40], [100], config={})  # the default takes it
    assert taken == [1]
