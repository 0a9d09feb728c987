"""A one-byte (e4m3) KV arena with the kernels compiled for a Hopper GPU, at the models' shapes: the write's rounding
against torch's conversion on the device, and attention over the arena (prefill, the decode tiles of each batch,
the fused decode that norms, ropes and writes itself) against the fp32 reference reading the same arena. On CPU
the interpreter runs the same paths (tests/test_plugins_triton.py). Skipped off Hopper (the GPU session runs it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from fixtures import make_paged_batch  # noqa: E402
from g4rt.plugins import launch, window_left  # noqa: E402
from g4rt.plugins import triton_attention as ta  # noqa: E402
from g4rt.plugins import triton_kv_write as tkv  # noqa: E402
from g4rt.plugins import triton_norm as tn  # noqa: E402
from g4rt.plugins.reference import kv_write_ref, paged_attention_ref  # noqa: E402

pytestmark = pytest.mark.skipif(
    launch.interpreting() or not torch.cuda.is_available() or not launch.hopper(torch.device("cuda")),
    reason="the compiled kernels on a Hopper GPU (the interpreter's run of them: tests/test_plugins_triton.py)")

FP8 = torch.float8_e4m3fn


def test_the_write_rounds_as_torch_does_on_the_device():
    """Rows of every magnitude (bf16), ties, saturation, subnormals and signed zeros: the kernel's e4m3 bits equal
    reference.to_kv's (torch's conversion on the GPU after the clamp)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    T, H, D, P = 64, 16, 256, 16
    k, v = ((torch.randn(T, H, D, device="cuda", generator=g)
             * torch.exp(4 * torch.randn(T, H, D, device="cuda", generator=g))) for _ in range(2))
    edge = torch.tensor([0.0, -0.0, 448.0, 460.0, -1000.0, 2 ** -9, 2 ** -10, 3 * 2 ** -11, -2 ** -12, 1.0625,
                         1.1875, 0.96875, 100.0, -104.0], device="cuda")
    k.view(-1)[:edge.numel()] = edge
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    arena = torch.zeros(T + 3, 2 * P * H * D, device="cuda").to(FP8)
    slots = torch.randperm((T + 3) * P, device="cuda", generator=g)[:T].to(torch.int32)
    slots[::7] = -1
    want = kv_write_ref(arena, k, v, slots, 0, P * H * D, P)
    got = arena.clone()
    tkv.kv_write_(got, k, v, slots, 0, P * H * D, P)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# (name, q heads, KV heads, head dim, page, window, q lens, context)
CASES = [("e2b sliding decode b1", 8, 1, 256, 16, 512, [1], 300),
         ("e2b full decode b1", 8, 1, 512, 16, None, [1], 300),
         ("31b sliding decode b16", 32, 16, 256, 16, 1024, [1] * 16, 700),
         ("31b sliding decode b64", 32, 16, 256, 16, 1024, [1] * 64, 200),  # the fma tile (group 2)
         ("31b full decode b8", 32, 4, 512, 160, None, [1] * 8, 900),
         ("31b sliding prefill", 32, 16, 256, 16, 1024, [300, 1, 77], 400),
         ("31b full prefill", 32, 4, 512, 160, None, [300, 1, 77], 400)]  # tensor-memory copies, not Gluon


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_over_a_one_byte_arena_against_the_reference(case):
    _, hq, hkv, D, page, window, q_lens, context = case
    wl = -1 if window is None else window_left(window)
    g = torch.Generator().manual_seed(len(q_lens) * D)
    kv_lens = [max(q, context + int(torch.randint(-20, 20, (1,), generator=g))) for q in q_lens]
    batch = make_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=page,
                             window_left=wl, resident_only=wl >= 0, dtype=torch.bfloat16, device="cuda",
                             seed=len(q_lens), scale=D ** -0.5, kv_dtype=FP8)
    want = paged_attention_ref(batch.q.float(), *batch.args()[1:])
    args = list(batch.args())
    args[1] = batch.poisoned_arena()
    out = torch.full_like(batch.q, float("nan"))
    got = ta.paged_attention(*args, out=out)
    assert torch.isfinite(got).all(), "a row unwritten or a poisoned element read"
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("B, context", [(1, 300), (64, 200)])
def test_the_fused_decode_writes_and_reads_a_one_byte_arena(B, context):
    """The decode launch that norms, ropes and writes its rows (the 31B's sliding shape) on an e4m3 arena, against
    the q/k/v norm kernel, kv_write_ and paged_attention: the written rows within an e4m3 step of the norm
    kernel's (a bf16 ulp apart before the rounding may cross a tie), every other element untouched, the output
    within bf16 tolerance."""
    hq, hkv, D, page, wl = 32, 16, 256, 16, window_left(1024)
    g = torch.Generator().manual_seed(B)
    kv_lens = (context + torch.randint(-20, 20, (B,), generator=g)).tolist()
    batch = make_paged_batch([1] * B, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=page,
                             window_left=wl, resident_only=True, dtype=torch.bfloat16, device="cuda", seed=B,
                             scale=1.0, kv_dtype=FP8)
    slots = batch.own_slots()
    y, qw, kw, cos, sin = batch.decode_projection()
    rest = batch.args()[2:]
    three = batch.arena.clone()
    q, k, v = tn.qkv_norm_rope(y, qw, kw, 1e-6, cos, sin, hq, hkv, False)
    tkv.kv_write_(three, k, v, slots, batch.k_offset, batch.v_offset, page)
    want = ta.paged_attention(q, three, *rest)
    one = batch.arena.clone()
    out = torch.full_like(batch.q, float("nan"))
    got = ta.paged_attention(y, one, *rest, out=out, norms=ta.Norms(qw, kw, 1e-6, cos, sin, hq, False),
                             write=(None, None, slots))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert ((one.float() - three.float()).abs() <= 2 ** -3 * three.float().abs()).all()
    changed = one.view(torch.uint8) != batch.arena.view(torch.uint8)
    assert changed.any() and (changed <= (three.view(torch.uint8) != batch.arena.view(torch.uint8))).all()
