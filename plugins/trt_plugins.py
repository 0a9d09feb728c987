"""TensorRT plugins for the step graph's custom nodes: quickly deployable plugins (QDP,
`tensorrt.plugin`) whose kernels are our Triton kernels compiled ahead of time to PTX and baked into
the plan, so an engine runs without Python (plugins/trt_kernels.py holds the kernels and the launch
arithmetic).

Attention is split-K on TensorRT as on CUDA, and an AOT plugin launches one kernel, so the TensorRT
copy of the graph (`split_attention_nodes`) replaces every G4PagedAttention node by two plugins:

    G4PagedAttentionSplitK(q, arena, cu_q, kv_lens, table, first) -> (out, ws_acc, ws_ml)
    G4SplitKCombine(out, ws_acc, ws_ml, kv_lens, table) -> out        (aliased to its first input)

with the split count a TensorRT shape expression of the CUDA path's rule and a fixed-size fp32
workspace (trt_kernels.split_count / workspace_rows). KV write aliases its output to the arena.
Both aliases need the preview feature ALIASED_PLUGIN_IO_10_03.

Written against the documented TensorRT >= 10.9 Python API (tensorrt.plugin register/aot_impl,
read in NVIDIA/TensorRT's python/packaging/bindings_wheel/tensorrt/plugin). UNTESTED against a real
TensorRT, which cannot be installed on our machines: every TensorRT import is lazy and
`require_tensorrt()` raises `TensorRTUnavailable` with the reason. What runs without TensorRT (the
kernels under the interpreter, their PTX for sm_90, the launch arithmetic, this graph rewrite) is
tested in tests/test_export_tensorrt.py.

This module must not use `from __future__ import annotations`: tensorrt.plugin validates the
register and aot_impl signatures with `inspect.signature` + `issubclass` on their annotations, which
postponed (string) annotations break.
"""
from typing import Tuple

from . import onnx_schemas as schemas

SPLIT_ATTENTION = "G4PagedAttentionSplitK"
SPLIT_COMBINE = "G4SplitKCombine"
# The op types of the TensorRT copy of the graph that have a TensorRT plugin here.
PLUGIN_OPS = (schemas.KV_WRITE, SPLIT_ATTENTION, SPLIT_COMBINE)
MIN_TENSORRT = (10, 9)  # AOT plugins
MIN_TRITON = (3, 5)  # AOT PTX without hidden scratch arguments (Torch-TensorRT's validator asks for it too)


class TensorRTUnavailable(RuntimeError):
    """TensorRT (with tensorrt.plugin) cannot be imported on this machine."""


def _import_tensorrt():
    """(the tensorrt module, None), or (None, why it cannot be imported)."""
    try:
        import tensorrt as trt
        import tensorrt.plugin  # noqa: F401  (QDP API, TensorRT >= 10.6; AOT since 10.9)
    except Exception as e:  # ImportError, or a broken install (missing libnvinfer)
        return None, repr(e)
    return trt, None


def require_tensorrt():
    trt, why = _import_tensorrt()
    if trt is None:
        raise TensorRTUnavailable(f"tensorrt not importable: {why}; the tensorrt backend needs TensorRT >= 10.9 "
                                  f"and a GPU (use --backend onnxruntime or inductor here)")
    return trt


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def prerequisites() -> list[str]:
    """What this machine lacks for `make trt-engine`, one line each with the fix; [] when ready."""
    import importlib.util

    import torch

    missing = []
    trt, why = _import_tensorrt()
    if trt is None:
        missing.append(f"tensorrt >= {'.'.join(map(str, MIN_TENSORRT))} with tensorrt.plugin is not importable "
                       f"({why}): pip install 'g4rt[tensorrt]' (needs an NVIDIA driver)")
    elif _version(trt.__version__) < MIN_TENSORRT:
        missing.append(f"tensorrt {trt.__version__} is older than {'.'.join(map(str, MIN_TENSORRT))} "
                       f"(AOT plugins): pip install -U 'g4rt[tensorrt]'")
    if not torch.cuda.is_available():
        missing.append(f"no CUDA GPU visible to torch {torch.__version__} (a CUDA build of torch and a GPU are "
                       f"needed to build and run the plan)")
    if importlib.util.find_spec("triton") is None:
        missing.append("triton not installed (the plugins' kernels): pip install 'g4rt[triton]'")
    else:
        import triton
        if _version(triton.__version__) < MIN_TRITON:
            missing.append(f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}: "
                           f"pip install -U 'g4rt[triton]'")
    for module in ("onnx", "onnxscript", "onnxruntime", "polygraphy"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"{module} not installed (export and check): pip install 'g4rt[export]'")
    return missing


