"""RMSNorm and gated-GELU kernels (plugins/triton_norm.py) against the torch reference, under the
Triton interpreter, and the custom ops' dispatch.

The kernels sum in another order than torch, so a bf16 output may differ from the reference by one
ulp of its own magnitude, never more; fp32 outputs agree to a few fp32 ulps.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; `make test` sets it too

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.models import blocks as reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp -> inf is the intent
from g4rt.plugins import triton_norm as tn  # noqa: E402


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, atol: float = 0.0):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    err = (got.float() - want.float()).abs()
    assert (err <= ulps * spacing + atol).all(), f"max error {((err - atol) / spacing).max().item():.2f} ulps"


@pytest.mark.parametrize("shape", [(1, 5376), (3, 7), (5, 2, 256), (4, 512), (2, 3, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_reference(shape, dtype, with_weight):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype) if with_weight else None
    got = tn.rms_norm(x, w, 1e-6)
    want = reference.rms_norm(x, w, 1e-6)
    assert_within_ulps(got, want, 1.0 if dtype == torch.bfloat16 else 8.0)


@pytest.mark.parametrize("view", ["every_other_row", "packed_columns", "packed_columns_2d", "transposed"])
def test_rms_norm_reads_strided_inputs(view):
    """Non-contiguous inputs (strided tokens, a column block, a transpose) give the reference's values."""
    packed = torch.randn(5, 3 * 64 + 32).to(torch.bfloat16)
    x = {"every_other_row": torch.randn(6, 64).to(torch.bfloat16)[::2],
         "packed_columns": packed[:, 64:192].view(5, 4, 32),  # 4 heads of 32, token stride 224
         "packed_columns_2d": packed[:, 192:],
         "transposed": torch.randn(32, 5).to(torch.bfloat16).t()}[view]
    got = tn.rms_norm(x, None, 1e-6)
    assert got.is_contiguous() and got.shape == x.shape
    assert_within_ulps(got, reference.rms_norm(x, None, 1e-6), 1.0)


@pytest.mark.parametrize("n", [1, 1000, 3 * 1024 + 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_tanh_mul_matches_reference(n, dtype):
    g = torch.Generator().manual_seed(n)
    gate = (torch.randn(n, generator=g) * 4).to(dtype)
    gate[:3] = torch.tensor([-30.0, 0.0, 30.0], dtype=dtype)[: min(3, n)]  # tanh's saturated ends
    up = torch.randn(n, generator=g).to(dtype)
    got = tn.gelu_tanh_mul(gate, up)
    want = reference.gelu_tanh_mul(gate, up)
    # An ulp from each of the two roundings. In the negative tail torch's 1 + tanh(z) cancels to a
    # few fp32 ulps of 1 (the kernel's x / (1 + exp(-2z)) does not), hence the absolute term.
    assert_within_ulps(got, want, 2.0 if dtype == torch.bfloat16 else 8.0, atol=1e-6)


@pytest.mark.parametrize("rows,inter", [(1, 1000), (5, 3 * 1024 + 17)])
def test_gelu_tanh_mul_reads_the_halves_of_a_packed_gate_up_in_place(rows, inter):
    """The two halves of one gate/up matmul's output (row-strided views, MLP.pack_gate_up) give the bits
    their contiguous copies give, and so does a 3-d input; the result is contiguous."""
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.cat([torch.randn(rows, inter, generator=g) * 4, torch.randn(rows, inter, generator=g)],
                        dim=-1).to(torch.bfloat16)  # the scales of the test above (its tolerance says why)
    gate, up = gate_up.split(inter, dim=-1)
    assert gate.stride(0) == 2 * inter and (rows == 1 or not gate.is_contiguous())
    got = tn.gelu_tanh_mul(gate, up)
    assert got.is_contiguous() and got.shape == (rows, inter)
    assert torch.equal(got, tn.gelu_tanh_mul(gate.contiguous(), up.contiguous()))
    assert_within_ulps(got, reference.gelu_tanh_mul(gate, up), 2.0, atol=1e-6)
    three = tn.gelu_tanh_mul(gate.contiguous().view(1, rows, inter), up.contiguous().view(1, rows, inter))
    assert three.shape == (1, rows, inter) and torch.equal(three[0], got)


def test_gelu_tanh_mul_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="gate .* and up .* differ"):
        tn.gelu_tanh_mul(torch.zeros(4), torch.zeros(5))


@pytest.mark.parametrize("shape", [(1, 1000), (3, 4097), (0, 64)])
@pytest.mark.parametrize("cap", [30.0, None])
def test_softcap_logits_matches_reference(shape, cap):
    """The one-launch softcap writes into a poisoned fp32 buffer what the reference computes in bf16, every value
    a bf16 one. The kernel divides by cap as CUDA torch does, by its fp32 reciprocal (CPU torch divides), so it is
    held to the reference in that form. Loosely: the interpreter rounds fp32 to bf16 toward zero (the GPU to
    nearest), an ulp at each of the three roundings, and its tanh is not CUDA's; tests/test_logits_gpu.py asks
    for torch's bits on the GPU."""
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))).to(torch.bfloat16)
    out = torch.full(shape, float("nan"))
    tn.softcap_logits_(x, cap, out)
    want = (torch.tanh(x * float(torch.tensor(1.0) / cap)) * cap).float() if cap else x.float()
    assert torch.equal(out.bfloat16().float(), out)
    assert_within_ulps(out.bfloat16(), want.bfloat16(), 4.0)
    if cap is not None and x.numel():
        assert out.abs().max() <= cap and (out.abs() > 0.99 * cap).any()  # the tails saturate at the cap


