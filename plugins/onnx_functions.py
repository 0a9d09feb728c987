"""Reference ONNX functions for the plugin ops, written in plain ONNX operators.

Why: ONNX Runtime has no kernel for `gemma4::G4PagedAttention` / `G4KVWrite` / `G4MoE`, but it inlines
a model-local `FunctionProto` with the same domain and name. Shipping these bodies inside
`model.onnx` makes the exported graph runnable (and testable) on any ORT CPU, while TensorRT still
maps the nodes to our plugins because they carry `plugin_namespace` (trt-onnx.md §1.4, §5.1).

Semantics follow plugins/README.md exactly. The attention body materialises every sequence's
resident keys for every query token ([T, M*page_size, H, D]): correct, simple, and only meant for
the small shapes of CPU tests and reference runs, not for long contexts. Likewise the MoE body gathers
each (token, slot)'s expert weights ([T, k, 2I, H] and [T, k, H, I]): fine for tiny models, not for
serving.
"""
from __future__ import annotations

import onnx
from onnxscript import script
from onnxscript import opset18 as op
from onnxscript.values import Opset

from . import onnx_schemas as schemas

_g4 = Opset(schemas.DOMAIN, schemas.OPSET_VERSION)


@script(_g4, default_opset=op)
def G4PagedAttention(q, arena, cu_q, kv_lens, page_table, first_page,
                     k_offset: int, v_offset: int, page_size: int, num_kv_heads: int, head_dim: int,
                     window_left: int, scale: float):
    # Which sequence each query row belongs to: b(t) = #{b : cu_q[b+1] <= t}.
    num_tokens = op.Shape(q, start=0, end=1)
    t = op.Range(op.Constant(value_int=0), op.Squeeze(num_tokens, [0]), op.Constant(value_int=1))  # [T] int64
    ends = op.Cast(op.Slice(cu_q, op.Constant(value_ints=[1]), op.Constant(value_ints=[2147483647])), to=7)
    seq = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, [0]), op.Unsqueeze(t, [1])), to=7),
                       op.Constant(value_ints=[1]), keepdims=0)  # [T]
    # Absolute query position: kv_lens[b] - cu_q[b+1] + t.
    q_pos = op.Gather(op.Cast(kv_lens, to=7), seq) - op.Gather(ends, seq) + t  # [T]

    # Resident keys of each sequence, gathered through its page table: [B, M*P, H, D].
    heads = op.Constant(value_int=num_kv_heads)
    dim = op.Constant(value_int=head_dim)
    page = op.Constant(value_int=page_size)
    blk = page * heads * dim
    k_lo = op.Constant(value_int=k_offset)
    v_lo = op.Constant(value_int=v_offset)
    k_frames = op.Slice(arena, op.Unsqueeze(k_lo, [0]), op.Unsqueeze(k_lo + blk, [0]), op.Constant(value_ints=[1]))
    v_frames = op.Slice(arena, op.Unsqueeze(v_lo, [0]), op.Unsqueeze(v_lo + blk, [0]), op.Constant(value_ints=[1]))
    kv_shape = op.Concat(op.Constant(value_ints=[0, -1]), op.Unsqueeze(heads, [0]), op.Unsqueeze(dim, [0]), axis=0)
    k_seq = op.Reshape(op.Gather(k_frames, page_table, axis=0), kv_shape)  # [B, M*P, H, D]
    v_seq = op.Reshape(op.Gather(v_frames, page_table, axis=0), kv_shape)

    # Per query row: its sequence's keys [T, N, H, D] and their absolute positions [T, N].
    k_tok = op.Cast(op.Gather(k_seq, seq, axis=0), to=1)
    v_tok = op.Cast(op.Gather(v_seq, seq, axis=0), to=1)
    n = op.Shape(k_seq, start=1, end=2)
    k_idx = op.Range(op.Constant(value_int=0), op.Squeeze(n, [0]), op.Constant(value_int=1))
    k_pos = op.Unsqueeze(op.Gather(op.Cast(first_page, to=7), seq) * page, [1]) + op.Unsqueeze(k_idx, [0])
    qp = op.Unsqueeze(q_pos, [1])
    allowed = op.LessOrEqual(k_pos, qp)
    wl = op.Constant(value_int=window_left)
    in_window = op.Or(op.Less(wl, op.Constant(value_int=0)), op.GreaterOrEqual(k_pos, qp - wl))
    allowed = op.Unsqueeze(op.And(allowed, in_window), [1, 2])  # [T, 1, 1, N]

    # GQA without repeating K/V: query heads [H*G] -> [H, G], head j reads KV head j // G.
    grouped = op.Concat(op.Constant(value_ints=[0]), op.Unsqueeze(heads, [0]), op.Constant(value_ints=[-1]),
                        op.Unsqueeze(dim, [0]), axis=0)
    qf = op.Reshape(op.Cast(q, to=1), grouped)  # [T, H, G, D]
    scores = op.MatMul(qf, op.Transpose(k_tok, perm=[0, 2, 3, 1])) * op.Constant(value_float=scale)  # [T, H, G, N]
    neg_inf = op.Constant(value_float=float("-inf"))
    probs = op.Softmax(op.Where(allowed, scores, neg_inf), axis=-1)
    probs = op.Where(allowed, probs, op.Constant(value_float=0.0))  # a row with no key: NaN -> 0
    out = op.MatMul(probs, op.Transpose(v_tok, perm=[0, 2, 1, 3]))  # [T, H, G, D]
    return op.CastLike(op.Reshape(out, op.Shape(q)), q)


