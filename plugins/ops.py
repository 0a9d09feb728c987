"""The plugin ops as torch custom ops in namespace `g4rt`, plus a plain Python API.

    torch.ops.g4rt.paged_attention(q, arena, cu_q, kv_lens, page_table, first_page,
                                   k_offset, v_offset, page_size, num_kv_heads, window_left, scale) -> out
    torch.ops.g4rt.kv_write_(arena, k, v, slots, k_offset, v_offset, page_size) -> None   (mutates arena)
    torch.ops.g4rt.kv_write(arena, k, v, slots, k_offset, v_offset, page_size) -> arena'  (functional)
    torch.ops.g4rt.rms_norm(x, weight | None, eps) -> y
    torch.ops.g4rt.gelu_tanh_mul(gate, up) -> y
    torch.ops.g4rt.qkv_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads, k_eq_v) -> q, k, v
    torch.ops.g4rt.add_rms_norm(residual, x, x_weight, out_weight, eps) -> h, normed

The last four are not plugins of the exported graph (the model runs their reference on CPU, where
export traces it, and TensorRT fuses norms itself). On CUDA they keep the eager and the compiled
engine on the same bits: see triton_norm.py.

Why `torch.library.custom_op` with a dispatcher and not `triton_op`: a triton_op is decomposed
into its body by AOTDispatcher, so its body must be traceable on every device, and the CPU body
here is the reference (per-sequence loops, `.tolist()`), which is not. As an opaque custom op each
op is one node for torch.compile, torch.export and the ONNX exporter on every device; Inductor
calls it as an extern kernel. The CUDA path launches Triton with launch parameters computed from
shapes only (no `.item()`, no host sync), so it runs inside CUDA graphs.

Dispatch, decided per call:
* CUDA tensors -> Triton (`G4RT_KERNELS=reference` forces the torch reference, for debugging);
* CPU tensors -> the torch reference, unless `G4RT_KERNELS=triton` (tests, with TRITON_INTERPRET=1).

Importing this module never needs triton; without it only the reference path exists.
"""
from __future__ import annotations

import os

import torch

from . import reference

try:  # triton is an optional extra; the reference covers CPU without it
    from . import triton_attention as _tattn
    from . import triton_kv_write as _tkv
    from . import triton_norm as _tnorm
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    _tattn = _tkv = _tnorm = None
    HAVE_TRITON = False


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensors like `t` runs the Triton kernels (see module docstring)."""
    mode = os.environ.get("G4RT_KERNELS", "").strip().lower()
    if mode in ("reference", "torch"):
        return False
    want = t.device.type == "cuda" or mode == "triton"
    if want and not HAVE_TRITON:
        raise RuntimeError("Triton kernels requested (CUDA tensors or G4RT_KERNELS=triton) but triton is "
                           "not installed")
    return want


@torch.library.custom_op("g4rt::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, arena: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor,
                        page_table: torch.Tensor, first_page: torch.Tensor, k_offset: int, v_offset: int,
                        page_size: int, num_kv_heads: int, window_left: int, scale: float) -> torch.Tensor:
    args = (q, arena, cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads,
            window_left, scale)
    if use_triton(q):
        return _tattn.paged_attention(*args)
    return reference.paged_attention_ref(*args)


@_paged_attention_op.register_fake
def _(q, arena, cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads,
      window_left, scale):
    return torch.empty_like(q)


@torch.library.custom_op("g4rt::kv_write_", mutates_args=("arena",))
def _kv_write_inplace_op(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                         k_offset: int, v_offset: int, page_size: int) -> None:
    if use_triton(arena):
        _tkv.kv_write_(arena, k, v, slots, k_offset, v_offset, page_size)
    else:
        reference.kv_write_ref_(arena, k, v, slots, k_offset, v_offset, page_size)


@_kv_write_inplace_op.register_fake
def _(arena, k, v, slots, k_offset, v_offset, page_size):
    return None


@torch.library.custom_op("g4rt::kv_write", mutates_args=())
def _kv_write_op(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_offset: int,
                 v_offset: int, page_size: int) -> torch.Tensor:
    """Functional variant for export (mutating custom ops do not export to ONNX). Costs an arena
    copy when executed; a TensorRT plugin aliases its output to the input instead."""
    new = arena.clone()
    _kv_write_inplace_op(new, k, v, slots, k_offset, v_offset, page_size)
    return new


@_kv_write_op.register_fake
def _(arena, k, v, slots, k_offset, v_offset, page_size):
    return torch.empty_like(arena)


@torch.library.custom_op("g4rt::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _tnorm.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("g4rt::gelu_tanh_mul", mutates_args=())
def _gelu_tanh_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate):
        return _tnorm.gelu_tanh_mul(gate, up)
    return reference.gelu_tanh_mul(gate, up)


@_gelu_tanh_mul_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("g4rt::qkv_norm_rope", mutates_args=())
def _qkv_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      k_eq_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fn = _tnorm.qkv_norm_rope if use_triton(qkv) else reference.qkv_norm_rope
    return tuple(t.contiguous() for t in fn(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads, k_eq_v))


@_qkv_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads, k_eq_v):
    T, D = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty(T, num_q_heads, D), qkv.new_empty(T, num_kv_heads, D), qkv.new_empty(T, num_kv_heads, D)


@torch.library.custom_op("g4rt::add_rms_norm", mutates_args=())
def _add_rms_norm_op(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    fn = _tnorm.add_rms_norm if use_triton(x) else reference.add_rms_norm
    return fn(residual, x, x_weight, out_weight, eps)


@_add_rms_norm_op.register_fake
def _(residual, x, x_weight, out_weight, eps):
    return torch.empty_like(residual), torch.empty_like(residual)


# ---- plain Python API: the ops above, with keyword names ------------------------------------

def paged_attention(q, arena, cu_q, kv_lens, page_table, first_page, k_offset: int, v_offset: int,
                    page_size: int, num_kv_heads: int, window_left: int, scale: float = 1.0) -> torch.Tensor:
    """See plugins/README.md. `window_left` is the inclusive distance (`plugins.window_left(W)`)."""
    return torch.ops.g4rt.paged_attention(q, arena, cu_q, kv_lens, page_table, first_page, int(k_offset),
                                          int(v_offset), int(page_size), int(num_kv_heads), int(window_left),
                                          float(scale))


def kv_write_(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int) -> None:
    """Write K/V rows into their slots of `arena`, in place (eager and torch.compile)."""
    torch.ops.g4rt.kv_write_(arena, k, v, slots, int(k_offset), int(v_offset), int(page_size))


def kv_write(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int) -> torch.Tensor:
    """Functional write: returns the new arena (export)."""
    return torch.ops.g4rt.kv_write(arena, k, v, slots, int(k_offset), int(v_offset), int(page_size))
