"""The mixture-of-experts plugin: Triton kernels (plugins/triton_moe.py, under the interpreter) against
the torch reference (`plugins.reference.moe_ref`, HF's eager experts), the `g4rt::moe` op, its ONNX
function under ONNX Runtime, and the model's MoE block compiled without graph breaks.

Every kernel run writes into a NaN-poisoned output with NaN-poisoned intermediates, so a finite,
matching result proves every row was written and no unwritten (padding) row was read.

fp32 results agree to 1e-5 relative (only the GEMM sum order differs). bf16: the interpreter truncates
fp32 -> bf16 where GPUs round to nearest, at each of the ~7 roundings on a token's path, so a bf16
output is checked twice: bit-equal to the reference's arithmetic redone with the interpreter's
truncation (so the kernel rounds exactly where eager torch rounds), and within a few bf16 ulps of the
fp32 result.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; `make test` sets it too

import pytest
import torch

from g4rt.plugins import ops  # noqa: F401  (registers torch.ops.g4rt.moe)
from g4rt.plugins.reference import moe_ref

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp"),  # gelu's exp -> inf is the intent
              # the interpreter computes the masked rows past T of a routing tile too (never stored)
              pytest.mark.filterwarnings("ignore:invalid value encountered"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered")]


def _experts(T, H, I, E, K, dtype, seed, idx=None):
    """x [T, H], idx/w [T, K], gate_up [E, 2I, H], down [E, H, I]; each token picks K distinct experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 2 / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    if idx is None:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return x, idx, w, gate_up, down


def _kernel(args, **kw):
    from g4rt.plugins import triton_moe
    x = args[0]
    out = torch.full_like(x, float("nan"))
    got = triton_moe.moe(*args, out=out, poison_scratch=True, **kw)
    assert got is out
    assert torch.isfinite(got).all(), "a row left unwritten, or a padding row read"
    return got