@script(_g4, default_opset=op)
def G4KVWrite(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int):
    # Element index of row (slot, h, d) for K: frame * E + k_offset + (r * H + h) * D + d.
    wide = op.Cast(slots, to=7)
    keep = op.GreaterOrEqual(wide, op.Constant(value_int=0))
    s = op.Compress(wide, keep, axis=0)
    page = op.Constant(value_int=page_size)
    frame_elems = op.Shape(arena, start=1, end=2)
    row = op.Shape(k, start=1)  # [H, D]
    row_elems = op.ReduceProd(row, keepdims=1)  # H * D
    base = (s / page) * frame_elems + (s % page) * row_elems  # [Tw]
    within = op.Range(op.Constant(value_int=0), op.Squeeze(row_elems, [0]), op.Constant(value_int=1))
    idx = op.Unsqueeze(base, [1]) + op.Unsqueeze(within, [0])  # [Tw, H*D]
    flat_rows = op.Concat(op.Constant(value_ints=[-1]), row_elems, axis=0)
    k_rows = op.Reshape(op.Compress(k, keep, axis=0), flat_rows)
    v_rows = op.Reshape(op.Compress(v, keep, axis=0), flat_rows)
    k_idx = op.Unsqueeze(idx + op.Constant(value_int=k_offset), [2])
    v_idx = op.Unsqueeze(idx + op.Constant(value_int=v_offset), [2])
    flat = op.Reshape(arena, op.Constant(value_ints=[-1]))
    flat = op.ScatterND(op.ScatterND(flat, k_idx, k_rows), v_idx, v_rows)
    return op.Reshape(flat, op.Shape(arena))


@script(_g4, default_opset=op)
def G4MoE(x, idx, w, gate_up, down):
    # Each (token, slot)'s expert: h = x_t @ gate_up[e].T -> [T, k, 1, 2I], in the model dtype.
    w1 = op.Gather(gate_up, idx, axis=0)  # [T, k, 2I, H]
    h = op.Cast(op.MatMul(op.Unsqueeze(x, [1, 2]), op.Transpose(w1, perm=[0, 1, 3, 2])), to=1)
    gate, up = op.Split(h, num_outputs=2, axis=-1)
    # gelu_tanh, rounded to the model dtype before the product with up, as eager torch rounds.
    z = op.Constant(value_float=0.7978845608028654) * (gate + op.Constant(value_float=0.044715) * gate * gate * gate)
    gelu = gate * op.Constant(value_float=0.5) * (op.Constant(value_float=1.0) + op.Tanh(z))
    act = op.CastLike(op.Cast(op.CastLike(gelu, x), to=1) * up, x)
    w2 = op.Gather(down, idx, axis=0)  # [T, k, H, I]
    y = op.Squeeze(op.MatMul(act, op.Transpose(w2, perm=[0, 1, 3, 2])), [2])  # [T, k, H]
    y = op.CastLike(op.Cast(y, to=1) * op.Unsqueeze(op.Cast(w, to=1), [2]), x)
    # A token's terms in ascending expert order, summed left to right into a model-dtype accumulator.
    k = op.Shape(idx, start=1, end=2)
    _, order = op.TopK(idx, k, largest=0, sorted=1)
    y = op.GatherElements(y, op.Expand(op.Unsqueeze(order, [2]), op.Shape(y)), axis=1)
    acc = op.CastLike(op.ConstantOfShape(op.Shape(x)), x)
    for j in range(op.Squeeze(k, [0])):
        acc = op.CastLike(op.Cast(acc, to=1) + op.Cast(op.Gather(y, j, axis=1), to=1), x)
    return acc


def function_protos() -> list[onnx.FunctionProto]:
    """The reference bodies, ready to append to `ModelProto.functions`."""
    schemas.register()
    return [G4PagedAttention.to_function_proto(), G4KVWrite.to_function_proto(), G4MoE.to_function_proto()]


def attach(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the reference functions (replacing stale copies) and the opset imports they need."""
    protos = function_protos()
    names = {(f.domain, f.name) for f in protos}
    keep = [f for f in model.functions if (f.domain, f.name) not in names]
    del model.functions[:]
    model.functions.extend(keep + protos)
    have = {o.domain for o in model.opset_import}
    if schemas.DOMAIN not in have:
        model.opset_import.append(onnx.helper.make_opsetid(schemas.DOMAIN, schemas.OPSET_VERSION))
    return model
