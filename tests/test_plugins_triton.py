"""The Triton kernels against the torch reference, run on CPU by the Triton interpreter.

Every comparison runs the kernel on a *poisoned* arena (NaN in every element no query may read:
other layers, padding, page tails, frames of no sequence, keys left of every window) into a
NaN-filled output, and the reference on the clean arena. So a finite, matching result proves the
kernel wrote every row and never let an out-of-range key into it. Shapes are small: the
interpreter costs ~0.1-0.3 s per launch here.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; `make test` sets it too

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.plugins import launch, ops, window_left  # noqa: E402
from g4rt.plugins import triton_attention as ta  # noqa: E402
from g4rt.plugins import triton_kv_write as tkv  # noqa: E402
from fixtures import make_paged_batch  # noqa: E402
from g4rt.plugins.reference import kv_write_ref, paged_attention_ref  # noqa: E402

if not launch.interpreting():
    pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (CPU has no GPU kernels)",
                pytrace=False)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FP8 = torch.float8_e4m3fn  # a one-byte KV arena (layout.KV_DTYPES)


@pytest.fixture
def launched(monkeypatch):
    """The constexprs of every attention launch the test makes, in order (launch_constexprs recorded)."""
    seen, real = [], ta.launch_constexprs
    monkeypatch.setattr(ta, "launch_constexprs", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    return seen


def check(batch, tol=None, **kernel_kw):
    """Kernel (poisoned arena, NaN output) vs reference (clean arena); returns the kernel output."""
    want = paged_attention_ref(*batch.args())
    args = list(batch.args())
    args[1] = batch.poisoned_arena()
    out = torch.full_like(batch.q, float("nan"))
    got = ta.paged_attention(*args, out=out, **kernel_kw)
    assert got is out
    assert torch.isfinite(got).all(), "kernel left a row unwritten or read a poisoned element"
    tol = tol if tol is not None else TOL[batch.q.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


def batch_of(q_lens, kv_lens, hq, hkv, d, p, wl=-1, resident=False, dtype=torch.float32, seed=0, scale=None,
             frame_pad=5, kv_dtype=None):
    return make_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
                            window_left=wl, resident_only=resident, dtype=dtype, seed=seed,
                            scale=d ** -0.5 if scale is None else scale, frame_pad=frame_pad, kv_dtype=kv_dtype)


# --- Gemma's head dims: sliding (256, window, resident tables) and full (512, group 8) ----------

@pytest.mark.parametrize("decode", [False, True])
def test_head_dim_256_sliding(decode):
    q_lens, kv_lens = ([1, 1], [40, 9]) if decode else ([1, 3], [40, 21])
    batch = batch_of(q_lens, kv_lens, 4, 2, 256, 16, wl=window_left(16), resident=True, seed=1)
    assert int(batch.first_page.max()) > 0
    check(batch, decode=decode, num_splits=2 if decode else None)


@pytest.mark.parametrize("decode", [False, True])
def test_head_dim_512_full_group_8(decode):
    q_lens, kv_lens = ([1, 1], [70, 5]) if decode else ([1, 2], [70, 5])
    check(batch_of(q_lens, kv_lens, 8, 1, 512, 64, seed=2), decode=decode, num_splits=3 if decode else None)


def test_gemma_scale_one():
    """Gemma 4 uses scale 1.0 (q/k norms): large logits, sharp softmax; fp32 must still agree."""
    check(batch_of([1, 2], [50, 30], 4, 2, 256, 16, scale=1.0, seed=3), tol=2e-4)


# --- GQA groups, both launch shapes ------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 2, 8, 16])
def test_gqa_groups_prefill(group):
    check(batch_of([1, 4, 2], [19, 4, 33], 2 * group, 2, 32, 16, seed=group))


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_gqa_groups_decode_split(group):
    check(batch_of([1, 1], [45, 12], group, 1, 32, 16, seed=group), num_splits=2)


def test_non_power_of_two_group():
    """Group 3 is padded to 4 rows per token; the padding rows must be dropped."""
    check(batch_of([1, 3], [20, 7], 6, 2, 16, 16, seed=5))
    check(batch_of([1, 1], [20, 7], 6, 2, 16, 16, seed=5), num_splits=2)


# --- sliding window ------------------------------------------------------------------------------

W = 8


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("resident", [False, True])
def test_window_boundary_decode(page_size, resident):
    """Decodes that see W-1, W and W+1 keys, and one far past the window."""
    batch = batch_of([1, 1, 1, 1], [W - 1, W, W + 1, 5 * W + 3], 4, 2, 16, page_size, wl=window_left(W),
                     resident=resident, seed=page_size)
    check(batch, num_splits=1)
    check(batch, num_splits=3)


@pytest.mark.parametrize("page_size", [4, 16])
def test_window_boundary_prefill(page_size):
    """Chunks ending at W-1, W and W+1 keys, and a chunk whose queries straddle the window edge
    (early queries see keys the later ones no longer see), over several key tiles and m-blocks."""
    batch = batch_of([3, 4, 5, 12], [W - 1, W, W + 1, 40], 4, 2, 16, page_size, wl=window_left(W),
                     resident=True, seed=7)
    check(batch, config={"rows": 16, "block_n": 16})  # 8 tokens per m-block: the chunk spans two
    check(batch)


# --- ragged batches, page sizes, precisions ---------------------------------------------------------

@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("wl", [-1, 20])
def test_ragged_mixed_batch(page_size, wl):
    """Decode and prefill sequences in one batch, shuffled frames, chunked prefill mid-sequence."""
    batch = batch_of([1, 5, 1, 17], [33, 5, 130, 40], 8, 2, 32, page_size, wl=wl, resident=wl >= 0, seed=11)
    check(batch, config={"rows": 32, "block_n": 16})


def test_decode_split_counts_including_empty_splits():
    batch = batch_of([1, 1, 1], [200, 50, 17], 4, 2, 32, 16, seed=12)
    outs = [check(batch, num_splits=s) for s in (1, 2, 5, 16)]  # 16 splits: short sequences get empty ones
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
def test_low_precision(dtype, decode):
    q_lens = [1, 1, 1] if decode else [1, 6, 2]
    batch = batch_of(q_lens, [70, 30, 9], 4, 2, 64, 16, wl=window_left(24), resident=True, dtype=dtype, seed=13)
    check(batch, decode=decode, num_splits=2 if decode else None)


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_decode_on_the_cuda_cores(launched, group, kv_dtype, splits):
    """`fma`: a decode's tile is its group's heads alone (rows 1: no MMA's 16-row padding) and its products are fp32
    on the CUDA cores, against the reference (poisoned arena), bf16 queries, either arena."""
    batch = batch_of([1, 1, 1], [70, 30, 9], 2 * group, 2, 64, 16, wl=window_left(24), resident=True,
                     dtype=torch.bfloat16, seed=17, kv_dtype=kv_dtype)
    check(batch, decode=True, num_splits=splits, config={"rows": 1, "fma": True})
    assert launched[-1]["PREC"] == "fma" and launched[-1]["BLOCK_Q"] == 1
    if splits > 1 and group == 2:  # the early tile (an arena on the line grid) on the CUDA cores too
        check(batch_of([1, 1], [40, 9], 4, 2, 256, 16, wl=window_left(16), resident=True, seed=1, frame_pad=0,
                       dtype=torch.bfloat16, kv_dtype=kv_dtype), decode=True, num_splits=2,
              config={"rows": 1, "fma": True})
        assert launched[-1]["EARLY"] and launched[-1]["PREC"] == "fma"


@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_the_fma_tile_with_a_pipelined_key_loop_gives_its_bits(launched, kv_dtype):
    """`pipe`: the fma tile's interior key loop handed to Triton's software pipeliner, `num_stages` deep (PIPE),
    reads the same keys into the same sums in the same order, so its bits are the plain tile's. The interpreter runs
    the loop plainly: this checks what reaches the kernel; tests/test_plugins_decode_gpu.py compares the compiled
    loops."""
    batch = batch_of([1] * 4, [70, 30, 9, 41], 4, 2, 64, 16, wl=window_left(24), resident=True,
                     dtype=torch.bfloat16, seed=19, kv_dtype=kv_dtype)
    plain = check(batch, decode=True, num_splits=1, config={"rows": 1, "fma": True})
    assert launched[-1]["PIPE"] is None
    piped = check(batch, decode=True, num_splits=1,
                  config={"rows": 1, "fma": True, "pipe": True, "num_stages": 3, "maxnreg": 128})
    assert launched[-1]["PIPE"] == 3 and launched[-1]["PREC"] == "fma"
    assert torch.equal(plain, piped)


def test_query_seeing_no_key_yields_zeros():
    batch = batch_of([3], [6], 2, 1, 16, 4, wl=1)
    batch.first_page[0] = 1  # keys start at 4; the chunk's first query (position 3) sees none
    batch.page_table[0, 0] = batch.page_table[0, 1]
    got = check(batch)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_decode_split_heuristic():
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU
    assert ta.decode_splits(1, 16, 256, 256, cpu) == 4  # short sliding context: >= 64 keys per split at D=256
    assert ta.decode_splits(1, 4, 256, 512, cpu) == 8  # >= 32 keys per split at D=512
    assert ta.decode_splits(1, 16, 1024, 256, cpu) == 16  # the sliding window
    assert ta.decode_splits(1, 1, 16, 256, cpu) == 1  # too few keys to split
    assert ta.decode_splits(1, 4, 262144, 512, cpu) == 64  # long full layer, one sequence
    assert ta.decode_splits(16, 4, 262144, 512, cpu) == 5  # 64 programs: about two waves
    assert ta.decode_splits(64, 16, 8192, 256, cpu) == 1  # enough programs already


def test_an_unsplit_decode_at_head_dim_256_takes_the_small_tile():
    """A decode with a program per SM or more (one split) at head dim 256 runs 32-key tiles over 2 warps, and
    from WIDE_DECODE programs an SM 16-key tiles over one warp, so several CTAs share an SM, or for a group of at
    most FMA_GROUP heads 8-key tiles on the CUDA cores (plugins/results, --decode-batch); split decodes and head
    dim 512 keep theirs.
    The batch here is such a decode (32 sequences x 8 KV heads, group 2, windowed, resident tables), on the three:
    poisoned arena, NaN output, against the reference in bf16."""
    assert ta.default_config(256, True, 2, splits=1) == {"rows": 16, "block_n": 32, "num_warps": 2, "num_stages": 2,
                                                         "interior": True}
    wide = ta.default_config(256, True, 2, splits=1, programs_per_sm=ta.WIDE_DECODE, group=ta.FMA_GROUP + 1)
    assert (wide["block_n"], wide["num_warps"]) == (16, 1)
    # a group of at most FMA_GROUP heads: 8-key tiles on the CUDA cores over one warp, either arena, their key loop
    # pipelined below PIPE_BELOW programs an SM (2 stages with bf16, 3 with e4m3) and plain from it
    for kv_bytes, stages in ((2, 2), (1, 3)):
        fma = ta.default_config(256, True, 2, splits=1, programs_per_sm=ta.WIDE_DECODE, kv_bytes=kv_bytes,
                                group=ta.FMA_GROUP)
        assert (fma["rows"], fma["block_n"], fma["num_warps"], fma.get("fma")) == (1, 8, 1, True)
        assert (fma.get("pipe"), fma["num_stages"]) == (True, stages)
        full = ta.default_config(256, True, 2, splits=1, programs_per_sm=ta.PIPE_BELOW, kv_bytes=kv_bytes,
                                 group=ta.FMA_GROUP)
        assert full.get("fma") and not full.get("pipe") and full["num_stages"] == 2
    assert ta.default_config(256, True, 2, splits=4, programs_per_sm=ta.WIDE_DECODE)["block_n"] == 64
    assert ta.default_config(512, True, 2, splits=1, programs_per_sm=ta.WIDE_DECODE)["num_warps"] == 4
    assert ta.default_config(256, True, 2, splits=4)["block_n"] == 64
    assert ta.default_config(512, True, 2, splits=1)["block_n"] == 32
    assert ta.default_config(512, True, 2, splits=1)["num_warps"] == 4
    # a one-byte arena: 3-stage 16-key tiles over 2 warps from WIDE_DECODE programs an SM, one-stage 32-key at D=512
    fp8 = ta.default_config(256, True, 2, splits=1, programs_per_sm=ta.WIDE_DECODE, kv_bytes=1, group=4)
    assert (fp8["block_n"], fp8["num_warps"], fp8["num_stages"]) == (16, 2, 3)
    assert ta.default_config(256, True, 2, splits=1, kv_bytes=1)["block_n"] == 32
    assert ta.default_config(512, True, 2, splits=1, kv_bytes=1)["num_stages"] == 1
    assert ta.default_config(512, True, 2, splits=2, kv_bytes=1)["num_stages"] == 2
    batch = batch_of([1] * 32, [40 + 7 * i for i in range(32)], 16, 8, 256, 16, wl=window_left(64), resident=True,
                     dtype=torch.bfloat16, seed=9)
    assert ta.decode_splits(32, 8, batch.page_table.shape[1] * 16, 256, batch.q.device) == 1
    check(batch, decode=True)
    check(batch, decode=True, config={k: wide[k] for k in ("block_n", "num_warps", "num_stages")})
    check(batch, decode=True, config=fma)


def test_decode_padded_to_graph_buckets_gives_the_same_bits():
    """The CUDA-graph engine pads a decode batch with dummy sequences (to a power-of-two count) and
    its tables with zero columns (to a power-of-two width); the real rows must not change by a bit,
    or the compiled engine's greedy tokens drift from eager's."""
    batch = batch_of([1, 1, 1], [700, 75, 333], 4, 2, 64, 16, dtype=torch.float32, seed=5)
    q, arena, cu_q, kv_lens, table, first, *rest = batch.args()
    eager = ta.paged_attention(q, arena, cu_q, kv_lens, table, first, *rest)
    # unbucketed, the two calls would split differently (2 and 4 runs)
    assert ta.decode_splits(3, 2, table.shape[1] * 16, 64, q.device) != ta.decode_splits(4, 2, 64 * 16, 64, q.device)
    pad = lambda t, rows, cols=0: torch.nn.functional.pad(t, (0, cols, 0, rows)) if t.dim() == 2 else \
        torch.nn.functional.pad(t, (0, rows))  # noqa: E731
    padded = ta.paged_attention(
        torch.cat([q, torch.zeros_like(q[:1])]), arena, torch.arange(5, dtype=torch.int32),
        torch.cat([kv_lens, torch.ones_like(kv_lens[:1])]), pad(table, 1, 64 - table.shape[1]), pad(first, 1), *rest)
    assert torch.equal(padded[:3], eager)


# --- KV write ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_reference(dtype):
    P, H, D = 16, 3, 16  # width 48: not a power of two, the block mask matters
    arena = torch.randn(5, 2 * P * H * D + 7).to(dtype)
    k, v = torch.randn(6, H, D).to(dtype), torch.randn(6, H, D).to(dtype)
    slots = torch.tensor([3 * P + 2, -1, 0, 4 * P + 15, -1, P + 7], dtype=torch.int32)
    want = kv_write_ref(arena, k, v, slots, 7, 7 + P * H * D, P)
    got = arena.clone()
    tkv.kv_write_(got, k, v, slots, 7, 7 + P * H * D, P)
    assert torch.equal(got, want)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_to_a_one_byte_arena_rounds_as_the_reference(dtype):
    """K/V rows into an e4m3 arena: reference.to_kv's bits (ties to even, saturation at 448, subnormals, the sign
    of zero) from fp32 and bf16 rows of every magnitude, where the interpreter's own fp8 cast drops carries."""
    P, H, D = 16, 3, 16
    edge = torch.tensor([0.0, -0.0, 448.0, 460.0, -1000.0, 2 ** -9, 2 ** -10, 3 * 2 ** -11, -2 ** -12, 1.0625,
                         1.1875, 0.96875, 100.0, -104.0, 30.0, float("inf")])
    g = torch.Generator().manual_seed(41)
    k, v = ((torch.randn(6, H, D, generator=g) * torch.exp(3 * torch.randn(6, H, D, generator=g))) for _ in range(2))
    k.view(-1)[:edge.numel()] = edge
    v.view(-1)[-edge.numel():] = -edge
    k, v = k.to(dtype), v.to(dtype)
    arena = torch.randn(5, 2 * P * H * D + 7).to(FP8)
    slots = torch.tensor([3 * P + 2, -1, 0, 4 * P + 15, -1, P + 7], dtype=torch.int32)
    want = kv_write_ref(arena, k, v, slots, 7, 7 + P * H * D, P)
    got = arena.clone()
    tkv.kv_write_(got, k, v, slots, 7, 7 + P * H * D, P)
    assert torch.equal(_bits(got), _bits(want))
    assert want.float().abs().max() == 448 and (_bits(want) == 0x80).any()  # saturated and -0 rows were written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode, splits", [(False, None), (True, 1), (True, 3)])
