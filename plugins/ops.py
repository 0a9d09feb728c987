"""The plugin ops as torch custom ops in namespace `g4rt`, plus a plain Python API.

    torch.ops.g4rt.paged_attention(q, arena, cu_q, kv_lens, page_table, first_page,
                                   k_offset, v_offset, page_size, num_kv_heads, window_left, scale, kernels) -> out
    torch.ops.g4rt.kv_write_(arena, k, v, slots, k_offset, v_offset, page_size, kernels) -> None  (mutates arena)
    torch.ops.g4rt.kv_write(arena, k, v, slots, k_offset, v_offset, page_size, kernels) -> arena'  (functional)
    torch.ops.g4rt.kv_write_attention_(arena, k, v, slots, q, cu_q, kv_lens, page_table, first_page, k_offset,
                                       v_offset, page_size, num_kv_heads, window_left, scale, kernels) -> out
                                       (kv_write_ then paged_attention: a decode step's in one launch)
    torch.ops.g4rt.moe(x, idx, w, gate_up, down, kernels) -> out           (the chosen experts' weighted sum)
    torch.ops.g4rt.sample(logits, rows, nucleus, top_k, kernels) -> token ids   (greedy / temperature / top-k / top-p)

`kernels` picks the implementation: "triton" (plugins/triton_*.py; on CPU only under the Triton
interpreter, TRITON_INTERPRET=1) or "reference" (plugins/reference.py, any device). It is an argument
of the op, not a global, so torch.compile bakes it into the graph like any other constant and an
engine's choice travels with its configuration (`check_kernels` validates it, `default_kernels` picks
Triton on CUDA and the reference elsewhere). The ONNX export ignores it: the graph's nodes are the
plugins, whichever implementation traced them.

Why `torch.library.custom_op` with a dispatcher and not `triton_op`: a triton_op is decomposed
into its body by AOTDispatcher, so its body must be traceable on every device, and the reference
body here is not (per-sequence loops, `.tolist()`). As an opaque custom op each op is one node for
torch.compile, torch.export and the ONNX exporter on every device; Inductor calls it as an extern
kernel. The Triton path computes launch parameters from shapes only (no `.item()`, no host sync), so
it runs inside CUDA graphs.

Importing this module never needs triton; without it only the reference exists.
"""
from __future__ import annotations

import importlib.util

import torch

from . import reference

KERNELS = ("triton", "reference")
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def check_kernels(kernels: str, field: str = "kernels") -> str:
    """`kernels` if it names an implementation this machine has; else a ValueError naming `field`."""
    if kernels not in KERNELS:
        raise ValueError(f"{field}: {kernels!r} is not one of {', '.join(KERNELS)}")
    if kernels == "triton" and not HAVE_TRITON:
        raise ValueError(f"{field}: 'triton' needs the triton package (pip install 'g4rt[triton]'), "
                         f"which is not installed; use 'reference'")
    return kernels


def default_kernels(device) -> str:
    """Triton on CUDA (when installed), the torch reference elsewhere."""
    return "triton" if torch.device(device).type == "cuda" and HAVE_TRITON else "reference"


def _triton(module: str):
    return importlib.import_module(f"{__package__}.{module}")


def _reference_attention(*args, out: torch.Tensor | None = None) -> torch.Tensor:
    o = reference.paged_attention_ref(*args)
    return o if out is None else out.copy_(o)


def implementations(kernels: str):
    """(kv_write_, paged_attention) of `kernels` as plain functions, with the ops' positional arguments
    less `kernels`; paged_attention also takes `out=` (a contiguous [T, Hq, D] tensor to write into).

    The ops below call these; an eager caller outside any tracing may call them directly, as the
    piecewise graphs do between their segments (runtime/engines/piecewise.py): an op call through the
    dispatcher costs host time the kernel does not need, twice per layer per step (the E2B's 128-token
    prefill on an H200: 5.6 ms to its first token with the direct calls, 6.2 ms through the dispatcher,
    measured on two machines; export/results/README.md, "Direct attention calls in the piecewise steps")."""
    if check_kernels(kernels) == "triton":
        return _triton("triton_kv_write").kv_write_, _triton("triton_attention").paged_attention
    return reference.kv_write_ref_, _reference_attention


@torch.library.custom_op("g4rt::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, arena: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor,
                        page_table: torch.Tensor, first_page: torch.Tensor, k_offset: int, v_offset: int,
                        page_size: int, num_kv_heads: int, window_left: int, scale: float,
                        kernels: str) -> torch.Tensor:
    return implementations(kernels)[1](q, arena, cu_q, kv_lens, page_table, first_page, k_offset, v_offset,
                                       page_size, num_kv_heads, window_left, scale)


@_paged_attention_op.register_fake
def _(q, arena, cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads,
      window_left, scale, kernels):
    return torch.empty_like(q)


@torch.library.custom_op("g4rt::kv_write_", mutates_args=("arena",))
def _kv_write_inplace_op(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                         k_offset: int, v_offset: int, page_size: int, kernels: str) -> None:
    implementations(kernels)[0](arena, k, v, slots, k_offset, v_offset, page_size)


@_kv_write_inplace_op.register_fake
def _(arena, k, v, slots, k_offset, v_offset, page_size, kernels):
    return None


