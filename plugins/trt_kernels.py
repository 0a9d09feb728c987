"""The TensorRT plugins' kernels and launch arithmetic (plugins/trt_plugins.py registers them).

TensorRT's AOT plugin ABI is `kernel(inputs..., extra int32 args..., outputs...)`, where the extra
args are TensorRT shape expressions; these `@triton.jit` wrappers put our kernels' arguments in that
order. One AOT plugin launches exactly one kernel, and split-K decode needs two (per-split partials,
then their combine), so attention is two plugins on TensorRT (see `trt_plugins.split_attention_nodes`):

    attention_abi(q, arena, cu_q, kv_lens, table, first, <extras>, out, ws_acc, ws_ml)
    combine_abi(out, ws_acc, ws_ml, kv_lens, table, num_splits, out)   (output aliased to `out`)

One compiled variant serves every shape: `num_splits` is a runtime argument, with one split the first
kernel writes `out` itself and the combine returns at once.

The launch arithmetic is written once over an `ops` namespace: `IntOps` evaluates it on Python ints
(tests, and the workspace size), `TrtOps` builds the same expressions from `tensorrt.plugin` shape
expressions inside `aot_impl`, where the shapes are symbolic. `split_count` is the CUDA path's rule
(triton_attention.paged_attention: decode_splits of the power-of-two buckets of plugins/buckets.py)
spelled with `+ - * // min max cdiv <` and `==`, the operations TensorRT's expressions have; the
tests check it equals decode_splits over a range of batches and widths.
"""
from __future__ import annotations

import builtins
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_attention import (MAX_DECODE_SPLITS, SPLIT_MIN_ELEMS, _combine_kernel, _paged_attn_kernel,
                               default_config, query_block)
from .triton_kv_write import _kv_write_kernel, kv_write_block

# The dtypes a plan's kernels take, by name, as Triton's signatures spell them; their sizes are torch's.
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
ELEM_BYTES = {name: getattr(torch, name).itemsize for name in TRITON_DTYPES}