def test_a_one_byte_arena_is_read_as_the_reference_reads_it(dtype, decode, splits):
    """Attention over an e4m3 arena: the keys and values widened to the query's dtype, against the reference on
    the same arena (poisoned elsewhere); prefill and a decode cut over its keys or not."""
    q_lens = [1, 1, 1] if decode else [1, 6, 2]
    batch = batch_of(q_lens, [70, 30, 9], 4, 2, 64, 16, wl=window_left(24), resident=True, dtype=dtype, seed=13,
                     kv_dtype=FP8)
    check(batch, decode=decode, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype,wl,kv_dtype", [(torch.float32, -1, None), (torch.bfloat16, window_left(24), None),
                                               (torch.bfloat16, window_left(24), FP8)])
def test_a_decode_launch_writes_the_step_rows_itself(splits, dtype, wl, kv_dtype):
    """A decode's attention launch with `write` stores the step's K/V rows before it reads them: the same bits in
    the output and the arena as kv_write_ then paged_attention. The own keys' rows start as NaN, so a kernel
    that read one before writing it would give a NaN row; a slot of -1 (a padded graph row) writes nothing and
    reads what the arena holds, in both."""
    batch = batch_of([1, 1, 1, 1], [40, 9, 61, 16], 4, 2, 32, 16, wl=wl, resident=wl >= 0, dtype=dtype, seed=23,
                     kv_dtype=kv_dtype)
    slots = batch.own_slots()
    slots[2] = -1
    g = torch.Generator().manual_seed(24)
    k, v = (torch.randn(4, 2, 32, generator=g).to(dtype) for _ in range(2))
    arena = batch.poisoned_arena().float()
    for s in slots[slots >= 0].tolist():  # the rows the step writes start as NaN
        f, r = divmod(s, batch.page_size)
        for off in (batch.k_offset, batch.v_offset):
            arena[f, off + r * 64: off + (r + 1) * 64] = float("nan")
    arena = arena.to(batch.arena.dtype)
    two = arena.clone()
    tkv.kv_write_(two, k, v, slots, batch.k_offset, batch.v_offset, batch.page_size)
    args = list(batch.args())
    args[1] = two
    want = ta.paged_attention(*args, num_splits=splits)
    one = arena.clone()
    args[1] = one
    out = torch.full_like(batch.q, float("nan"))
    got = ta.paged_attention(*args, num_splits=splits, out=out, write=(k, v, slots))
    assert torch.isfinite(got[[0, 1, 3]]).all()
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(one), _bits(two))
    with pytest.raises(ValueError, match="write: only a decode launch"):
        ta.paged_attention(*args, decode=False, write=(k, v, slots))


