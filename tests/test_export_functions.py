"""The reference ONNX functions, run by ONNX Runtime CPU, against the torch ops of plugins/.

Each case builds a one-node model in domain gemma4 with the function attached, so what ORT runs is
exactly the body that ships inside every exported `model.onnx`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import onnx
import onnxruntime as ort

import g4rt.plugins.ops  # noqa: F401  (registers torch.ops.g4rt.*)
from g4rt.plugins import onnx_functions as functions
from g4rt.plugins import onnx_schemas as schemas

_ONNX_TYPE = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
              torch.int32: onnx.TensorProto.INT32}


def _run_node(op_type: str, inputs: dict[str, torch.Tensor], out_name: str, attrs: dict) -> np.ndarray:
    schemas.register()
    vi = [onnx.helper.make_tensor_value_info(n, _ONNX_TYPE[t.dtype], list(t.shape)) for n, t in inputs.items()]
    node = onnx.helper.make_node(op_type, list(inputs), [out_name], domain=schemas.DOMAIN,
                                 **attrs, **schemas.plugin_attrs())
    first = next(iter(inputs.values()))
    out = onnx.helper.make_tensor_value_info(out_name, _ONNX_TYPE[first.dtype], [None] * first.dim())
    graph = onnx.helper.make_graph([node], "one_op", vi, [out])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    functions.attach(model)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: t.numpy() for n, t in inputs.items()})[0]


def _case(seed, *, hq, hkv, d, page, q_lens, kv_lens, first_pages, frames, dtype):
    """A varlen batch over a random arena whose page tables use shuffled frames."""
    g = torch.Generator().manual_seed(seed)
    block = page * hkv * d
    k_off, v_off = block, 3 * block  # a second layer's blocks, so offsets are not zero
    arena = torch.randn(frames, 4 * block + 7, generator=g).to(dtype)
    pages = [-(-l // page) - f for l, f in zip(kv_lens, first_pages)]
    m = max(pages)
    perm = torch.randperm(frames, generator=g).tolist()
    table = torch.zeros(len(q_lens), m, dtype=torch.int32)
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    cu_q = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g).to(dtype)
    return dict(q=q, arena=arena, cu_q=cu_q, kv_lens=torch.tensor(kv_lens, dtype=torch.int32), page_table=table,
                first_page=torch.tensor(first_pages, dtype=torch.int32)), (k_off, v_off)


@pytest.mark.parametrize("d,hq,hkv,window,first_pages", [
    (256, 4, 2, None, (0, 0, 0)),   # GQA 2:1, no window
    (256, 4, 1, 6, (0, 2, 1)),      # sliding: window 6 keys, resident pages start later
    (512, 2, 2, None, (0, 0, 0)),   # full-layer head dim
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_function_matches_op(d, hq, hkv, window, first_pages, dtype, report):
    from g4rt.plugins.reference import window_left
    page = 4
    inputs, (k_off, v_off) = _case(1, hq=hq, hkv=hkv, d=d, page=page, q_lens=(3, 1, 2), kv_lens=(5, 11, 7),
                                   first_pages=first_pages, frames=12, dtype=dtype)
    wl = window_left(window)
    want = torch.ops.g4rt.paged_attention(*inputs.values(), k_off, v_off, page, hkv, wl, 1.0, "reference")
    got = _run_node(schemas.PAGED_ATTENTION, inputs, "out", dict(
        k_offset=k_off, v_offset=v_off, page_size=page, num_kv_heads=hkv, head_dim=d, window_left=wl, scale=1.0))
    err = np.abs(got.astype(np.float32) - want.float().numpy()).max()
    report(f"ORT reference function: paged attention d={d} {dtype} max |diff| = {err:.2e}")
    assert got.shape == tuple(want.shape)
    assert err < (3e-5 if dtype == torch.float32 else 3e-3)


def test_paged_attention_function_scale_and_window_change_result():
    """Guards against attributes being ignored: a different scale / window must change the output."""
    inputs, (k_off, v_off) = _case(2, hq=2, hkv=1, d=256, page=4, q_lens=(4,), kv_lens=(9,), first_pages=(0,),
                                   frames=4, dtype=torch.float32)
    base = dict(k_offset=k_off, v_offset=v_off, page_size=4, num_kv_heads=1, head_dim=256)
    a = _run_node(schemas.PAGED_ATTENTION, inputs, "out", dict(base, window_left=-1, scale=1.0))
    b = _run_node(schemas.PAGED_ATTENTION, inputs, "out", dict(base, window_left=2, scale=1.0))
    c = _run_node(schemas.PAGED_ATTENTION, inputs, "out", dict(base, window_left=-1, scale=0.5))
    assert np.abs(a - b).max() > 1e-3 and np.abs(a - c).max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,hkv", [(256, 2), (512, 1)])
def test_kv_write_function_matches_op(dtype, d, hkv):
    g = torch.Generator().manual_seed(3)
    page, frames = 4, 5
    block = page * hkv * d
    arena = torch.randn(frames, 2 * block + block, generator=g).to(dtype)
    slots = torch.tensor([7, -1, 0, 19, 12, -1], dtype=torch.int32)  # shuffled frames, two skipped rows
    k = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    v = torch.randn(len(slots), hkv, d, generator=g).to(dtype)
    want = torch.ops.g4rt.kv_write(arena, k, v, slots, block, 2 * block, page, "reference")
    got = _run_node(schemas.KV_WRITE, dict(arena=arena, k=k, v=v, slots=slots), "arena_out",
                    dict(k_offset=block, v_offset=2 * block, page_size=page))
    assert not torch.equal(want, arena)  # the case really writes something
    np.testing.assert_array_equal(got, want.numpy())
