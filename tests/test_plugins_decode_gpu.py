"""The decode launch that norms, ropes and writes itself (`paged_attention(norms=...)`), compiled for a Hopper GPU at
the models' shapes, against the three launches it replaces: the q/k/v norm kernel, kv_write_ and paged_attention.
On CPU the interpreter runs these paths bit for bit (tests/test_plugins_triton.py); compiled, the fused norm sums in
another order than the norm kernel's, so q and the written rows may differ by a bf16 ulp, and the output by its
rounding. Skipped off Hopper (the GPU session runs it)."""
from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from fixtures import make_paged_batch  # noqa: E402
from g4rt.plugins import launch, window_left  # noqa: E402
from g4rt.plugins import triton_attention as ta  # noqa: E402
from g4rt.plugins import triton_kv_write as tkv  # noqa: E402
from g4rt.plugins import triton_norm as tn  # noqa: E402
from g4rt.plugins.reference import paged_attention_ref  # noqa: E402

pytestmark = pytest.mark.skipif(
    launch.interpreting() or not torch.cuda.is_available() or not launch.hopper(torch.device("cuda")),
    reason="the compiled kernels on a Hopper GPU (the interpreter's run of them: tests/test_plugins_triton.py)")

# (name, q heads, KV heads, head dim, page, window, batch, context, k_eq_v, owns a cache)
CASES = [("e2b sliding", 8, 1, 256, 16, 512, 1, 300, False, True),
         ("e2b kv-shared sliding", 8, 1, 256, 16, 512, 1, 300, False, False),
         ("e2b full", 8, 1, 512, 16, None, 1, 300, False, True),
         ("31b sliding b16", 32, 16, 256, 16, 1024, 16, 700, False, True),
         ("31b sliding b64", 32, 16, 256, 16, 1024, 64, 200, False, True),  # the fma tile (group 2)
         ("31b full b8", 32, 4, 512, 160, None, 8, 900, True, True)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_fused_decode_launch_against_the_three_it_replaces(case):
    _, hq, hkv, D, page, window, B, context, k_eq_v, owns = case
    wl = -1 if window is None else window_left(window)
    g = torch.Generator().manual_seed(zlib.crc32(case[0].encode()) % 1000)  # str hash() changes per process
    kv_lens = (context + torch.randint(-20, 20, (B,), generator=g)).tolist()
    batch = make_paged_batch([1] * B, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=page,
                             window_left=wl, resident_only=wl >= 0, dtype=torch.bfloat16, device="cuda", seed=B,
                             scale=1.0)
    slots = batch.own_slots()
    y, qw, kw, cos, sin = batch.decode_projection(owns, k_eq_v)
    arena = batch.arena.clone()
    if owns:  # the rows the step writes start as NaN
        f, r = (slots // page).long(), (slots % page).long()
        for off in (batch.k_offset, batch.v_offset):
            cols = off + r[:, None] * hkv * D + torch.arange(hkv * D, device="cuda")[None, :]
            arena[f[:, None], cols] = float("nan")
    rest = batch.args()[2:]
    three = arena.clone()
    if owns:
        q, k, v = tn.qkv_norm_rope(y, qw, kw, 1e-6, cos, sin, hq, hkv, k_eq_v)
        tkv.kv_write_(three, k, v, slots, batch.k_offset, batch.v_offset, page)
    else:
        q = tn.q_norm_rope(y, qw, 1e-6, cos, sin)
    want = ta.paged_attention(q, three, *rest)
    one = arena.clone()
    out = torch.full_like(batch.q, float("nan"))
    got = ta.paged_attention(y, one, *rest, out=out, norms=ta.Norms(qw, kw, 1e-6, cos, sin, hq, k_eq_v),
                             write=(None, None, slots) if owns else None)
    assert torch.isfinite(got).all() and torch.isfinite(one).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # the written rows within a bf16 ulp of the norm kernel's, every other element untouched
    assert ((one.float() - three.float()).abs() <= 2 ** -7 * three.float().abs()).all()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("B", [64, 128])
def test_the_pipelined_fma_tile_gives_the_plain_tiles_bits(kv_dtype, stages, B):
    """The fma tile's key loop software-pipelined (`pipe`: K, V and their page-table entries read by asynchronous
    copies stages - 1 tiles ahead) sums the same products in the same order as the plain tile, whose loads wait
    tile by tile: the same bits, compiled, for the 31B's sliding layer at serving batches, plain and fused (norms,
    RoPE and the KV write in the launch); and the plain tile against the fp32 reference."""
    hq, hkv, D, page, wl = 32, 16, 256, 16, window_left(1024)
    g = torch.Generator().manual_seed(B + stages)
    kv_lens = (200 + torch.randint(-40, 40, (B,), generator=g)).tolist()
    batch = make_paged_batch([1] * B, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=page,
                             window_left=wl, resident_only=True, dtype=torch.bfloat16, device="cuda", seed=B,
                             scale=D ** -0.5, kv_dtype=kv_dtype)
    plain_cfg = {"rows": 1, "fma": True, "block_n": 8, "num_warps": 1, "num_stages": stages}
    piped_cfg = {**plain_cfg, "pipe": True}
    args = list(batch.args())
    args[1] = batch.poisoned_arena()
    plain, piped = (ta.paged_attention(*args, out=torch.full_like(batch.q, float("nan")), config=c, num_splits=1)
                    for c in (plain_cfg, piped_cfg))
    assert torch.isfinite(plain).all() and torch.equal(plain, piped)
    want = paged_attention_ref(batch.q.float(), *batch.args()[1:])
    torch.testing.assert_close(plain.float(), want, atol=2e-2, rtol=2e-2)
    slots = batch.own_slots()
    y, qw, kw, cos, sin = batch.decode_projection()
    fused = []
    for c in (plain_cfg, piped_cfg):
        arena = batch.arena.clone()
        out = ta.paged_attention(y, arena, *batch.args()[2:], out=torch.full_like(batch.q, float("nan")),
                                 norms=ta.Norms(qw, kw, 1e-6, cos, sin, hq, False), write=(None, None, slots),
                                 config=c, num_splits=1)
        fused.append((out, arena))
    assert torch.isfinite(fused[0][0]).all() and torch.equal(fused[0][0], fused[1][0])
    assert torch.equal(fused[0][1].view(torch.uint8), fused[1][1].view(torch.uint8))