def test_the_write_attention_op_is_the_two_ops():
    """`g4rt::kv_write_attention_` with the Triton kernels (one launch at decode, two otherwise) and with the
    reference: the arena and output kv_write_ and paged_attention give."""
    for q_lens, kv_lens in (([1, 1], [33, 70]), ([1, 5, 2], [33, 5, 70])):
        batch = batch_of(q_lens, kv_lens, 4, 2, 16, 16, wl=window_left(20), resident=True, seed=29)
        T = sum(q_lens)
        g = torch.Generator().manual_seed(30)
        k, v = torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, 16, generator=g)
        slots = torch.full((T,), -1, dtype=torch.int32)
        last = batch.cu_q[1:].long() - 1
        slots[last] = batch.own_slots()  # each sequence's last query writes its key; the others nothing
        offs = (batch.k_offset, batch.v_offset, batch.page_size)
        want_arena = batch.arena.clone()
        ops.kv_write_(want_arena, k, v, slots, *offs, kernels="triton")
        args = list(batch.args())
        args[1] = want_arena
        want = ops.paged_attention(*args, kernels="triton")
        for kernels in ("triton", "reference"):
            arena = batch.arena.clone()
            got = torch.ops.g4rt.kv_write_attention_(arena, k, v, slots, batch.q, *batch.args()[2:], kernels)
            tol = 0 if kernels == "triton" else 2e-5
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            torch.testing.assert_close(arena, want_arena, atol=0, rtol=0)