CASES = {
    # name: (T, H, I, E, K, idx or None)
    "decode_batch": (5, 40, 24, 8, 2, None),
    "single_token": (1, 48, 32, 8, 2, None),
    "top_k_is_num_experts": (6, 33, 20, 4, 4, None),
    "all_to_one_expert": (9, 48, 32, 6, 1, torch.full((9, 1), 4)),
    "experts_without_tokens": (7, 40, 24, 16, 2, torch.tensor([[3, 11]] * 4 + [[11, 3]] * 3)),
    "odd_sizes": (3, 77, 19, 5, 3, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_fp32_matches_reference(name):
    pytest.importorskip("triton", reason="the triton extra is not installed")
    T, H, I, E, K, idx = CASES[name]
    args = _experts(T, H, I, E, K, torch.float32, seed=T + H, idx=idx)
    got, want = _kernel(args), moe_ref(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_kernel_prefill_tiles_match_reference():
    """Enough tokens per expert for the 64-row prefill tiles (chosen by default_config), several row
    blocks per expert, one expert chosen by no token."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from g4rt.plugins import triton_moe
    T, E, K = 70, 5, 2
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    assert triton_moe.default_config(T, K, E)["block_m"] == triton_moe.PREFILL["block_m"]
    args = _experts(T, 40, 24, E, K, torch.float32, seed=2, idx=idx)
    got, want = _kernel(args), moe_ref(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as the Triton interpreter converts (dropping the low 16 bits), kept in fp32."""
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


def _interpreter_bf16(x, idx, w, gate_up, down):
    """The reference's arithmetic with every bf16 rounding done the interpreter's way and the kernel's
    gelu form x / (1 + exp(-2z)); fp32 products (no rounding of a dot's inner sums), slots in ascending
    expert order: what the kernels must compute bit for bit under TRITON_INTERPRET=1."""
    T, K = idx.shape
    y = torch.zeros(T, K, x.shape[1])
    for t in range(T):
        for s in range(K):
            e = idx[t, s]
            gate, up = _truncated(x[t].float() @ gate_up[e].float().T).chunk(2)
            z = 0.7978845608028654 * (gate + 0.044715 * gate ** 3)
            act = _truncated(_truncated(gate / (1 + torch.exp(-2 * z))) * up)
            y[t, s] = _truncated(_truncated(act @ down[e].float().T) * w[t, s])
    y = y.gather(1, idx.argsort(dim=1)[:, :, None].expand_as(y))
    out = y[:, 0]
    for s in range(1, K):
        out = _truncated(out + y[:, s])
    return out


@pytest.mark.parametrize("name", ["decode_batch", "top_k_is_num_experts", "odd_sizes"])
def test_kernel_bf16_rounds_where_the_reference_rounds(name):
    """bf16: the kernel rounds at exactly the reference's points (bit-equal to their emulation with the
    interpreter's truncation), and so lands within rounding of the reference."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    T, H, I, E, K, idx = CASES[name]
    args = _experts(T, H, I, E, K, torch.bfloat16, seed=T + H, idx=idx)
    got = _kernel(args)
    assert torch.equal(got.float(), _interpreter_bf16(*args))
    exact = moe_ref(*(a.float() if a.is_floating_point() else a for a in args))
    want = moe_ref(*args).float()
    scale = exact.abs() + exact.pow(2).mean(dim=1, keepdim=True).sqrt()
    eps = torch.finfo(torch.bfloat16).eps
    assert ((want - exact).abs() <= 2 * eps * scale).all()  # the reference: round to nearest
    assert ((got.float() - exact).abs() <= 8 * eps * scale).all()  # the kernel: truncating interpreter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_runs_in_ascending_expert_order(dtype):
    """Reordering a token's slots (same experts, same weights) changes no bit of the kernel's or the
    reference's output: both sum a token's experts by ascending id, not by slot."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    x, idx, w, gate_up, down = _experts(6, 40, 24, 8, 3, dtype, seed=3)
    perm = torch.stack([torch.randperm(3, generator=torch.Generator().manual_seed(t)) for t in range(6)])
    swapped = (x, idx.gather(1, perm), w.gather(1, perm), gate_up, down)
    assert torch.equal(_kernel((x, idx, w, gate_up, down)), _kernel(swapped))
    assert torch.equal(moe_ref(x, idx, w, gate_up, down), moe_ref(*swapped))


def test_sum_rounds_after_every_add():
    """bf16: 1 + 2^-8 rounds back to 1, so 1, 2^-8, 2^-8 summed left to right give 1, while the two small
    terms first give 1 + 2^-7. The sum kernel adds in the order the rows lie (ascending expert)."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from g4rt.plugins import triton_moe
    y = torch.tensor([[[1.0] * 3, [2 ** -8] * 3, [2 ** -8] * 3],
                      [[2 ** -8] * 3, [2 ** -8] * 3, [1.0] * 3]], dtype=torch.bfloat16)
    out = torch.full((2, 3), float("nan"), dtype=torch.bfloat16)
    triton_moe._moe_sum_kernel[(2, 1)](y, out, 3, TOPK=3, BLOCK=4)
    assert out[0].tolist() == [1.0] * 3 and out[1].tolist() == [1 + 2 ** -7] * 3


@pytest.mark.parametrize("T,K,E,block_m", [(1, 8, 128, 16), (5, 2, 6, 16), (150, 3, 6, 16), (70, 2, 5, 64)])
def test_align_groups_assignments_by_expert(T, K, E, block_m):
    """Both align paths (one program up to ALIGN_CHUNK assignments, three launches past it): each
    expert's assignments, in assignment order, from its group's first row; groups in ascending expert
    order, each padded to a multiple of block_m; no row of an unchosen expert."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from g4rt.plugins import triton_moe
    g = torch.Generator().manual_seed(T)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1: never chosen
    counts, ends, sorted_ids = triton_moe.align(idx, E, block_m, poison=True)
    flat = idx.flatten()
    want_counts = torch.bincount(flat, minlength=E)
    assert torch.equal(counts.long(), want_counts)
    padded = (want_counts + block_m - 1) // block_m * block_m
    assert torch.equal(ends.long(), padded.cumsum(0))
    for e in range(E):
        start = int(ends[e] - padded[e])
        got = sorted_ids[start:start + int(want_counts[e])]
        assert torch.equal(got.long(), (flat == e).nonzero().flatten())
    assert int(ends[-1]) <= sorted_ids.numel()


@pytest.mark.parametrize("assignments,experts,block_m", [(8, 128, 16), (512, 128, 16), (16384, 128, 64), (7, 3, 16)])
def test_max_blocks_bounds_every_routing(assignments, experts, block_m):
    """The grid bound holds for the worst routing (as many experts as possible, the rest piled on one)
    and is reached by it."""
    from g4rt.plugins import triton_moe
    m = min(assignments, experts)
    counts = [1] * (m - 1) + [assignments - (m - 1)]
    worst = sum(-(-c // block_m) for c in counts)
    assert triton_moe.max_blocks(assignments, experts, block_m) == worst
    g = torch.Generator().manual_seed(assignments)
    for _ in range(20):
        c = torch.bincount(torch.randint(0, experts, (assignments,), generator=g), minlength=experts)
        assert sum(-(-int(n) // block_m) for n in c) <= worst


@pytest.mark.parametrize("T,E,K", [(1, 128, 8), (6, 8, 2), (5, 6, 6)])
def test_route_kernel_matches_model_routing(T, E, K):
    """The one-launch routing kernel against models.blocks.route (HF's order): the same experts in the same
    (descending-weight) order, weights within fp32 rounding."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from g4rt.models.blocks import route
    from g4rt.plugins import triton_moe
    g = torch.Generator().manual_seed(T * E)
    # Distinct logits (exact in bf16), so "the k largest" has one answer.
    logits = torch.stack([(torch.randperm(E, generator=g) - E / 2) / 16 for _ in range(T)]).to(torch.bfloat16)
    scale = (1 + 0.2 * torch.randn(E, generator=g)).to(torch.bfloat16)
    w, idx = triton_moe.route(logits, scale, K)
    want_w, want_idx = route(logits, scale, K)
    assert w.dtype == want_w.dtype == torch.float32 and idx.dtype == want_idx.dtype == torch.int64
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


def test_op_dispatch_and_errors():
    args = _experts(4, 40, 24, 8, 2, torch.float32, seed=5)
    assert torch.equal(torch.ops.g4rt.moe(*args, "reference"), moe_ref(*args))
    with pytest.raises(ValueError, match="kernels"):
        torch.ops.g4rt.moe(*args, "cuda")
    x, idx, w, gate_up, down = args
    with pytest.raises(ValueError, match="down"):
        torch.ops.g4rt.moe(x, idx, w, gate_up, down[:, :, :-1], "reference")


def test_op_dispatches_to_the_triton_kernels():
    pytest.importorskip("triton", reason="the triton extra is not installed")
    args = _experts(4, 40, 24, 8, 2, torch.float32, seed=5)
    got = torch.ops.g4rt.moe(*args, "triton")
    torch.testing.assert_close(got, moe_ref(*args), rtol=1e-5, atol=1e-5 * got.abs().max().item())
    x, idx, w, gate_up, down = args
    with pytest.raises(ValueError, match="down"):
        torch.ops.g4rt.moe(x, idx, w, gate_up, down[:, :, :-1], "triton")


def test_onnx_function_matches_reference():
    """The reference body shipped inside every exported model.onnx, run by ONNX Runtime, against the op."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from g4rt.plugins import onnx_functions, onnx_schemas

    names = ("x", "idx", "w", "gate_up", "down")
    args = _experts(7, 40, 24, 8, 3, torch.float32, seed=7, idx=torch.tensor([[5, 1, 2]] * 4 + [[2, 7, 0]] * 3))
    types = {torch.float32: onnx.TensorProto.FLOAT, torch.int64: onnx.TensorProto.INT64}
    onnx_schemas.register()
    node = onnx.helper.make_node(onnx_schemas.MOE, list(names), ["out"], domain=onnx_schemas.DOMAIN,
                                 **onnx_schemas.plugin_attrs())
    graph = onnx.helper.make_graph(
        [node], "moe", [onnx.helper.make_tensor_value_info(n, types[t.dtype], list(t.shape)) for n, t in zip(names, args)],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [None, None])])
    model = onnx_functions.attach(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]))
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {n: t.numpy() for n, t in zip(names, args)})[0])
    want = moe_ref(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_moe_block_compiles_without_graph_breaks(kernels):
    """The layer piece holding the MoE block (router, experts, dense MLP, norms) is one graph for Dynamo:
    routing is plain torch (or the opaque g4rt::route) and the experts one opaque g4rt::moe node."""
    from conftest import tiny_config

    from g4rt.models.checkpoint import random_model
    if kernels == "triton":
        pytest.importorskip("triton", reason="the triton extra is not installed")
    model = random_model(tiny_config("26b", dtype="bfloat16"), torch.bfloat16, "cpu", seed=3, kernels=kernels)
    layer = model.layers[0]
    kv = layer.self_attn.kv
    h = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
    o = torch.randn(5, kv.num_q_heads, kv.head_dim, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(layer.after_attention)(h, o, None)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "g4rt.moe" in targets
    assert ("g4rt.route" in targets) == (kernels == "triton")


@pytest.mark.slow
def test_compiled_26b_step_is_bit_equal_with_plugin_kernels(report):
    """The 26B-like model with every plugin kernel (MoE included, under the interpreter), compiled per layer
    piece, computes the eager step's bits: logits and every K/V element (what lets the H200 run demand
    identical greedy tokens from the inductor and the eager engine)."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from conftest import tiny_config
    from fixtures import eager_and_compiled

    from g4rt.models.checkpoint import random_model
    from g4rt.plugins import launch
    if not launch.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (make test sets it)")
    model = random_model(tiny_config("26b", dtype="bfloat16"), torch.bfloat16, "cpu", seed=3, kernels="triton")
    eager, eager_arena, out, compiled = eager_and_compiled(model, "layers")
    report(f"26b compiled (layers) vs eager bf16, plugin kernels incl. moe: logits bit-equal {torch.equal(out, eager)}")
    assert torch.equal(out, eager)
    assert torch.equal(compiled.arena.tensor, eager_arena.tensor)


def test_bench_roofline_counts_only_the_chosen_experts():
    """The active-weight roofline (bench.engine.active_weight_bytes, used by bench/moe.py): the census
    counts the distinct experts each layer's router chose in decode steps of the batch, and a layer that
    reads d of its E experts leaves out exactly the other E - d experts' gate/up and down tensors."""
    from conftest import tiny_config

    from g4rt.bench import moe as bench_moe
    from g4rt.bench.engine import active_weight_bytes
    from g4rt.models.checkpoint import random_model
    from g4rt.runtime.llm import LLM
    from g4rt.runtime.sampling import SamplingParams

    model = random_model(tiny_config("26b"), torch.float32, "cpu", seed=1)
    E, L = model.config.num_experts, model.config.num_hidden_layers
    census = bench_moe.ExpertCensus(model, tokens=3)
    try:
        LLM.paged(model, num_frames=64).generate([[5, 6, 7, 8], [9, 10, 11], [3, 4]],
                                                 SamplingParams(max_new_tokens=4, ignore_eos=True))
    finally:
        census.close()
    assert all(len(steps) == 3 for steps in census.seen.values())  # the 3 decode steps, not the prefill
    distinct = census.distinct()
    assert len(distinct) == L and all(model.config.top_k_experts <= d <= E for d in distinct)
    everything = sum(p.nbytes for p in model.parameters())
    chosen = [i * 3 % E + 1 for i in range(L)]  # 1, 4, 7, 2, 5, 8 of the tiny 26B's 8 experts
    unread = sum(p[d:].nbytes for layer, d in zip(model.layers, chosen)
                 for p in (layer.experts.gate_up_proj, layer.experts.down_proj))
    assert 0 < unread and active_weight_bytes(model, chosen) == everything - unread