def test_softcap_logits_refuses_an_out_it_cannot_fill():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be contiguous and of x's shape \(2, 8\), got \(2, 4\)"):
        tn.softcap_logits_(x, 30.0, torch.empty(2, 4))
    with pytest.raises(ValueError, match=r"got \(2, 8\) with strides \(1, 2\)"):
        tn.softcap_logits_(x, 30.0, torch.empty(8, 2).t())


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_logits_into_a_buffer_equal_the_returned_ones(kernels):
    """`Gemma4Model.logits(hidden, out)` (the inductor engine's decode graphs write the buffer they share) gives
    the bits of `logits(hidden)`, and returns `out` itself."""
    from conftest import tiny_config

    from g4rt.models.model import Gemma4Model
    model = Gemma4Model(tiny_config("31b", dtype="bfloat16"), torch.bfloat16, "cpu")
    torch.nn.init.normal_(model.embed_tokens.weight, std=2.0, generator=torch.Generator().manual_seed(0))
    model.set_kernels(kernels)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    buffer = torch.full((5, model.config.vocab_size), float("nan"))
    got = model.logits(hidden, buffer[:3])
    assert got.data_ptr() == buffer.data_ptr() and torch.isnan(buffer[3:]).all()
    assert torch.equal(got, model.logits(hidden)) and got.abs().max() > 1


def test_blocks_dispatch_by_the_kernels_setting(monkeypatch):
    """`blocks.block` runs the torch reference for kernels="reference" and the custom op (the kernel)
    for "triton"; a model's `set_kernels` reaches every module that runs a block, and an unknown value
    is refused by name."""
    from conftest import tiny_config

    from g4rt.models.model import Gemma4Model
    x = torch.randn(3, 40).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(tn, "rms_norm", lambda *a: calls.append("triton") or reference.rms_norm(*a))
    reference.block("rms_norm", "reference", x, None, 1e-6)
    assert calls == []
    reference.block("rms_norm", "triton", x, None, 1e-6)
    assert calls == ["triton"]
    model = Gemma4Model(tiny_config("26b"), torch.float32, "cpu")
    assert {m.kernels for m in model.modules() if hasattr(m, "kernels")} == {"reference"}
    model.set_kernels("triton")
    assert {m.kernels for m in model.modules() if hasattr(m, "kernels")} == {"triton"}
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of triton, reference"):
        model.set_kernels("cuda")