@pytest.mark.parametrize("tile", [None, "fma"])
@pytest.mark.parametrize("frame_pad", [5, 0])  # 0 with fp32: the early tile (rows on the line grid) runs too
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype,heads,kv_dtype", [(torch.float32, "kv", None), (torch.bfloat16, "k_eq_v", None),
                                                  (torch.bfloat16, "q", None), (torch.bfloat16, "kv", FP8)])
def test_a_decode_launch_norms_and_ropes_its_q_and_rows_itself(launched, splits, dtype, heads, kv_dtype, frame_pad,
                                                                tile):
    """A decode's attention launch from a layer's packed projection (`norms`) gives the bits of the q/k/v norm
    kernel, kv_write_ and paged_attention: the output, and the arena where the layer owns a cache ("kv", "k_eq_v";
    "q": a KV-shared layer, which writes nothing). The own rows start as NaN; a -1 slot writes nothing. On the
    default tiles of this small batch and on the `fma` one a wide decode of a group of 2 takes."""
    from g4rt.plugins import triton_norm as tn
    hq, hkv, D = 4, 2, 32
    batch = batch_of([1, 1, 1], [40, 9, 61], hq, hkv, D, 16, wl=window_left(24), resident=True, dtype=dtype, seed=31,
                     frame_pad=frame_pad, kv_dtype=kv_dtype)
    slots = batch.own_slots()
    slots[1] = -1
    g = torch.Generator().manual_seed(32)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    width = (hq if heads == "q" else hq + (1 if heads == "k_eq_v" else 2) * hkv) * D
    y = rand(3, width + 8)[:, :width]  # row stride past the width, as a packed projection's view may have
    qw, kw = rand(D) + 1, None if heads == "q" else rand(D) + 1
    cos, sin = rand(3, D), rand(3, D)
    arena = batch.poisoned_arena().float()
    for s in slots[slots >= 0].tolist() if kw is not None else ():  # a KV-shared layer reads rows written before
        f, r = divmod(s, batch.page_size)
        for off in (batch.k_offset, batch.v_offset):
            arena[f, off + r * hkv * D: off + (r + 1) * hkv * D] = float("nan")
    arena = arena.to(batch.arena.dtype)
    args = list(batch.args())
    three = arena.clone()
    args[1] = three
    config = ta.default_config(D, True, 2, programs_per_sm=ta.WIDE_DECODE, group=hq // hkv) if tile else None
    if kw is None:
        want = ta.paged_attention(tn.q_norm_rope(y, qw, 1e-6, cos, sin), *args[1:], num_splits=splits, config=config)
    else:
        q, k, v = tn.qkv_norm_rope(y, qw, kw, 1e-6, cos, sin, hq, hkv, heads == "k_eq_v")
        tkv.kv_write_(three, k, v, slots, batch.k_offset, batch.v_offset, batch.page_size)
        want = ta.paged_attention(q, *args[1:], num_splits=splits, config=config)
    one = arena.clone()
    args[1] = one
    norms = ta.Norms(qw, kw, 1e-6, cos, sin, hq, heads == "k_eq_v")
    got = ta.paged_attention(y, *args[1:], num_splits=splits, norms=norms, config=config,
                             write=None if kw is None else (None, None, slots))
    assert (launched[-1]["PREC"] == "fma") == bool(tile) and (launched[-1]["BLOCK_N"] == 8) == bool(tile)
    assert torch.isfinite(got[[0, 2]]).all()
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(one), _bits(three))
    with pytest.raises(ValueError, match="only a decode launch"):
        ta.paged_attention(y, *args[1:], decode=False, norms=norms, write=None if kw is None else (None, None, slots))
    with pytest.raises(ValueError, match="norms: write must be"):
        ta.paged_attention(y, *args[1:], norms=norms, write=(None, None, slots) if kw is None else None)


