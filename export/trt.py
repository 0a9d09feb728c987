"""TensorRT backend: plugins (QDP, AOT Triton), engine build from the exported ONNX, and a runner.

Written against the documented TensorRT >= 10.9 Python API (trt-onnx.md §1.3-§2.2); nothing here can
run on our CPU machines (TensorRT is not installable there), so every import is lazy and
`require_tensorrt()` raises a clear error. UNTESTED against a real TensorRT: see export/README.md.

Plugins: both ops are AOT quickly-deployable plugins, one Triton kernel each, compiled to PTX at build
time and baked into the plan (no Python needed at run time). The AOT ABI is
`kernel(inputs..., extra int32 args..., outputs...)`, so thin `@triton.jit` wrappers put our
kernels' arguments in that order. Attention uses the single-pass (NUM_SPLITS=1) launch: split-K
decode needs two launches and so an IPluginV3, left for later. KV write aliases its output to the
arena (preview feature ALIASED_PLUGIN_IO_10_03).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from . import schemas
from .onnx_export import MODEL_FILE, OUTPUT_NAMES

PLAN_FILE = "engine.plan"
TIMING_CACHE = "timing.cache"
# Optimisation profile: (min, opt, max) per dynamic dim.
PROFILE = {"tokens": (1, 64, 8192), "seqs": (1, 16, 256), "sliding_pages": (1, 80, 160),
           "full_pages": (1, 256, 4096), "rows": (1, 16, 256), "frames": (1, 4096, 1 << 20)}


def require_tensorrt():
    try:
        import tensorrt as trt
        import tensorrt.plugin  # noqa: F401  (QDP API, TensorRT >= 10.6)
    except Exception as e:  # ImportError, or a broken install (missing libnvinfer)
        from .build import BuildError
        raise BuildError(f"tensorrt not importable: {e!r}; the tensorrt backend needs TensorRT >= 10.9 and a GPU "
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

    from g4rt.plugins.triton_attention import _paged_attn_kernel, default_config
    from g4rt.plugins.triton_kv_write import _kv_write_kernel

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


def _profile_shapes(manifest_geometry_frame_elems: int) -> dict[str, tuple]:
    """min/opt/max shape per graph input, from PROFILE."""
    p = PROFILE
    tok = p["tokens"]
    seqs = p["seqs"]
    return {
        "arena": tuple((f, manifest_geometry_frame_elems) for f in p["frames"]),
        "token_ids": tuple((t,) for t in tok), "positions": tuple((t,) for t in tok),
        "cu_q": tuple((s + 1,) for s in seqs), "kv_lens": tuple((s,) for s in seqs),
        "sliding_table": tuple(zip(seqs, p["sliding_pages"])), "sliding_first": tuple((s,) for s in seqs),
        "sliding_slots": tuple((t,) for t in tok), "full_table": tuple(zip(seqs, p["full_pages"])),
        "full_slots": tuple((t,) for t in tok), "logits_rows": tuple((r,) for r in p["rows"]),
    }


def build_trt_engine(engine_dir: str | Path) -> dict:
    """Parse `model.onnx` with our plugins registered, check the parser picked them, build and write
    `engine.plan`. Returns manifest additions (files, profiles, TensorRT version)."""
    trt = require_tensorrt()
    from . import manifest as mf
    register_plugins()
    out = Path(engine_dir)
    manifest = mf.read_manifest(out)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(out / MODEL_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {out / MODEL_FILE}: {errors}")
    plugin_layers = sum(network.get_layer(i).type == trt.LayerType.PLUGIN_V3 for i in range(network.num_layers))
    expected = sum(1 for _ in _custom_nodes(out))
    if plugin_layers != expected:
        raise RuntimeError(f"the parser made {plugin_layers} plugin layers for {expected} custom nodes: the plugins "
                           f"were not picked (reference functions inlined instead?)")
    cfg = builder.create_builder_config()
    cfg.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in _profile_shapes(manifest["geometry"]["frame_elems"]).items():
        profile.set_shape(name, lo, opt, hi)
    cfg.add_optimization_profile(profile)
    cache_path = out / TIMING_CACHE
    cache = cfg.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    cfg.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, cfg)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the log above)")
    (out / PLAN_FILE).write_bytes(bytes(plan))
    cache_path.write_bytes(bytes(cfg.get_timing_cache().serialize()))
    files = dict(manifest.get("files", {}), plan=PLAN_FILE, timing_cache=TIMING_CACHE)
    return {"files": files, "profiles": {k: list(v) for k, v in PROFILE.items()}, "tensorrt_version": trt.__version__}


def _custom_nodes(out: Path):
    import onnx
    model = onnx.load(str(out / MODEL_FILE), load_external_data=False)
    return [n for n in model.graph.node if n.domain == schemas.DOMAIN]


class TrtEngine:
    """Run `engine.plan` with execute_async_v3; the arena input and `arena_out` share one buffer."""

    def __init__(self, engine_dir: str | Path, num_frames: int, device: str = "cuda"):
        trt = require_tensorrt()
        from g4rt.runtime.arena import Arena

        from . import manifest as mf
        register_plugins()
        self.engine_dir = Path(engine_dir)
        self.manifest = mf.check_manifest(self.engine_dir, backend="tensorrt", check_kernels=True)
        self.geometry = mf.manifest_geometry(self.manifest)
        self.config = mf.manifest_config(self.manifest)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine((self.engine_dir / PLAN_FILE).read_bytes())
        self.context = self.engine.create_execution_context()
        self.arena = Arena.for_geometry(self.geometry, num_frames, self.manifest["dtype"], device)
        self.stream = torch.cuda.Stream(device=self.arena.device)

    def step(self, batch, seq_ids: Sequence[int] = ()) -> torch.Tensor:
        from g4rt.models.step import StepBatch
        dev = self.arena.device
        b = batch.to(dev)
        tensors = {"arena": self.arena.tensor, **dict(zip(StepBatch.names(), b.tensors()))}
        for name, t in tensors.items():
            t = t.contiguous()
            tensors[name] = t
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        vocab = self.geometry.layout.config.vocab_size
        logits = torch.empty(b.logits_rows.shape[0], vocab, dtype=torch.float32, device=dev)
        self.context.set_tensor_address(OUTPUT_NAMES[0], logits.data_ptr())
        self.context.set_tensor_address(OUTPUT_NAMES[1], self.arena.tensor.data_ptr())  # aliased in place
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        torch.cuda.current_stream(dev).wait_stream(self.stream)
        return logits

    def release(self, seq_id: int) -> None:
        """Nothing to do: the runtime owns the pages."""