def split_attention_nodes(model, *, num_q_heads: int, num_sms: int, max_seqs: int, max_width: int):
    """Rewrite `model` (an onnx.ModelProto, in place) for TensorRT: every G4PagedAttention node becomes
    the split-K pair above, with the build's SM count and profile bounds as attributes (they size the
    split rule and the workspace). The G4PagedAttention reference function is dropped, so a plugin
    that failed to register fails the parse instead of TensorRT inlining the slow reference.
    Returns `model`."""
    import onnx

    from .trt_kernels import workspace_rows

    rule = dict(num_sms=num_sms, max_seqs=max_seqs, max_width=max_width)
    nodes = []
    for node in model.graph.node:
        if node.domain != schemas.DOMAIN or node.op_type != schemas.PAGED_ATTENTION:
            nodes.append(node)
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                 if a.name not in schemas.plugin_attrs()}
        shape = dict(num_kv_heads=attrs["num_kv_heads"], head_dim=attrs["head_dim"], page_size=attrs["page_size"],
                     window_left=attrs["window_left"])
        rows = workspace_rows(num_q_heads=num_q_heads, **shape, **rule)
        partial, ws_acc, ws_ml = (f"{node.output[0]}__{s}" for s in ("partial", "ws_acc", "ws_ml"))
        nodes.append(onnx.helper.make_node(
            SPLIT_ATTENTION, list(node.input), [partial, ws_acc, ws_ml], name=f"{node.name}__splitk",
            domain=schemas.DOMAIN, **attrs, **rule, workspace_rows=rows, **schemas.plugin_attrs()))
        nodes.append(onnx.helper.make_node(
            SPLIT_COMBINE, [partial, ws_acc, ws_ml, node.input[3], node.input[4]], [node.output[0]],
            name=f"{node.name}__combine", domain=schemas.DOMAIN, num_q_heads=num_q_heads, **shape, **rule,
            **schemas.plugin_attrs()))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    keep = [f for f in model.functions if not (f.domain == schemas.DOMAIN and f.name == schemas.PAGED_ATTENTION)]
    del model.functions[:]
    model.functions.extend(keep)
    return model


_registered = False