@triton.jit
def kv_write_abi(arena, k, v, slots, k_offset, v_offset, stride_frame, arena_out,
                 PAGE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    _kv_write_kernel(arena_out, k, v, slots, k_offset, v_offset, stride_frame, PAGE, WIDTH, BLOCK)


@triton.jit
def attention_abi(q, arena, cu_q, kv_lens, table, first, window_left, k_offset, v_offset, stride_frame,
                  table_stride, num_splits, out, ws_acc, ws_ml, SCALE: tl.constexpr, HQ: tl.constexpr,
                  HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr, INTERIOR: tl.constexpr,
                  UPCAST: tl.constexpr, PREC: tl.constexpr):
    # Keyword constexprs: the kernel's tile parameters, by name. With DV_SPLIT > 1 and several splits
    # each column slice writes its part of a partial and the same (m, l): identical values. No tensor-memory
    # copy descriptors (k_desc, v_desc None): the plugin's ABI passes pointers only. The KV write and the q/k/v norms
    # are plugins of their own (k_new .. eps None).
    if num_splits == 1:
        _paged_attn_kernel(q, arena, cu_q, kv_lens, table, first, out, ws_acc, ws_ml, SCALE, window_left,
                           k_offset, v_offset, stride_frame, table_stride, 1, None, None, None, None, None, None, None,
                           None, None, None, None,
                           HQ=HQ, HKV=HKV, G=G, GP=GP, D=D, PAGE=PAGE, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, SPLIT=False,
                           DV_SPLIT=DV_SPLIT, INTERIOR=INTERIOR, UPCAST=UPCAST, PREC=PREC)
    else:
        _paged_attn_kernel(q, arena, cu_q, kv_lens, table, first, out, ws_acc, ws_ml, SCALE, window_left,
                           k_offset, v_offset, stride_frame, table_stride, num_splits, None, None, None, None, None,
                           None, None, None, None, None, None,
                           HQ=HQ, HKV=HKV, G=G, GP=GP, D=D, PAGE=PAGE, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, SPLIT=True,
                           DV_SPLIT=DV_SPLIT, INTERIOR=INTERIOR, UPCAST=UPCAST, PREC=PREC)


@triton.jit
def combine_abi(out_in, ws_acc, ws_ml, kv_lens, table, num_splits, out, D: tl.constexpr, BLOCK_S: tl.constexpr):
    # The ABI passes every input of the plugin: out_in (the buffer `out` aliases), kv_lens and table
    # (the split rule's shapes) are parameters only so the arguments line up.
    if num_splits > 1:
        _combine_kernel(ws_acc, ws_ml, out, num_splits, D, BLOCK_S)


class IntOps:
    """The launch arithmetic on Python ints: what TensorRT's expressions evaluate to for one shape."""

    const = staticmethod(int)
    max = staticmethod(builtins.max)
    min = staticmethod(builtins.min)

    @staticmethod
    def lt(a, b) -> int:
        return int(a < b)

    @staticmethod
    def eq(a, b) -> int:
        return int(a == b)

    @staticmethod
    def cdiv(a, b) -> int:
        return -(-a // b)


class TrtOps:
    """The same arithmetic on `tensorrt.plugin` shape expressions (valid inside aot_impl)."""

    @staticmethod
    def const(x: int):
        import tensorrt.plugin as trtp
        return trtp.ShapeExpr(x)

    @classmethod
    def lt(cls, a, b):
        return (cls.const(a) if isinstance(a, int) else a) < b

    @classmethod
    def eq(cls, a, b):
        return (cls.const(a) if isinstance(a, int) else a) == b

    @staticmethod
    def max(a, b):
        import tensorrt.plugin as trtp
        return trtp.max(a, b)

    @staticmethod
    def min(a, b):
        import tensorrt.plugin as trtp
        return trtp.min(a, b)

    @staticmethod
    def cdiv(a, b):
        import tensorrt.plugin as trtp
        return trtp.cdiv(a, b)


def pow2_bucket_expr(ops, x, x_max: int):
    """plugins.buckets.pow2_bucket(x) for 1 <= x <= x_max without a logarithm (TensorRT's
    expressions have none): 1 + the sum of 2^k over the k with 2^k < x."""
    out = ops.const(1)
    for k in range(max(0, x_max - 1).bit_length()):
        out = out + ops.lt(1 << k, x) * (1 << k)
    return out


def split_count(ops, tokens, seqs, width, *, num_kv_heads: int, head_dim: int, page_size: int, window_left: int,
                num_sms: int, max_seqs: int, max_width: int):
    """The CUDA path's decode split count for a step of `tokens` tokens over `seqs` sequences and a
    page table `width` wide (decode_splits on pow2_bucket(B) and pow2_bucket(width) * page keys,
    capped by the window); 1 when the step is not a decode (T != B)."""
    batch = pow2_bucket_expr(ops, seqs, max_seqs)
    max_keys = pow2_bucket_expr(ops, width, max_width) * page_size
    if window_left >= 0:
        max_keys = ops.min(max_keys, window_left + 1)
    programs = batch * num_kv_heads
    runs = max_keys * head_dim // SPLIT_MIN_ELEMS  # splits the keys allow
    wide = ops.max(1, ops.min(ops.min(ops.cdiv(2 * num_sms, programs), runs), MAX_DECODE_SPLITS))
    splits = ops.const(1) + (wide - 1) * ops.lt(programs, num_sms)
    return ops.const(1) + (splits - 1) * ops.eq(tokens, seqs)


def workspace_rows(*, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, window_left: int,
                   num_sms: int, max_seqs: int, max_width: int) -> int:
    """Rows of the split-K workspace: the largest B * Hq * splits of any decode the profile allows (a
    partial's row is (token * Hq + head) * splits + split). Splits grow with the table width, so the
    widest table bounds them."""
    rule = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, window_left=window_left,
                num_sms=num_sms, max_seqs=max_seqs, max_width=max_width)
    return max(b * num_q_heads * split_count(IntOps, b, b, max_width, **rule) for b in range(1, max_seqs + 1))


def attention_grid(ops, tokens, seqs, num_splits, *, block_q: int, num_kv_heads: int, dv_split: int = 1) -> tuple:
    """(x, y, z) of the attention launch, as on the CUDA path: query blocks x splits x output column
    slices, sequences, KV heads (T - B + 1 bounds any sequence's query count)."""
    return ops.cdiv(tokens - seqs + 1, block_q) * num_splits * dv_split, seqs, ops.const(num_kv_heads)


def combine_grid(ops, tokens, num_splits, *, num_q_heads: int) -> tuple:
    """One program per (token, query head) when there are splits to merge, else one program that
    returns at once (a launch cannot have zero programs)."""
    return (ops.const(1) + (tokens * num_q_heads - 1) * ops.lt(1, num_splits),)


def attention_tiles(head_dim: int, dtype: str, group: int) -> dict:
    """Tiles of the one attention kernel a plan holds for prefill and decode alike: the CUDA path's
    prefill config for this head dim at this dtype's element size (fp32 halves the tiles, or D=512
    would ask for more shared memory than an H200 has), with the group's query heads (padded to a
    power of two) folded into the rows as the CUDA launcher does."""
    if dtype not in ELEM_BYTES:
        raise ValueError(f"no attention tiles for dtype {dtype!r}; known: {', '.join(ELEM_BYTES)}")
    cfg = {"dv_split": 1, "interior": True, **default_config(head_dim, decode=False, elem_bytes=ELEM_BYTES[dtype])}
    cfg.pop("tma", None)  # the plugin's ABI passes pointers, not copy descriptors
    cfg.pop("wgmma", None)  # and launches this module's Triton kernel, not the Gluon one
    cfg.update(group_pad=triton.next_power_of_2(group), block_q=query_block(cfg["rows"], group))
    return cfg


# ---- compiling the wrappers to PTX (what aot_impl hands TensorRT) ------------------------------


class Compiled(NamedTuple):
    """One compiled wrapper: what aot_impl returns to TensorRT and the launch parameters it needs."""

    name: str
    ptx: str
    threads: int  # per block
    shared: int  # shared memory bytes per block


def _compile(fn, signature: dict, constexprs: dict, target=None, **options) -> Compiled:
    """triton.compile for the current GPU (or `target`, e.g. GPUTarget("cuda", 90, 32) on a machine
    without one). TensorRT passes null for trailing parameters it does not know, so Triton's hidden
    scratch buffers must be unused."""
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    kw = {"target": target} if target is not None else {}
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                              options=options or None, **kw)
    md = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, scratch, 0):
            raise RuntimeError(f"{fn.__name__}: Triton asks for {scratch}={getattr(md, scratch)}, which a "
                               f"TensorRT AOT plugin cannot provide")
    return Compiled(md.name, compiled.asm["ptx"], md.num_warps * 32, md.shared)