@pytest.mark.parametrize("name", ["31b", "e2b", "26b"])
def test_a_forward_runs_the_layer_tails_as_one_block(name, report):
    """What one forward dispatches with the Triton kernels and packed weights: each layer's norms are fused
    blocks (the tail, ending in the next layer's input norm and its first projection, `add_norm_linear`, or the
    final norm, `add_rms_norm`; for MoE layers `router_inputs` and `normed_sum`), a KV-shared layer's q norm and
    RoPE is one `q_norm_rope`, every
    projection is `skinny_linear` (the op that picks the Triton kernel or cuBLAS by shape) but the two of a
    gated GELU, the packed gate/up and the PLE gate, which are `add_norm_gelu_linear` with the residual step
    before them (the step's norms in the matmul's prologue, the GELU in its epilogue: no `add_rms_norm`,
    `add_normed` or `gelu_tanh_mul` of their own), and no residual add, layer scalar, router scale or RoPE is
    left to ATen (each would be a kernel of its own or Inductor's)."""
    from collections import Counter

    from conftest import tiny_config
    from torch.utils._python_dispatch import TorchDispatchMode

    from g4rt.models.checkpoint import random_model

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    cfg = tiny_config(name, dtype="bfloat16")
    model = random_model(cfg, torch.bfloat16, "cpu", seed=0, kernels="triton")
    model.pack_weights()
    L, shared = cfg.num_hidden_layers, cfg.num_kv_shared_layers
    with torch.inference_mode(), Ops() as ops:
        model(torch.tensor([5, 9]), torch.tensor([7, 8]), lambda layer, q, k, v: torch.ones_like(q))
    g4 = {k: v for k, v in ops.seen.items() if k.startswith("g4rt::")}
    # Reported before the asserts, so that the same test run against another checkout's package prints
    # that code's counts as it fails.
    report(f"tiny {name}, one forward of {L} layers: our ops {sum(g4.values())}, ATen add {ops.seen['aten::add']}, "
           f"mul {ops.seen['aten::mul']}, neg {ops.seen['aten::neg']}, cat {ops.seen['aten::cat']}")
    ple, moe = cfg.has_ple, cfg.enable_moe_block
    # Projections through `skinny_linear`: per layer o and down, the first layer's q (or packed q/k/v); the PLE
    # projection per layer and the per-layer model projection once; the router. Every later layer's q (or
    # packed q/k/v) is `add_norm_linear` with the layer before's tail, the last tail is `add_rms_norm` with the
    # final norm. The packed gate/up and the PLE gate are `add_norm_gelu_linear`.
    mm = 2 * L + 1 + ple * (L + 1) + moe * L
    assert g4 == {"g4rt::add_rms_norm": 1, "g4rt::add_norm_linear": L - 1, "g4rt::qkv_norm_rope": L - shared,
                  "g4rt::skinny_linear": mm, "g4rt::add_norm_gelu_linear": L * (1 + ple),
                  "g4rt::rms_norm": 1 + ple, **({"g4rt::q_norm_rope": shared} if ple else {}),
                  **({k: L for k in ("g4rt::router_inputs", "g4rt::route", "g4rt::moe", "g4rt::normed_sum")}
                     if moe else {})}
    # What ATen still computes is the step's prologue, none of it per layer: the embedding's scale and the
    # two RoPE tables' angles (3 multiplies), and for PLE models the per-layer inputs (3 scales, 1 add).
    assert ops.seen["aten::add"] == ple and ops.seen["aten::mul"] == 3 + 3 * ple and ops.seen["aten::neg"] == 0


def close(got: torch.Tensor, want: torch.Tensor, scale: float):
    """A fused block against the reference: fp32 to the order of its sums; bf16 within a few ulps of the
    values' scale (the interpreter truncates fp32 -> bf16 where the GPU and torch round to nearest, so
    the bits cannot be compared here; tests/test_engine_inductor.py compares engines, not roundings)."""
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4 * torch.finfo(want.dtype).eps * scale)