@pytest.mark.parametrize("D, kv_lens, q_lens, fused", [(256, [70, 100], [1, 1], True), (16, [33, 70], [1, 1], False),
                                                     (16, [33, 5, 70], [1, 5, 2], False)])
def test_the_projected_attention_op_is_the_norms_then_the_write_attention(monkeypatch, D, kv_lens, q_lens, fused):
    """`g4rt::projected_attention_`: the arena and output of the three kernels (the norm kernel, kv_write_,
    paged_attention), in one launch for a decode cut over its keys (head dim 256, 128 keys a table: two runs), as
    the norm kernel and the writing attention launch for a decode of one run a head, and as the three for a mixed
    step."""
    from g4rt.plugins import triton_norm as tn
    batch = batch_of(q_lens, kv_lens, 4, 2, D, 16, wl=window_left(200), resident=True, seed=37)
    assert (ta.step_splits(len(kv_lens), batch.page_table, 16, batch.window_left, 2, D) > 1) == fused
    T = sum(q_lens)
    g = torch.Generator().manual_seed(38)
    y, qw, kw = torch.randn(T, 8 * D, generator=g), torch.randn(D, generator=g), torch.randn(D, generator=g)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    slots = torch.full((T,), -1, dtype=torch.int32)
    slots[batch.cu_q[1:].long() - 1] = batch.own_slots()
    offs = (batch.k_offset, batch.v_offset, batch.page_size)
    q, k, v = tn.qkv_norm_rope(y, qw, kw, 1e-6, cos, sin, 4, 2, False)
    want_arena = batch.arena.clone()
    tkv.kv_write_(want_arena, k, v, slots, *offs)
    want = ta.paged_attention(q, want_arena, *batch.args()[2:])
    launches = []
    real = tkv.paged_attention
    monkeypatch.setattr(tkv, "paged_attention", lambda *a, **kw: launches.append(kw.get("norms")) or real(*a, **kw))
    arena = batch.arena.clone()
    got = torch.ops.g4rt.projected_attention_(arena, y, qw, kw, 1e-6, cos, sin, 4, False, slots,
                                              *batch.args()[2:6], *offs, 2, batch.window_left, batch.scale)
    assert torch.equal(got, want) and torch.equal(arena, want_arena)
    assert [n is not None for n in launches] == [fused]