def compile_kv_write(dtype: str, *, page_size: int, width: int, target=None) -> Compiled:
    t = TRITON_DTYPES[dtype]
    sig = {"arena": f"*{t}", "k": f"*{t}", "v": f"*{t}", "slots": "*i32", "k_offset": "i32", "v_offset": "i32",
           "stride_frame": "i32", "arena_out": f"*{t}"}
    return _compile(kv_write_abi, sig, {"PAGE": page_size, "WIDTH": width, "BLOCK": kv_write_block(width)},
                    target, num_warps=4)


def compile_attention(dtype: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      scale: float, target=None) -> tuple[Compiled, dict]:
    """The attention wrapper for one layer kind, and the tiles it was compiled with."""
    t = TRITON_DTYPES[dtype]
    group = num_q_heads // num_kv_heads
    tiles = attention_tiles(head_dim, dtype, group)
    sig = {"q": f"*{t}", "arena": f"*{t}", "cu_q": "*i32", "kv_lens": "*i32", "table": "*i32", "first": "*i32",
           "window_left": "i32", "k_offset": "i32", "v_offset": "i32", "stride_frame": "i32", "table_stride": "i32",
           "num_splits": "i32", "out": f"*{t}", "ws_acc": "*fp32", "ws_ml": "*fp32"}
    consts = dict(SCALE=float(scale), HQ=num_q_heads, HKV=num_kv_heads, G=group, GP=tiles["group_pad"], D=head_dim,
                  PAGE=page_size, BLOCK_Q=tiles["block_q"], BLOCK_N=tiles["block_n"], DV_SPLIT=tiles["dv_split"],
                  INTERIOR=tiles["interior"], UPCAST=False, PREC="ieee" if dtype == "float32" else "tf32")
    return _compile(attention_abi, sig, consts, target, num_warps=tiles["num_warps"],
                    num_stages=tiles["num_stages"]), tiles


def compile_combine(dtype: str, *, head_dim: int, target=None) -> Compiled:
    t = TRITON_DTYPES[dtype]
    sig = {"out_in": f"*{t}", "ws_acc": "*fp32", "ws_ml": "*fp32", "kv_lens": "*i32", "table": "*i32",
           "num_splits": "i32", "out": f"*{t}"}
    return _compile(combine_abi, sig, {"D": head_dim, "BLOCK_S": MAX_DECODE_SPLITS}, target, num_warps=4)
