"""TensorRT plugins for the two ops: quickly-deployable plugins (QDP, `tensorrt.plugin`), AOT Triton.

Both ops are AOT plugins, one Triton kernel each, compiled to PTX at build time and baked into the
plan (no Python needed at run time). The AOT ABI is `kernel(inputs..., extra int32 args...,
outputs...)`, so thin `@triton.jit` wrappers put our kernels' arguments in that order. Attention uses
the single-pass (NUM_SPLITS=1) launch: split-K decode needs two launches and so an IPluginV3, left for
later. KV write aliases its output to the arena (preview feature ALIASED_PLUGIN_IO_10_03).

Written against the documented TensorRT >= 10.9 Python API (trt-onnx.md §1.3-§2.2 of the research
notes). UNTESTED against a real TensorRT: it cannot be installed on our machines, so every import is
lazy and `require_tensorrt()` raises `TensorRTUnavailable` with the reason. Both the engine build
(export/trt.py) and the runner (runtime/engines/tensorrt.py) register them.
"""
from __future__ import annotations

from . import onnx_schemas as schemas


class TensorRTUnavailable(RuntimeError):
    """TensorRT (with tensorrt.plugin) cannot be imported on this machine."""


def require_tensorrt():
    try:
        import tensorrt as trt
        import tensorrt.plugin  # noqa: F401  (QDP API, TensorRT >= 10.6)
    except Exception as e:  # ImportError, or a broken install (missing libnvinfer)
        raise TensorRTUnavailable(f"tensorrt not importable: {e!r}; the tensorrt backend needs TensorRT >= 10.9 and a GPU "
                         f"(use --backend onnxruntime or inductor here)") from None
    return trt


_registered = False


def register_plugins() -> None:
    """Define the QDPs `gemma4::G4KVWrite` and `gemma4::G4PagedAttention` (once per process)."""
    global _registered
    if _registered:
        return
    require_tensorrt()
    import tensorrt.plugin as trtp
    import triton
    import triton.language as tl

    from .triton_attention import _paged_attn_kernel, default_config
    from .triton_kv_write import _kv_write_kernel

    @triton.jit
    def kv_write_abi(arena, k, v, slots, k_offset, v_offset, stride_frame, arena_out,
                     PAGE: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        _kv_write_kernel(arena_out, k, v, slots, k_offset, v_offset, stride_frame, PAGE, WIDTH, BLOCK)

    @triton.jit
    def attention_abi(q, arena, cu_q, kv_lens, table, first, window_left, k_offset, v_offset, stride_frame,
                      table_stride, out, SCALE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        _paged_attn_kernel(q, arena, cu_q, kv_lens, table, first, out, out, out, SCALE, window_left, k_offset,
                           v_offset, stride_frame, table_stride, 1, HQ, HKV, G, GP, D, PAGE, BLOCK_Q, BLOCK_N,
                           False, False, PREC)

    kw_name = f"{schemas.PLUGIN_NAMESPACE}::{schemas.KV_WRITE}"
    pa_name = f"{schemas.PLUGIN_NAMESPACE}::{schemas.PAGED_ATTENTION}"

    @trtp.register(kw_name)
    def _kv_desc(arena: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, slots: trtp.TensorDesc,
                 k_offset: int, v_offset: int, page_size: int) -> trtp.TensorDesc:
        return arena.aliased()

    @trtp.aot_impl(kw_name)
    def _kv_aot(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int, outputs, tactic):
        width = k.shape_expr[1] * k.shape_expr[2]
        w = _const(k.shape_expr[1]) * _const(k.shape_expr[2])
        block = min(1024, triton.next_power_of_2(w))
        sig = {"arena": f"*{_tl(arena)}", "k": f"*{_tl(k)}", "v": f"*{_tl(v)}", "slots": "*i32", "k_offset": "i32",
               "v_offset": "i32", "stride_frame": "i32", "arena_out": f"*{_tl(arena)}",
               "PAGE": "constexpr", "WIDTH": "constexpr", "BLOCK": "constexpr"}
        compiled = triton.compile(triton.compiler.ASTSource(
            fn=kv_write_abi, signature=sig, constexprs={"PAGE": page_size, "WIDTH": w, "BLOCK": block}))
        lp = trtp.KernelLaunchParams()
        lp.grid_x = k.shape_expr[0]
        lp.grid_y = trtp.cdiv(width, block)
        lp.block_x = compiled.metadata.num_warps * 32
        lp.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(k_offset), trtp.SymInt32(v_offset),
                                             trtp.SymInt32(arena.shape_expr[1])])
        return compiled.metadata.name, compiled.asm["ptx"], lp, extra

    @trtp.register(pa_name)
    def _pa_desc(q: trtp.TensorDesc, arena: trtp.TensorDesc, cu_q: trtp.TensorDesc, kv_lens: trtp.TensorDesc,
                 page_table: trtp.TensorDesc, first_page: trtp.TensorDesc, k_offset: int, v_offset: int,
                 page_size: int, num_kv_heads: int, head_dim: int, window_left: int, scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.aot_impl(pa_name)
    def _pa_aot(q, arena, cu_q, kv_lens, page_table, first_page, k_offset: int, v_offset: int, page_size: int,
                num_kv_heads: int, head_dim: int, window_left: int, scale: float, outputs, tactic):
        hq = _const(q.shape_expr[1])
        g = hq // num_kv_heads
        gp = triton.next_power_of_2(g)
        cfg = default_config(head_dim, decode=False)
        block_q = max(1, cfg["rows"] // gp)
        t = _tl(q)
        sig = {"q": f"*{t}", "arena": f"*{t}", "cu_q": "*i32", "kv_lens": "*i32", "table": "*i32", "first": "*i32",
               "window_left": "i32", "k_offset": "i32", "v_offset": "i32", "stride_frame": "i32",
               "table_stride": "i32", "out": f"*{t}"}
        consts = dict(SCALE=float(scale), HQ=hq, HKV=num_kv_heads, G=g, GP=gp, D=head_dim, PAGE=page_size,
                      BLOCK_Q=block_q, BLOCK_N=cfg["block_n"], PREC="ieee" if t == "fp32" else "tf32")
        sig.update({k: "constexpr" for k in consts})
        compiled = triton.compile(triton.compiler.ASTSource(fn=attention_abi, signature=sig, constexprs=consts),
                                  options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        tokens, seqs = q.shape_expr[0], kv_lens.shape_expr[0]
        lp = trtp.KernelLaunchParams()
        lp.grid_x = trtp.cdiv(tokens - seqs + 1, block_q)
        lp.grid_y = seqs
        lp.grid_z = num_kv_heads
        lp.block_x = compiled.metadata.num_warps * 32
        lp.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (
            window_left, k_offset, v_offset, arena.shape_expr[1], page_table.shape_expr[1])])
        return compiled.metadata.name, compiled.asm["ptx"], lp, extra

    _registered = True


def _const(expr) -> int:
    """A build-time constant dim (heads, head_dim) of a trtp.ShapeExpr."""
    value = getattr(expr, "constant_value", None)
    value = value() if callable(value) else value
    if value is None:
        raise RuntimeError(f"expected a static dimension, got {expr!r}")
    return int(value)


def _tl(desc) -> str:
    import tensorrt as trt
    return {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}[desc.dtype]