def test_ops_with_triton_kernels(monkeypatch):
    """kernels="triton" sends CPU tensors through the op to the kernels (under the interpreter)."""
    calls = []
    real = ta.paged_attention
    monkeypatch.setattr(ta, "paged_attention", lambda *a: calls.append(1) or real(*a))
    batch = batch_of([1, 3], [21, 9], 4, 2, 16, 16, wl=6, resident=True, seed=17)
    got = ops.paged_attention(*batch.args(), kernels="triton")
    assert calls == [1]
    torch.testing.assert_close(got, paged_attention_ref(*batch.args()), atol=2e-5, rtol=2e-5)
    k = torch.randn(2, 2, 16)
    slots = torch.tensor([5, -1], dtype=torch.int32)
    offs = (batch.k_offset, batch.v_offset, 16)
    want = kv_write_ref(batch.arena, k, k + 1, slots, *offs)
    assert torch.equal(ops.kv_write(batch.arena, k, k + 1, slots, *offs, kernels="triton"), want)
    arena = batch.arena.clone()
    ops.kv_write_(arena, k, k + 1, slots, *offs, kernels="triton")
    assert torch.equal(arena, want)
    ops.paged_attention(*batch.args(), kernels="reference")
    assert calls == [1]  # the reference did not call the kernel