@torch.library.custom_op("g4rt::kv_write", mutates_args=())
def _kv_write_op(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_offset: int,
                 v_offset: int, page_size: int, kernels: str) -> torch.Tensor:
    """Functional variant for export (mutating custom ops do not export to ONNX). Costs an arena
    copy when executed; a TensorRT plugin aliases its output to the input instead."""
    new = arena.clone()
    _kv_write_inplace_op(new, k, v, slots, k_offset, v_offset, page_size, kernels)
    return new


@_kv_write_op.register_fake
def _(arena, k, v, slots, k_offset, v_offset, page_size, kernels):
    return torch.empty_like(arena)


@torch.library.custom_op("g4rt::kv_write_attention_", mutates_args=("arena",))
def _kv_write_attention_op(arena: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                           q: torch.Tensor, cu_q: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
                           first_page: torch.Tensor, k_offset: int, v_offset: int, page_size: int,
                           num_kv_heads: int, window_left: int, scale: float, kernels: str) -> torch.Tensor:
    """A cache-owning layer's write and attention in one op, so the Triton kernels can make a decode step's one
    launch (triton_kv_write.kv_write_attention_); the same bits as the two ops."""
    rest = (k_offset, v_offset, page_size, num_kv_heads, window_left, scale)
    if check_kernels(kernels) == "triton":
        return _triton("triton_kv_write").kv_write_attention_(arena, k, v, slots, q, cu_q, kv_lens, page_table,
                                                              first_page, *rest)
    reference.kv_write_ref_(arena, k, v, slots, k_offset, v_offset, page_size)
    return reference.paged_attention_ref(q, arena, cu_q, kv_lens, page_table, first_page, *rest)


@_kv_write_attention_op.register_fake
def _(arena, k, v, slots, q, cu_q, kv_lens, page_table, first_page, k_offset, v_offset, page_size, num_kv_heads,
      window_left, scale, kernels):
    return torch.empty_like(q)


@torch.library.custom_op("g4rt::moe", mutates_args=())
def _moe_op(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            kernels: str) -> torch.Tensor:
    if check_kernels(kernels) == "triton":
        return _triton("triton_moe").moe(x, idx, w, gate_up, down)
    return reference.moe_ref(x, idx, w, gate_up, down)


@_moe_op.register_fake
def _(x, idx, w, gate_up, down, kernels):
    return torch.empty_like(x)


@torch.library.custom_op("g4rt::sample", mutates_args=())
def _sample_op(logits: torch.Tensor, rows: torch.Tensor, nucleus: bool, top_k: bool, kernels: str) -> torch.Tensor:
    if check_kernels(kernels) == "triton":
        return _triton("triton_sampling").sample(logits, rows, nucleus=nucleus, top_k=top_k)
    return reference.sample_ref(logits, rows)


@_sample_op.register_fake
def _(logits, rows, nucleus, top_k, kernels):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


# ---- plain Python API: the ops above, with keyword names ------------------------------------

def paged_attention(q, arena, cu_q, kv_lens, page_table, first_page, k_offset: int, v_offset: int,
                    page_size: int, num_kv_heads: int, window_left: int, scale: float = 1.0,
                    kernels: str | None = None) -> torch.Tensor:
    """See plugins/README.md. `window_left` is the inclusive distance (`plugins.window_left(W)`);
    `kernels` defaults to `default_kernels(q.device)`."""
    return torch.ops.g4rt.paged_attention(q, arena, cu_q, kv_lens, page_table, first_page, int(k_offset),
                                          int(v_offset), int(page_size), int(num_kv_heads), int(window_left),
                                          float(scale), kernels or default_kernels(q.device))


def kv_write_(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int, kernels: str | None = None) -> None:
    """Write K/V rows into their slots of `arena`, in place (eager and torch.compile)."""
    torch.ops.g4rt.kv_write_(arena, k, v, slots, int(k_offset), int(v_offset), int(page_size),
                             kernels or default_kernels(arena.device))


def kv_write(arena, k, v, slots, k_offset: int, v_offset: int, page_size: int,
             kernels: str | None = None) -> torch.Tensor:
    """Functional write: returns the new arena (export)."""
    return torch.ops.g4rt.kv_write(arena, k, v, slots, int(k_offset), int(v_offset), int(page_size),
                                   kernels or default_kernels(arena.device))


def moe(x, idx, w, gate_up, down, kernels: str | None = None) -> torch.Tensor:
    """The chosen experts' gated-GELU MLPs, weighted and summed per token (plugins/README.md `moe`)."""
    return torch.ops.g4rt.moe(x, idx, w, gate_up, down, kernels or default_kernels(x.device))


def sample(logits, rows, *, nucleus: bool = True, top_k: bool = True, kernels: str | None = None) -> torch.Tensor:
    """One token id per logits row, int64 [R] on the logits' device (plugins/README.md `sample`); `rows`
    int64 [5, R] holds each row's temperature, top_p (float64 bits), top_k, seed and draw counter;
    `nucleus` False says no row has top_p < 1, `top_k` False no row top_k > 0 (speed hints: the ids are the
    same either way)."""
    return torch.ops.g4rt.sample(logits, rows, bool(nucleus), bool(top_k), kernels or default_kernels(logits.device))
