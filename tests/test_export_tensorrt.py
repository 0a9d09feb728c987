"""TensorRT backend. What needs no TensorRT runs everywhere: the plugins' kernels under the Triton
interpreter against the reference, their PTX for sm_90 (what aot_impl hands TensorRT), the split-K
launch rule against the CUDA path's, the plan inspection's copy detector, the plugins' signatures.
What needs TensorRT skips with the import error (every CPU machine of this project); on a TensorRT
machine it builds a tiny engine and checks it against the ORT engine's step.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fixtures import make_paged_batch
from g4rt.export.trt import arena_copies
from g4rt.plugins import trt_kernels as K
from g4rt.plugins.buckets import pow2_bucket
from g4rt.plugins.reference import paged_attention_ref
from g4rt.plugins.triton_attention import decode_splits, default_config

try:
    import tensorrt  # noqa: F401
    _why = ""
except Exception as e:  # ImportError, or a broken install without libnvinfer
    _why = repr(e)

requires_tensorrt = pytest.mark.skipif(bool(_why), reason=f"tensorrt not importable: {_why}")
H200_SMEM_BYTES = 232448  # 227 KB of shared memory per block on sm_90 (the opt-in maximum)


@pytest.mark.parametrize("num_kv_heads,head_dim,page,window_left",
                         [(4, 512, 48, -1), (16, 256, 16, 1023), (1, 64, 4, 7), (8, 256, 16, -1)])
def test_split_rule_is_the_cuda_paths(num_kv_heads, head_dim, page, window_left):
    """The TensorRT split count (shape-expression arithmetic, here on ints) equals what
    triton_attention.paged_attention picks for every decode, and is 1 for any other step."""
    cpu = torch.device("cpu")  # decode_splits assumes an H200's 132 SMs off CUDA
    rule = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page, window_left=window_left, num_sms=132,
                max_seqs=300, max_width=5000)
    for b in range(1, 300, 3):
        for width in (1, 2, 3, 17, 100, 1000, 5000):
            max_keys = pow2_bucket(width) * page
            if window_left >= 0:
                max_keys = min(max_keys, window_left + 1)
            want = decode_splits(pow2_bucket(b), num_kv_heads, max_keys, head_dim, cpu)
            assert K.split_count(K.IntOps, b, b, width, **rule) == want, (b, width)
            assert K.split_count(K.IntOps, b + 5, b, width, **rule) == 1
    for x_max in (1, 2, 7, 300):
        assert [K.pow2_bucket_expr(K.IntOps, x, x_max) for x in range(1, x_max + 1)] == \
            [pow2_bucket(x) for x in range(1, x_max + 1)]


class _Expr:
    """A stand-in for tensorrt.plugin.ShapeExpr with exactly its operator surface (read in
    tensorrt/plugin/_tensor.py): + - * // == < with the expression on the left, no reflected
    operators, no truth value; carries the value it would evaluate to."""

    def __init__(self, v: int):
        self.v = v

    def _op(self, other, f):
        return _Expr(int(f(self.v, other.v if isinstance(other, _Expr) else other)))

    __add__ = lambda self, o: self._op(o, lambda a, b: a + b)  # noqa: E731
    __sub__ = lambda self, o: self._op(o, lambda a, b: a - b)  # noqa: E731
    __mul__ = lambda self, o: self._op(o, lambda a, b: a * b)  # noqa: E731
    __floordiv__ = lambda self, o: self._op(o, lambda a, b: a // b)  # noqa: E731
    __eq__ = lambda self, o: self._op(o, lambda a, b: a == b)  # noqa: E731
    __lt__ = lambda self, o: self._op(o, lambda a, b: a < b)  # noqa: E731

    def __bool__(self):
        raise RuntimeError("a symbolic expression has no truth value")


def _top(f):
    def op(a, b):  # tensorrt.plugin.cdiv/max/min: at least one operand must be an expression
        if isinstance(a, int) and isinstance(b, int):
            raise ValueError("Both arguments cannot be 'int's")
        return (a if isinstance(a, _Expr) else _Expr(a))._op(b, f)
    return op


def test_launch_expressions_use_only_tensorrt_operations(monkeypatch):
    """TrtOps builds the split count and the grids with what tensorrt.plugin expressions support
    (an int on the left of an operator, or a branch on an expression, would fail inside aot_impl)."""
    import types
    plugin = types.SimpleNamespace(ShapeExpr=_Expr, cdiv=_top(lambda a, b: -(-a // b)), max=_top(max),
                                   min=_top(min))
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(plugin=plugin))
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    rule = dict(num_kv_heads=4, head_dim=256, page_size=48, window_left=1023, num_sms=132, max_seqs=256, max_width=6000)
    for t, b, w in [(1, 1, 1), (3, 3, 40), (64, 64, 6000), (300, 8, 77), (256, 256, 5)]:
        splits = K.split_count(K.TrtOps, _Expr(t), _Expr(b), _Expr(w), **rule)
        assert splits.v == K.split_count(K.IntOps, t, b, w, **rule)
        grid = K.attention_grid(K.TrtOps, _Expr(t), _Expr(b), splits, block_q=8, num_kv_heads=4, dv_split=2)
        assert [g.v for g in grid] == list(K.attention_grid(K.IntOps, t, b, splits.v, block_q=8, num_kv_heads=4,
                                                            dv_split=2))
        (x,) = K.combine_grid(K.TrtOps, _Expr(t), splits, num_q_heads=32)
        assert x.v == K.combine_grid(K.IntOps, t, splits.v, num_q_heads=32)[0]


def test_workspace_holds_every_decode():
    rule = dict(num_kv_heads=4, head_dim=512, page_size=48, window_left=-1, num_sms=132, max_seqs=256, max_width=6000)
    rows = K.workspace_rows(num_q_heads=32, **rule)
    worst = max(b * 32 * K.split_count(K.IntOps, b, b, w, **rule) for b in range(1, 257) for w in (1, 64, 6000))
    assert worst == rows
    assert rows * 512 * 4 < 64 << 20  # the 31B's global layers: a few MB of fp32 partials


@pytest.mark.parametrize("q_lens,kv_lens,splits,window_left,tiles", [
    ([5, 1, 3], [5, 9, 12], 1, -1, {}),  # prefill + decode + chunk: one split, the kernel writes the output
    ([1, 1], [13, 7], 1, -1, {}),
    ([1, 1], [13, 7], 3, -1, {}),  # split-K: partials, then the combine
    ([1, 1], [13, 7], 3, 5, {"interior": False}),
    ([5, 1, 3], [5, 9, 12], 1, 3, {"dv_split": 2}),  # output columns cut in two (the D=512 prefill tiles)
    ([1, 1], [13, 7], 3, -1, {"dv_split": 2}),  # ... and split-K with it: one kernel serves both on TensorRT
])
def test_abi_kernels_match_reference(q_lens, kv_lens, splits, window_left, tiles):
    """The AOT wrappers with TensorRT's argument order, launched on the grids the plugins give
    TensorRT, under the interpreter: same output as the reference op."""
    hq, hkv, d, page = 4, 2, 32, 4
    b = make_paged_batch(q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                         window_left=window_left, seed=3, scale=0.25)
    want = paged_attention_ref(b.q, b.arena, b.cu_q, b.kv_lens, b.page_table, b.first_page, b.k_offset, b.v_offset,
                               page, hkv, window_left, 0.25)
    T, B = b.q.shape[0], len(kv_lens)
    tiles = {**K.attention_tiles(d, "float32", hq // hkv), **tiles}
    out = torch.full_like(b.q, float("nan"))
    ws_acc, ws_ml = torch.empty(T * hq * splits, d), torch.empty(T * hq * splits, 2)
    grid = K.attention_grid(K.IntOps, T, B, splits, block_q=tiles["block_q"], num_kv_heads=hkv,
                            dv_split=tiles["dv_split"])
    K.attention_abi[grid](b.q, b.arena, b.cu_q, b.kv_lens, b.page_table, b.first_page, window_left, b.k_offset,
                          b.v_offset, b.arena.stride(0), b.page_table.stride(0), splits, out, ws_acc, ws_ml,
                          SCALE=0.25, HQ=hq, HKV=hkv, G=hq // hkv, GP=tiles["group_pad"], D=d, PAGE=page,
                          BLOCK_Q=tiles["block_q"], BLOCK_N=tiles["block_n"], DV_SPLIT=tiles["dv_split"],
                          INTERIOR=tiles["interior"], UPCAST=False, PREC="ieee")
    K.combine_abi[K.combine_grid(K.IntOps, T, splits, num_q_heads=hq)](
        out, ws_acc, ws_ml, b.kv_lens, b.page_table, splits, out, D=d, BLOCK_S=K.MAX_DECODE_SPLITS)
    assert (out - want).abs().max().item() < 1e-5


def test_kv_write_abi_matches_reference():
    from g4rt.plugins.reference import kv_write_ref
    g = torch.Generator().manual_seed(0)
    arena = torch.randn(6, 3 * 4 * 2 * 8 + 5, generator=g)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, 17, -1, 0, 22], dtype=torch.int32)
    want = kv_write_ref(arena, k, v, slots, 64, 128, 4)
    got = arena.clone()
    width = 16
    K.kv_write_abi[(5, K.IntOps.cdiv(width, K.kv_write_block(width)))](
        got, k, v, slots, 64, 128, got.stride(0), got, PAGE=4, WIDTH=width, BLOCK=K.kv_write_block(width))
    assert torch.equal(got, want)


def test_tiles_follow_the_dtype():
    """fp32 builds get the CUDA path's halved tiles: the 2-byte tiles at fp32 and D=512 would ask for
    295 KB of shared memory, more than an H200 has."""
    for d in (256, 512):
        half, full = K.attention_tiles(d, "bfloat16", 8), K.attention_tiles(d, "float32", 8)
        assert full["block_n"] == default_config(d, False, 4)["block_n"] < half["block_n"]
        assert full["block_q"] < half["block_q"]
    with pytest.raises(ValueError, match="int8"):
        K.attention_tiles(256, "int8", 8)


def test_launch_numbers_have_one_definition(monkeypatch):
    """The plan's launch numbers are the CUDA path's own definitions, not copies: the split cap
    (`MAX_DECODE_SPLITS`, which decode_splits reads), the element sizes (torch's, as models.layout's dtype
    table has them), the KV write's block and a tile's query block (`query_block`, which launch_constexprs reads)."""
    from g4rt.models.layout import DTYPES
    from g4rt.plugins import triton_attention as ta
    from g4rt.plugins import triton_kv_write as tkw

    assert K.MAX_DECODE_SPLITS == ta.MAX_DECODE_SPLITS and K.kv_write_block is tkw.kv_write_block
    assert K.ELEM_BYTES == {name: DTYPES[name].itemsize for name in K.TRITON_DTYPES}
    cpu = torch.device("cpu")
    assert ta.decode_splits(1, 1, 1 << 20, 512, cpu) == ta.MAX_DECODE_SPLITS
    monkeypatch.setattr(ta, "MAX_DECODE_SPLITS", 8)
    assert ta.decode_splits(1, 1, 1 << 20, 512, cpu) == 8
    for d, dtype, group in [(256, "bfloat16", 2), (512, "bfloat16", 8), (512, "float32", 5), (64, "float16", 1)]:
        tiles = K.attention_tiles(d, dtype, group)
        consts = ta.launch_constexprs(tiles, num_q_heads=group, num_kv_heads=1, head_dim=d, page_size=16,
                                      num_splits=1, fp32=dtype == "float32", copies=False,
                                      decode=False)
        assert (tiles["block_q"], tiles["group_pad"]) == (consts["BLOCK_Q"], consts["GP"])
    monkeypatch.setattr(ta, "query_block", lambda rows, group: 3)
    assert ta.launch_constexprs(tiles, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, num_splits=1,
                                fp32=False, copies=False, decode=False)["BLOCK_Q"] == 3
    blocks = []
    monkeypatch.setattr(tkw, "kv_write_block", lambda width: blocks.append(width) or 8)
    arena = torch.zeros(2, 64)
    tkw.kv_write_(arena, torch.ones(3, 2, 8), torch.ones(3, 2, 8), torch.tensor([0, 1, -1], dtype=torch.int32),
                  0, 32, 2)
    assert blocks == [16] and arena[0, :32].eq(1).all()


_PTX_SCRIPT = textwrap.dedent("""
    import json
    from triton.backends.compiler import GPUTarget
    from g4rt.plugins import trt_kernels as K
    h200 = GPUTarget("cuda", 90, 32)
    out = {"kv": K.compile_kv_write("bfloat16", page_size=16, width=16 * 256, target=h200).ptx[:4000],
           "combine": K.compile_combine("bfloat16", head_dim=512, target=h200).ptx[:4000]}
    for dtype in ("bfloat16", "float32"):
        c, _ = K.compile_attention(dtype, num_q_heads=32, num_kv_heads=4, head_dim=512, page_size=48, scale=1.0,
                                   target=h200)
        out[dtype] = {"entry": ".entry attention_abi" in c.ptx, "shared": c.shared, "threads": c.threads}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_wrappers_compile_to_ptx_for_h200(report):
    """The exact compile calls of the plugins' aot_impl, for sm_90 (no GPU needed; compiled, so not
    under the interpreter): PTX comes out, no hidden scratch buffer is asked for, and the attention
    kernel's shared memory fits an H200 at the 31B's global head dim in bf16 and fp32."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert ".entry kv_write_abi" in out["kv"] and ".entry combine_abi" in out["combine"]
    for dtype in ("bfloat16", "float32"):
        assert out[dtype]["entry"]
        assert 0 < out[dtype]["shared"] <= H200_SMEM_BYTES, (dtype, out[dtype])
    report(f"TensorRT attention plugin, D=512 sm_90 shared memory: bf16 {out['bfloat16']['shared']} B, "
           f"fp32 {out['float32']['shared']} B (limit {H200_SMEM_BYTES})")


def test_plugin_signatures_are_real_annotations():
    """tensorrt.plugin checks register/aot_impl annotations with issubclass; postponed annotations
    (`from __future__ import annotations`) would make them strings and break every registration."""
    source = Path(__file__).resolve().parent.parent / "plugins" / "trt_plugins.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            assert "annotations" not in [a.name for a in node.names]


def _layer(kind, name, tensors):
    return {"Name": name, "LayerType": kind, "Inputs": tensors[:1], "Outputs": tensors[1:]}


def test_arena_copy_detector():
    arena = {"arena", "arena_out", "layer0.arena"}
    frame = {"Name": "x", "Dimensions": [-1, 4096]}
    layers = [
        _layer("CaskGemm", "gemm", [{"Name": "arena", "Dimensions": [-1, 4096]}, {"Name": "h", "Dimensions": [7, 64]}]),
        _layer("Reformat", "Reformatting CopyNode for Input Tensor 0 to attn", [{"Name": "q"}, {"Name": "q2"}]),
        _layer("Reformat", "Reformatting CopyNode for Input Tensor 1 to attn", [{"Name": "layer0.arena"}, frame]),
        _layer("Copy", "arena copy", [frame, {"Name": "y", "Dimensions": [-1, 4096]}]),
        _layer("PluginV3", "kv_write", [{"Name": "arena"}, {"Name": "layer0.arena"}]),
    ]
    assert arena_copies(layers, arena, 4096) == ["Reformatting CopyNode for Input Tensor 1 to attn", "arena copy"]
    assert arena_copies(layers[:2] + layers[4:], arena, 4096) == []
    with pytest.raises(RuntimeError, match="DETAILED"):
        arena_copies(["layer names only"], arena, 4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT engines need a CUDA GPU")
@requires_tensorrt
def test_tiny_trt_engine_builds_checks_and_matches_ort(tmp_path):
    from conftest import tiny_config

    from g4rt.cli import check_engine
    from g4rt.export.build import build
    from g4rt.models.checkpoint import write_random_checkpoint
    from g4rt.models.profiles import StepLimits
    from g4rt.runtime.engines import open_engine

    from g4rt.export.onnx_export import example_batch
    ckpt = write_random_checkpoint(tiny_config("31b"), tmp_path / "ckpt", seed=1, dtype="float32")
    limits = StepLimits(max_batched_tokens=64, chunk=32, max_seqs=8, max_frames=64, max_model_len=256)
    trt_dir = build(ckpt, "tensorrt", tmp_path / "trt", dtype="float32", page_tokens=4, progress=False, limits=limits)
    ort_dir = build(ckpt, "onnxruntime", tmp_path / "ort", dtype="float32", page_tokens=4, progress=False)
    assert check_engine(trt_dir)["passed"]
    trt_engine, ort_engine = open_engine(trt_dir, 16), open_engine(ort_dir, 16)
    batch = example_batch(trt_engine.geometry)
    got = trt_engine.step(batch).cpu()
    want = ort_engine.step(batch)
    assert (got - want).abs().max().item() < 1e-2
    assert torch.equal(trt_engine.arena.tensor.cpu(), ort_engine.arena.tensor)


def test_a_dynamic_dimension_the_plugins_compile_for_is_named():
    from g4rt.plugins.trt_plugins import _const

    class Dynamic:
        is_constant = False

    with pytest.raises(RuntimeError, match=r"^attention: q's dim 1 \(num_q_heads\) must be a static dimension"):
        _const(Dynamic(), "attention: q's dim 1 (num_q_heads)")