def test_no_dependent_launch_off_hopper():
    """`pdl`: programmatic dependent launch only on a CUDA device of compute capability 9 or more, and
    never under the interpreter (no grid dependency control there); the kernels then take the plain
    launch, as every test here runs them."""
    cpu = torch.device("cpu")
    assert launch.interpreting() and not launch.pdl(cpu) and launch.pdl_launch(cpu) == {"PDL": False, "launch_pdl": False}


def test_which_launches_take_the_gluon_kernel():
    """`takes_wgmma`, from shapes alone: the 2-byte head-dim-512 prefill default of a layer without a window on
    pages its 32-key tile divides (every Gemma 4 size's full layers: pages of 32 or 160 tokens); never a decode,
    a window, another head dim, fp32 (whose default has no `wgmma`), an explicit False, a page of 48 or 16, or
    a group over its 64 rows.
    On CPU the launch then still runs this module's kernel (the dispatch also asks for a Hopper GPU: every
    other test here runs a head-dim-512 prefill through it)."""
    def takes(d=512, decode=False, wl=-1, elem=2, group=8, page=160, **over):
        return ta.takes_wgmma({**ta.default_config(d, decode, elem), **over}, decode, wl, d, elem, group, page)

    assert takes() and takes(group=4, page=64) and takes(elem=2, group=64, page=32)
    assert not any([takes(decode=True), takes(wl=511), takes(d=256), takes(elem=4), takes(wgmma=False),
                    takes(page=48), takes(group=128), takes(d=512, elem=2, group=8, page=16)])