def test_the_norm_tile_counts_one_token_programs():
    """norm_rope_tile by the launch's one-token programs (tokens x heads), as the H200 sweeps measured it: the
    31B's sliding layers (64 heads) take 4 tokens a program from 40 tokens (batch 64: 4.06 against 5.98 us), the
    E2B's (10 heads) keep one token at 128 tokens (3.05 against 3.46) and take 4 from 256; 16 tokens from 2,048;
    head dim 512 one token at every size."""
    assert tn.norm_rope_tile(39, 256, 64) == (1, 1) and tn.norm_rope_tile(40, 256, 64) == (4, 4)
    assert tn.norm_rope_tile(128, 256, 10) == (1, 1) and tn.norm_rope_tile(256, 256, 10) == (4, 4)
    assert tn.norm_rope_tile(2048, 256, 10) == (16, 4)
    assert all(tn.norm_rope_tile(t, 512, 40) == (1, 1) for t in (64, 256, 8192))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_eq_v", [False, True])
@pytest.mark.parametrize("D, T", [(16, 3), (256, 3), (16, 259)])  # tiled at a small head dim: interpreter time
def test_qkv_norm_rope_matches_reference(k_eq_v, D, dtype, T):
    """One token per program (a decode step), and token tiles whose last one is partial (a prefill chunk:
    each tile of several tokens `norm_rope_tile` can pick is tried on it)."""
    from g4rt.models.model import rope_cos_sin
    g = torch.Generator().manual_seed(D + k_eq_v)
    hq, hkv = 4, 2
    width = (hq + hkv * (1 if k_eq_v else 2)) * D
    packed = (torch.randn(T, width + 8, generator=g) * 2).to(dtype)[:, :width]  # strided tokens
    qw, kw = [(0.5 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_cos_sin(inv_freq, torch.randint(0, 4096, (T,), generator=g), dtype)
    args = (packed, qw, kw, 1e-6, cos, sin, hq, hkv, k_eq_v)
    tiles = [tn.norm_rope_tile(T, D, hq + 2 * hkv)] if T < 256 else [tn.norm_rope_tile(n, D, 64) for n in (256, 2048)]
    assert T < 256 or all(bt > 1 and T % bt for bt, _ in tiles)  # several tokens a program, the last tile partial
    for tile in tiles:
        for got, want in zip(tn.qkv_norm_rope(*args, tile=tile), reference.qkv_norm_rope(*args)):
            close(got, want, scale=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q_norm_rope_matches_reference(dtype):
    """A KV-shared layer's q block: the q/k/v kernel launched with no k or v heads gives the q of the
    reference (and of the three-part block on the same q)."""
    from g4rt.models.model import rope_cos_sin
    g = torch.Generator().manual_seed(1)
    T, hq, D = 3, 4, 256
    q = (torch.randn(T, hq * D + 8, generator=g) * 2).to(dtype)[:, :hq * D]  # strided tokens
    w = (0.5 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    cos, sin = rope_cos_sin(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), torch.tensor([0, 9, 511]), dtype)
    got = tn.q_norm_rope(q, w, 1e-6, cos, sin)
    assert got.shape == (T, hq, D)
    close(got, reference.q_norm_rope(q, w, 1e-6, cos, sin), scale=2.0)
    close(got, reference.qkv_norm_rope(torch.cat([q, q[:, :2 * D]], -1), w, w, 1e-6, cos, sin, hq, 1, False)[0], 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", [False, True])
def test_add_rms_norm_matches_reference(dtype, scaled):
    """The fused post-norm + residual (+ layer_scalar) + next-norm block, and its one-output form
    `add_normed`, against the references; a scale of 1 would hide a missing multiply, so it is 0.6."""
    g = torch.Generator().manual_seed(0)
    res, x = [(torch.randn(5, 5376, generator=g) * 3).to(dtype) for _ in range(2)]
    xw, ow = [(1 + 0.2 * torch.randn(5376, generator=g)).to(dtype) for _ in range(2)]
    scale = torch.tensor([0.6], dtype=dtype) if scaled else None
    got = tn.add_rms_norm(res, x, xw, ow, 1e-6, scale)
    want = reference.add_rms_norm(res, x, xw, ow, 1e-6, scale)
    close(got[0], want[0], scale=16.0)
    close(got[1], want[1], scale=4.0)
    assert torch.equal(tn.add_normed(res, x, xw, 1e-6, scale), got[0])
    unscaled = reference.add_normed(res, x, xw, 1e-6)
    assert scaled == (not torch.equal(want[0], unscaled))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_blocks_match_reference(dtype):
    """The MoE block's input norms (router and experts) and its branches' post-norms + sum, against the
    references; the router's input is checked apart from its scale, so a missing root or scale fails."""
    g = torch.Generator().manual_seed(3)
    H = 2816
    h, a, b = [(torch.randn(4, H, generator=g) * 3).to(dtype) for _ in range(3)]
    scale, ew, aw, bw = [(1 + 0.2 * torch.randn(H, generator=g)).to(dtype) for _ in range(4)]
    got, want = tn.router_inputs(h, scale, H ** -0.5, ew, 1e-6), reference.router_inputs(h, scale, H ** -0.5, ew, 1e-6)
    close(got[0], want[0], scale=4.0 * H ** -0.5)
    close(got[1], want[1], scale=4.0)
    assert not torch.allclose(want[0], reference.rms_norm(h, scale, 1e-6))  # the root is there
    close(tn.normed_sum(a, aw, b, bw, 1e-6), reference.normed_sum(a, aw, b, bw, 1e-6), scale=8.0)
    with pytest.raises(ValueError, match=r"a \(4, 2816\) and b \(2, 2816\) differ"):
        tn.normed_sum(a, aw, b[:2], bw, 1e-6)


def test_the_row_kernels_compute_the_same_bits_one_row_or_several_a_program(monkeypatch):
    """The interpreter runs INTERPRETER_ROWS rows a program (tests' speed), a GPU one row a program: both launches of
    every row kernel give the same bits, on a row count that leaves the last multi-row program part empty, and the
    one-row launch (the GPU's) matches the reference."""
    g = torch.Generator().manual_seed(5)
    H, T = 96, tn.INTERPRETER_ROWS + 3
    h, a, b = [(torch.randn(T, H, generator=g) * 3).to(torch.bfloat16) for _ in range(3)]
    w1, w2, w3 = [(1 + 0.2 * torch.randn(H, generator=g)).to(torch.bfloat16) for _ in range(3)]
    scale = torch.tensor([0.6], dtype=torch.bfloat16)
    runs = {"rms_norm": lambda m: m.rms_norm(h, w1, 1e-6),
            "add_rms_norm": lambda m: m.add_rms_norm(h, a, w1, w2, 1e-6, scale),
            "router_inputs": lambda m: m.router_inputs(h, w1, H ** -0.5, w2, 1e-6),
            "normed_sum": lambda m: m.normed_sum(a, w1, b, w3, 1e-6)}

    def outputs(result):
        return result if isinstance(result, tuple) else (result,)

    several = {name: outputs(run(tn)) for name, run in runs.items()}
    monkeypatch.setattr(tn, "INTERPRETER_ROWS", 1)
    for name, run in runs.items():
        for got, many, want in zip(outputs(run(tn)), several[name], outputs(run(reference))):
            assert torch.equal(got, many), name
            close(got, want, scale=8.0)


def test_add_normed_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"residual \(2, 8\) and x \(2, 4\) differ"):
        tn.add_normed(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"scale must hold one value .* shape \(8,\)"):
        tn.add_normed(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 1e-6, torch.ones(8))