def register_plugins() -> None:
    """Define the QDPs of PLUGIN_OPS in namespace `gemma4` (once per process)."""
    global _registered
    if _registered:
        return
    trt = require_tensorrt()
    import tensorrt.plugin as trtp

    from . import trt_kernels as K

    ns = schemas.PLUGIN_NAMESPACE

    @trtp.register(f"{ns}::{schemas.KV_WRITE}")
    def _kv_desc(arena: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, slots: trtp.TensorDesc,
                 k_offset: int, v_offset: int, page_size: int) -> trtp.TensorDesc:
        return arena.aliased()

    @trtp.aot_impl(f"{ns}::{schemas.KV_WRITE}")
    def _kv_aot(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int, outputs, tactic):
        width = (_const(k.shape_expr[1], "KV write: k's dim 1 (num_kv_heads)")
                 * _const(k.shape_expr[2], "KV write: k's dim 2 (head_dim)"))
        c = K.compile_kv_write(_dtype(arena), page_size=page_size, width=width)
        lp = _launch(c, (k.shape_expr[0], K.IntOps.cdiv(width, K.kv_write_block(width))))
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(k_offset), trtp.SymInt32(v_offset),
                                             trtp.SymInt32(arena.shape_expr[1])])
        return c.name, c.ptx, lp, extra

    @trtp.register(f"{ns}::{SPLIT_ATTENTION}")
    def _sa_desc(q: trtp.TensorDesc, arena: trtp.TensorDesc, cu_q: trtp.TensorDesc, kv_lens: trtp.TensorDesc,
                 page_table: trtp.TensorDesc, first_page: trtp.TensorDesc, k_offset: int, v_offset: int,
                 page_size: int, num_kv_heads: int, head_dim: int, window_left: int, scale: float, num_sms: int,
                 max_seqs: int, max_width: int,
                 workspace_rows: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return (q.like(), trtp.from_shape_expr((workspace_rows, head_dim), dtype=trt.float32),
                trtp.from_shape_expr((workspace_rows, 2), dtype=trt.float32))

    @trtp.aot_impl(f"{ns}::{SPLIT_ATTENTION}")
    def _sa_aot(q, arena, cu_q, kv_lens, page_table, first_page, k_offset: int, v_offset: int, page_size: int,
                num_kv_heads: int, head_dim: int, window_left: int, scale: float, num_sms: int, max_seqs: int,
                max_width: int, workspace_rows: int, outputs, tactic):
        num_q_heads = _const(q.shape_expr[1], "attention: q's dim 1 (num_q_heads)")
        c, tiles = K.compile_attention(_dtype(q), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, page_size=page_size, scale=scale)
        tokens, seqs, width = q.shape_expr[0], kv_lens.shape_expr[0], page_table.shape_expr[1]
        splits = K.split_count(K.TrtOps, tokens, seqs, width, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               page_size=page_size, window_left=window_left, num_sms=num_sms, max_seqs=max_seqs,
                               max_width=max_width)
        lp = _launch(c, K.attention_grid(K.TrtOps, tokens, seqs, splits, block_q=tiles["block_q"],
                                         num_kv_heads=num_kv_heads, dv_split=tiles["dv_split"]))
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (
            window_left, k_offset, v_offset, arena.shape_expr[1], page_table.shape_expr[1], splits)])
        return c.name, c.ptx, lp, extra

    @trtp.register(f"{ns}::{SPLIT_COMBINE}")
    def _co_desc(partial: trtp.TensorDesc, ws_acc: trtp.TensorDesc, ws_ml: trtp.TensorDesc, kv_lens: trtp.TensorDesc,
                 page_table: trtp.TensorDesc, num_q_heads: int, head_dim: int, num_kv_heads: int, page_size: int,
                 window_left: int, num_sms: int, max_seqs: int, max_width: int) -> trtp.TensorDesc:
        return partial.aliased()

    @trtp.aot_impl(f"{ns}::{SPLIT_COMBINE}")
    def _co_aot(partial, ws_acc, ws_ml, kv_lens, page_table, num_q_heads: int, head_dim: int, num_kv_heads: int,
                page_size: int, window_left: int, num_sms: int, max_seqs: int, max_width: int, outputs, tactic):
        c = K.compile_combine(_dtype(partial), head_dim=head_dim)
        tokens, seqs, width = partial.shape_expr[0], kv_lens.shape_expr[0], page_table.shape_expr[1]
        splits = K.split_count(K.TrtOps, tokens, seqs, width, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               page_size=page_size, window_left=window_left, num_sms=num_sms, max_seqs=max_seqs,
                               max_width=max_width)
        lp = _launch(c, K.combine_grid(K.TrtOps, tokens, splits, num_q_heads=num_q_heads))
        return c.name, c.ptx, lp, trtp.SymIntExprs.from_tuple([trtp.SymInt32(splits)])

    _registered = True


def _launch(compiled, grid):
    import tensorrt.plugin as trtp
    lp = trtp.KernelLaunchParams()
    for axis, size in zip(("grid_x", "grid_y", "grid_z"), grid):
        setattr(lp, axis, size)
    lp.block_x = compiled.threads
    lp.shared_mem = compiled.shared
    return lp


def _const(expr, what: str) -> int:
    """A build-time constant dim (heads, head_dim) of a trtp.ShapeExpr; `what` names it for the error."""
    if not expr.is_constant:
        raise RuntimeError(f"{what} must be a static dimension (the plugin's kernel is compiled for it), got {expr!r}")
    return int(expr.constant_value())


def _dtype(desc) -> str:
    import tensorrt as trt
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    if desc.dtype not in names:
        raise RuntimeError(f"g4rt plugins take float32, float16 or bfloat16 tensors, got {desc.dtype}")
    return names[desc.dtype]