@pytest.mark.parametrize("capability, taken", [((9, 0), True), ((10, 0), False), ((12, 0), False), ((8, 0), False)])
def test_the_gluon_kernel_only_on_compute_capability_9(monkeypatch, capability, taken):
    """`warpgroup_mma` exists on sm_90 only: a launch on a GPU of compute capability 10 or 12 (and before 9) takes
    this module's kernel, while dependent launches and tensor-memory copies (`hopper`) stay on from 9 up."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(ta, "interpreting", lambda: False)
    ta.sm90.cache_clear()
    ta.hopper.cache_clear()
    try:
        cfg = ta.default_config(512, False, 2)
        assert ta.takes_wgmma(cfg, False, -1, 512, 2, 8, 160) is True  # the shape alone
        assert ta.takes_wgmma(cfg, False, -1, 512, 2, 8, 160, cuda) is taken
        assert ta.hopper(cuda) is (capability[0] >= 9)
    finally:
        ta.sm90.cache_clear()
        ta.hopper.cache_clear()


@pytest.mark.parametrize("wl", [-1, 29])
@pytest.mark.parametrize("dv_split", [1, 2, 4])
def test_prefill_interior_tiles_and_column_split(wl, dv_split):
    """Long chunks: key tiles that every row of a query tile sees run without masks (a wrong bound
    would let a poisoned key in), and the output columns cut across 1, 2 or 4 programs agree."""
    batch = batch_of([40, 1, 23], [100, 64, 23], 4, 2, 64, 16, wl=wl, resident=wl >= 0, seed=13)
    got = check(batch, config={"rows": 16, "block_n": 16, "dv_split": dv_split})
    masked = check(batch, config={"rows": 16, "block_n": 16, "dv_split": dv_split, "interior": False})
    assert torch.equal(got, masked)  # skipping an all-true mask changes no bit
    with pytest.raises(ValueError, match="dv_split"):
        ta.paged_attention(*batch.args(), config={"dv_split": 3})


@pytest.mark.parametrize("dv_split", [1, 2])
def test_prefill_interior_tiles_by_tensor_memory_copies(monkeypatch, dv_split):
    """`tma`: a full layer's interior key tiles come through tensor-memory copy descriptors, to the bit what
    the element loads give (the poisoned page tails and frames stay unread: the edge tiles keep the masked
    loads); an arena whose frame stride is off the 16-byte grid, a page that block_n does not divide, or a
    window keep every tile on the element loads."""
    taken = []
    descriptors = ta.kv_descriptors
    monkeypatch.setattr(ta, "kv_descriptors", lambda *a: taken.append(descriptors(*a)) or taken[-1])
    config = {"rows": 16, "block_n": 16, "dv_split": dv_split}
    batch = batch_of([40, 1, 23], [100, 64, 23], 4, 2, 64, 32, seed=13, frame_pad=8)
    got = check(batch, config={**config, "tma": True})
    assert len(taken) == 1 and taken[0] is not None
    assert [list(t.block_shape) for t in taken[0]] == [[1, 16, 64], [1, 16, 64 // dv_split]]
    assert torch.equal(got, check(batch, config=config))
    for case, cfg, copies in [(batch_of([40, 1, 23], [100, 64, 23], 4, 2, 64, 32, seed=13), config, [False]),
                              (batch, {**config, "block_n": 64}, []),  # takes_copies: never asked
                              (batch, {**config, "rows": 32, "block_n": 32}, [True])]:
        taken.clear()
        check(case, config={**cfg, "tma": True})
        assert [t is not None for t in taken] == copies
    taken.clear()
    check(batch_of([40, 1], [100, 64], 4, 2, 64, 32, wl=29, resident=True, seed=3, frame_pad=8),
          config={**config, "tma": True})
    assert taken == []  # a window: never asked


def test_the_early_tile_only_where_a_key_row_is_whole_cache_lines():
    """A decode takes the early tile (its first K tile read before its wait) where a key's row of the arena is
    whole 128-byte lines: every Gemma 4 head dim (256, 512) in bf16; not at head dim 32 in bf16, nor a prefill."""
    def early(d, fp32=False, decode=True):
        cfg = ta.default_config(d, decode, 4 if fp32 else 2)
        return ta.launch_constexprs(cfg, num_q_heads=8, num_kv_heads=2, head_dim=d, page_size=16, num_splits=2,
                                    fp32=fp32, copies=False, decode=decode)["EARLY"]
    assert early(256) and early(512) and early(64) and early(32, fp32=True)
    assert not early(32) and not early(16, fp32=True) and not early(256, decode=False)
    # an arena off the 128-byte grid (a hand-made one: the tests' fixtures pad the frame to an odd stride) never
    assert ta.early_rows(256, 2, 8192, 12288, 16384) and not ta.early_rows(256, 2, 8192, 12288, 16389)
    assert not ta.early_rows(256, 2, 8200, 12288, 16384) and not ta.early_rows(256, 2, 8192, 12290, 16384)


@pytest.mark.parametrize("kv_dtype", [None, FP8])
@pytest.mark.parametrize("frame_pad, early", [(0, True), (5, False)])
def test_an_arena_on_the_line_grid_decodes_through_the_early_tile(launched, frame_pad, early, kv_dtype):
    """The early tile runs (and matches the reference, poisoned arena) where the arena's offsets and frame stride are
    whole 128-byte lines; a frame padded off that grid takes the plain loop (the GPU's bulk L2 request for V
    would fault on such an address, and the L1 argument would not hold)."""
    check(batch_of([1, 1], [40, 9], 4, 2, 256, 16, wl=window_left(16), resident=True, seed=1, frame_pad=frame_pad,
                   kv_dtype=kv_dtype), decode=True, num_splits=2)
    assert [c["EARLY"] for c in launched] == [early]


@pytest.mark.parametrize("name", ["arena", "page_table"])
def test_a_strided_last_dim_is_refused_by_name(name):
    batch = batch_of([3], [20], 4, 2, 32, 4)
    args = list(batch.args())
    i = 1 if name == "arena" else 4
    args[i] = torch.repeat_interleave(args[i], 2, dim=1)[:, ::2]
    with pytest.raises(ValueError, match=f"^{name} must be contiguous in its last dim, got strides"):
        ta.paged_attention(*args)
