"""Triton kernels for the decoder's elementwise blocks: RMSNorm, the gated GELU, and fused blocks
(q/k/v norms with RoPE; post-norm, residual add, the layer scalar and the next pre-norm; the MoE block's
input norms and its branches' post-norms; the logits' softcap).

Why kernels for such simple math: the eager and the compiled engine must compute the same bits.
Inductor fuses `x.pow(2).mean()` into a reduction of its own, summed in another order than
ATen's, and one flipped bf16 bit in a norm output is enough to change a greedy token many layers
later. As opaque custom ops (`g4rt::rms_norm` etc., registered at the end of this module) these
kernels run in both engines, so the compiled graph only
fuses what it can round exactly as eager does (adds, scales, RoPE under `emulate_precision_casts`).
They are also one launch each where eager ATen needs five or six.

Numerics match the references in models/blocks.py up to rounding of the last fp32 bit before the cast back (the
sum order differs); tests/test_plugins_norm.py bounds the difference at one bf16 ulp.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import await_inputs, interpreting, launch_next, pdl_launch


# Rows (tokens) a program of the row kernels and of the q/k/v kernel takes under the Triton interpreter (CPU
# tests): it runs a launch's programs one after another, each costing about the same whatever its size, so fewer,
# larger ones. A GPU launch takes one row a program and `norm_rope_tile`'s tile. A row's values do not depend on how
# many rows share its program (tests/test_plugins_norm.py checks both ways and runs each GPU tile).
INTERPRETER_ROWS = 16


@triton.jit
def _rms(x, D: tl.constexpr, eps):
    """Root mean square over the last axis (a row, or each row of a tile; fp32, masked-out lanes loaded
    as 0), plus eps under the root."""
    return tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=len(x.shape) > 1) / D + eps)


@triton.jit
def _row_tile(rows, D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """A row kernel's program: its ROWS rows of `rows` (each D elements, contiguous) as (offsets, mask, c, the
    mask of c < D), [BLOCK] vectors for one row, [ROWS, BLOCK] tiles for several; c indexes a row's elements."""
    c = tl.arange(0, BLOCK)
    if ROWS == 1:
        at, ok = tl.program_id(0).to(tl.int64) * D + c, c < D
    else:
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        at, ok = r[:, None] * D + c[None, :], (r < rows)[:, None] & (c < D)[None, :]
    return at, ok, c, c < D


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, rows, D: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr,
                     ROWS: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    at, ok, c, c_ok = _row_tile(rows, D, BLOCK, ROWS)
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    y = x / _rms(x, D, eps)
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=ok)


def _per_row(kernel, like: torch.Tensor, *args, **meta) -> None:
    """Launch a row kernel: one program per row of `like` (rows of its last dim D; INTERPRETER_ROWS of them under
    the interpreter), BLOCK = D rounded up to a power of two, warps by BLOCK, with PDL where the device has it
    (`pdl`). The kernel's `rows` argument (the row count) follows `args`. Nothing runs for an empty tensor."""
    D = like.shape[-1]
    rows = like.numel() // D if D else 0
    if rows:
        block, per = triton.next_power_of_2(D), INTERPRETER_ROWS if interpreting() else 1
        kernel[(triton.cdiv(rows, per),)](*args, rows, D=D, BLOCK=block, ROWS=per, num_warps=max(1, min(16, block // 512)),
                                          **pdl_launch(like.device), **meta)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, fp32 math, output (contiguous) in x's dtype (see models.blocks.rms_norm)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _per_row(_rms_norm_kernel, x, x, x if weight is None else weight, out, float(eps), HAS_W=weight is not None)
    return out


@triton.jit
def gelu_tanh_rounded(g, u, out_ptr):
    """gelu_tanh(g) * u in out_ptr's element type from fp32 g and u (values of that type), rounded where
    eager rounds: the gelu, then the product. Shared by this gated GELU and the experts (triton_moe.py)."""
    dtype = out_ptr.dtype.element_ty
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) (x + 0.044715 x^3)
    # 0.5 x (1 + tanh z) = x / (1 + exp(-2z)): no cancellation in the negative tail, exact limits.
    act = (g / (1.0 + tl.exp(-2.0 * z))).to(dtype).to(tl.float32)  # eager rounds gelu before the product
    return (act * u).to(dtype)


@triton.jit
def _gelu_tanh_mul_kernel(gate_ptr, up_ptr, out_ptr, n, gate_row, up_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n
    g = tl.load(gate_ptr + row * gate_row + j, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row + j, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + j, gelu_tanh_rounded(g, u, out_ptr), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last dim] with unit column stride: a view where `t` is one already (the halves
    of a packed gate/up projection, rows 2I apart), else a copy."""
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, each result rounded to the input dtype as eager torch does. The inputs may
    be row-strided views (the two halves of one gate/up matmul's output); the result is contiguous."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        g, u = _rows(gate), _rows(up)
        rows, n = g.shape
        _gelu_tanh_mul_kernel[(rows, triton.cdiv(n, 1024))](g, u, out, n, g.stride(0), u.stride(0), BLOCK=1024,
                                                            num_warps=4, **pdl_launch(gate.device))
    return out


# ---- fused blocks: one launch where the layer would make several ------------------------------------
# Each rounds every intermediate to the output dtype where eager torch does (the norm's output, each
# RoPE product, the sum), so on CUDA the fused blocks agree with the unfused kernels above plus eager
# RoPE and adds up to the order of one fp32 sum per row.

@triton.jit
def norm_rope(x_ptr, row, tok, ok, w_ptr, cos_ptr, sin_ptr, eps, D: tl.constexpr, dtype: tl.constexpr):
    """q or k of R heads: RMSNorm with weight, then RoPE (rotate_half: dim i pairs with i + D/2), as the halves
    [R, D/2] of a row in `dtype` (`joined` makes them a [R, D] tile). Row r is the D elements at x_ptr + row[r], of
    token tok[r] (its cos/sin row, [T, D] tables); rows not `ok` read nothing. The q/k/v kernel's math and a decode
    attention's, which forms its q itself. A row is read as its two halves, the pairs RoPE mixes, so no element is
    loaded twice (registers: a decode attention's tile holds both)."""
    H: tl.constexpr = D // 2
    c = tl.arange(0, H)
    m = ok[:, None]
    at = x_ptr + row[:, None] + c[None, :]
    lo, hi = tl.load(at, mask=m, other=0.0).to(tl.float32), tl.load(at + H, mask=m, other=0.0).to(tl.float32)
    den = tl.sqrt((tl.sum(lo * lo, axis=1, keep_dims=True) + tl.sum(hi * hi, axis=1, keep_dims=True)) / D + eps)
    lo = (lo / den * tl.load(w_ptr + c).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    hi = (hi / den * tl.load(w_ptr + H + c).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    rope = tok[:, None].to(tl.int64) * D + c[None, :]
    cos_lo, cos_hi = tl.load(cos_ptr + rope, mask=m, other=0.0), tl.load(cos_ptr + rope + H, mask=m, other=0.0)
    sin_lo, sin_hi = tl.load(sin_ptr + rope, mask=m, other=0.0), tl.load(sin_ptr + rope + H, mask=m, other=0.0)
    out_lo = ((lo * cos_lo.to(tl.float32)).to(dtype).to(tl.float32)
              + (-hi * sin_lo.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    out_hi = ((hi * cos_hi.to(tl.float32)).to(dtype).to(tl.float32)
              + (lo * sin_hi.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    return out_lo, out_hi


@triton.jit
def joined(lo, hi):
    """[R, D] rows of their halves [R, D/2]."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [lo.shape[0], 2 * lo.shape[1]])


@triton.jit
def v_norm(x_ptr, row, ok, eps, D: tl.constexpr, dtype: tl.constexpr):
    """v of R heads: RMSNorm without weight, as a [R, D] tile in `dtype` (rows as norm_rope's)."""
    c = tl.arange(0, D)
    x = tl.load(x_ptr + row[:, None] + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    return (x / _rms(x, D, eps)).to(dtype)


@triton.jit
def _qkv_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, eps, stride_token, T,
                          HQ: tl.constexpr, HKV: tl.constexpr, K_EQ_V: tl.constexpr, D: tl.constexpr,
                          BT: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    ok = t < T
    j = tl.program_id(1)  # q heads, then k heads, then v heads
    c, c2 = tl.arange(0, D), tl.arange(0, D // 2)
    m = ok[:, None]
    if j < HQ + HKV:  # a q or k head: its norm weight and its output row
        if j < HQ:
            w_ptr, at = qw_ptr, q_ptr + t[:, None] * (HQ * D) + j * D + c2[None, :]
        else:
            w_ptr, at = kw_ptr, k_ptr + t[:, None] * (HKV * D) + (j - HQ) * D + c2[None, :]
        lo, hi = norm_rope(qkv_ptr, t * stride_token + j * D, t, ok, w_ptr, cos_ptr, sin_ptr, eps, D,
                           q_ptr.dtype.element_ty)
        tl.store(at, lo, mask=m)
        tl.store(at + D // 2, hi, mask=m)
    else:
        h = j - HQ - HKV
        y = v_norm(qkv_ptr, t * stride_token + ((HQ + h) * D if K_EQ_V else j * D), ok, eps, D,  # k_eq_v: V is raw K
                   v_ptr.dtype.element_ty)
        tl.store(v_ptr + t[:, None] * (HKV * D) + h * D + c[None, :], y, mask=m)


# One-token programs (tokens x heads) from which the q/k/v norm kernel at head dim 256 takes 4 tokens a program
# over 4 warps (norm_rope_tile).
NORM_ROPE_MIN_PROGRAMS = 2560


def norm_rope_tile(tokens: int, head_dim: int, heads: int) -> tuple[int, int]:
    """(tokens per program, warps) of the q/k/v norm kernel for `heads` heads (q + k + v) of `tokens` tokens,
    from the H200 sweeps (bench.kernels --norms; 31B and E2B heads; export/results/README.md, "the q/k/v norm
    tiles" and "the q/k/v norm tile at serving batches"). Head dim
    256: one token per 1-warp program is latency-bound (40 % of the copy bandwidth at 8k); from
    NORM_ROPE_MIN_PROGRAMS such programs, 4 tokens over 4 warps (the 31B's 64 heads at 64 / 128 / 256 tokens:
    4.06 / 5.27 / 8.19 us against 5.98 / 11.10 / 21.02; the E2B's 10 at 256: 3.24 against 3.46, but at 128,
    1,280 programs, 3.46 against 3.05), and 16 from 2,048 tokens (164 us at 8k, 78 %). Head dim 512: one token
    and one warp at every size (227 us at 8k, 67 %; more tokens per program measured slower)."""
    if head_dim > 256 or tokens * heads < NORM_ROPE_MIN_PROGRAMS:
        return 1, 1
    return (4 if tokens < 2048 else 16), 4


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, k_eq_v: bool,
                  tile: tuple[int, int] | None = None):
    """See models.blocks.qkv_norm_rope: one launch, grid (token tiles, q + k + v heads), for the q/k/v
    norms and RoPE. `tile`: (tokens per program, warps), default `norm_rope_tile` (the bench's sweep), or
    INTERPRETER_ROWS tokens under the interpreter."""
    T, D = qkv.shape[0], cos.shape[-1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = qkv.new_empty(T, num_q_heads, D)
    k, v = qkv.new_empty(T, num_kv_heads, D), qkv.new_empty(T, num_kv_heads, D)
    if T:
        heads = num_q_heads + 2 * num_kv_heads
        bt, warps = tile or ((INTERPRETER_ROWS, 4) if interpreting() else norm_rope_tile(T, D, heads))
        _qkv_norm_rope_kernel[(triton.cdiv(T, bt), heads)](
            qkv, q_weight, k_weight, cos, sin, q, k, v, float(eps), qkv.stride(0), T, HQ=num_q_heads,
            HKV=num_kv_heads, K_EQ_V=bool(k_eq_v), D=D, BT=bt, num_warps=warps, **pdl_launch(qkv.device))
    return q, k, v


def q_norm_rope(q: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """See models.blocks.q_norm_rope: the q/k/v kernel's launch with no k or v heads."""
    D = cos.shape[-1]
    return qkv_norm_rope(q, weight, weight, eps, cos, sin, q.shape[-1] // D, 0, False)[0]


@triton.jit
def _add_rms_norm_kernel(res_ptr, x_ptr, xw_ptr, scale_ptr, ow_ptr, h_ptr, out_ptr, eps, rows, D: tl.constexpr,
                         BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, ROWS: tl.constexpr,
                         PDL: tl.constexpr):
    # Every read in one round trip: the weights (nothing writes them) before the wait, x and the residual after
    # it, both before the first sum (a load written after a block-wide sum is issued after it).
    at, ok, c, c_ok = _row_tile(rows, D, BLOCK, ROWS)
    dtype = h_ptr.dtype.element_ty
    xw = tl.load(xw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_OUT:
        ow = tl.load(ow_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    await_inputs(PDL, LAUNCH_NEXT=False)
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)
    y = x / _rms(x, D, eps) * xw
    h = (res + y.to(dtype).to(tl.float32)).to(dtype)
    if HAS_SCALE:  # the layer_scalar: eager rounds the sum, then the product
        h = (h.to(tl.float32) * scale).to(dtype)
    launch_next(PDL)  # after the reads: the next kernel's first act is to read its weights (launch_next)
    tl.store(h_ptr + at, h, mask=ok)
    if HAS_OUT:
        hf = h.to(tl.float32)
        tl.store(out_ptr + at, (hf / _rms(hf, D, eps) * ow).to(dtype), mask=ok)


def _add_norm_launch(residual, x, x_weight, scale, out_weight, eps):
    """One launch per token row: norm(x) * x_weight added to residual [times scale] -> h, and with
    out_weight the next norm of h. Returns (h, out or None)."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"scale must hold one value (the layer_scalar), got shape {tuple(scale.shape)}")
    residual, x = residual.contiguous(), x.contiguous()
    h = torch.empty_like(residual)
    out = None if out_weight is None else torch.empty_like(residual)
    _per_row(_add_rms_norm_kernel, x, residual, x, x_weight, x_weight if scale is None else scale,
             x_weight if out_weight is None else out_weight, h, h if out is None else out, float(eps),
             HAS_SCALE=scale is not None, HAS_OUT=out is not None)
    return h, out


def add_normed(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, eps: float,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """See models.blocks.add_normed: one launch per token row for the norm, the residual add and the scale."""
    return _add_norm_launch(residual, x, x_weight, scale, None, eps)[0]


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                 eps: float, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See models.blocks.add_rms_norm: one launch per token row for norm, residual add, scale and the next norm."""
    return _add_norm_launch(residual, x, x_weight, scale, out_weight, eps)


@triton.jit
def _router_inputs_kernel(h_ptr, scale_ptr, ew_ptr, r_ptr, e_ptr, root, eps, rows, D: tl.constexpr,
                          BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    at, ok, c, c_ok = _row_tile(rows, D, BLOCK, ROWS)
    dtype = r_ptr.dtype.element_ty
    x = tl.load(h_ptr + at, mask=ok, other=0.0).to(tl.float32)
    den = _rms(x, D, eps)
    n = (x / den).to(dtype).to(tl.float32)  # the router's unweighted norm, rounded as eager rounds it
    r = ((n * tl.load(scale_ptr + c, mask=c_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32) * root).to(dtype)
    tl.store(r_ptr + at, r, mask=ok)
    tl.store(e_ptr + at, (x / den * tl.load(ew_ptr + c, mask=c_ok, other=0.0).to(tl.float32)).to(dtype), mask=ok)


def router_inputs(h: torch.Tensor, scale: torch.Tensor, root: float, experts_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See models.blocks.router_inputs: one launch per token row for both norms of the MoE block's input."""
    h = h.contiguous()
    r, e = torch.empty_like(h), torch.empty_like(h)
    _per_row(_router_inputs_kernel, h, h, scale, experts_weight, r, e, float(root), float(eps))
    return r, e


@triton.jit
def _normed_sum_kernel(a_ptr, aw_ptr, b_ptr, bw_ptr, out_ptr, eps, rows, D: tl.constexpr, BLOCK: tl.constexpr,
                       ROWS: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    at, ok, c, c_ok = _row_tile(rows, D, BLOCK, ROWS)
    dtype = out_ptr.dtype.element_ty
    a = tl.load(a_ptr + at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + at, mask=ok, other=0.0).to(tl.float32)
    ya = (a / _rms(a, D, eps) * tl.load(aw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    yb = (b / _rms(b, D, eps) * tl.load(bw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + at, (ya + yb).to(dtype), mask=ok)


def normed_sum(a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor,
               eps: float) -> torch.Tensor:
    """See models.blocks.normed_sum: one launch per token row for the two post-norms and their sum."""
    if a.shape != b.shape:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} differ in shape")
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(a)
    _per_row(_normed_sum_kernel, a, a, a_weight, b, b_weight, out, float(eps))
    return out


@triton.jit
def _tanh(y, LIBDEVICE: tl.constexpr):
    """tanh of fp32 `y`: CUDA's tanhf (libdevice's, which torch's CUDA kernel calls) on a GPU; under the
    interpreter, which has no libdevice, a series near 0 and (1 - e) / (1 + e) of e = exp(-2|y|) elsewhere, a few
    fp32 ulps from it."""
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.tanh(y)
    else:
        a = tl.abs(y)
        y2 = y * y
        e = tl.exp(-2.0 * a)
        far = (1.0 - e) / (1.0 + e)
        near = y * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0 - y2 * (17.0 / 315.0))))
        return tl.where(a < 0.125, near, tl.where(y < 0, -far, far))


@triton.jit
def _softcap_kernel(x_ptr, out_ptr, n, inv_cap, cap, HAS_CAP: tl.constexpr, LIBDEVICE: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    y = x.to(tl.float32)
    if HAS_CAP:  # rounded to x's dtype where eager rounds: the quotient, the tanh, the product
        dtype = x.dtype
        y = (y * inv_cap).to(dtype).to(tl.float32)  # CUDA torch divides by a scalar as a product with 1 / cap
        y = _tanh(y, LIBDEVICE).to(dtype).to(tl.float32)
        y = (y * cap).to(dtype).to(tl.float32)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)


SOFTCAP_BLOCK = 2048


@functools.cache
def _reciprocal(cap: float) -> float:
    """1 / cap in fp32, as CUDA torch takes it to divide by a scalar (once per cap, not a tensor a launch)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / cap)


def softcap_logits_(x: torch.Tensor, cap: float | None, out: torch.Tensor) -> None:
    """`out` (fp32) = tanh(x / cap) * cap of the lm_head's output `x`, each step rounded to x's dtype as eager
    torch rounds it (models.blocks.softcap_logits), in one launch: eager torch takes three elementwise launches
    and a conversion, and the decode graphs a copy into the logits buffer they share, which `out` can be (the
    31B's batch 64 on an H100: 0.167 ms a step for those five launches, 0.032 for this one)."""
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"softcap_logits_: out must be contiguous and of x's shape {tuple(x.shape)}, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    x = x.contiguous()
    if x.numel():
        _softcap_kernel[(triton.cdiv(x.numel(), SOFTCAP_BLOCK),)](
            x, out, x.numel(), _reciprocal(cap or 1.0), float(cap or 1.0), HAS_CAP=cap is not None,
            LIBDEVICE=not interpreting(), BLOCK=SOFTCAP_BLOCK, num_warps=8, **pdl_launch(x.device))


# ---- the kernels as opaque custom ops: one node each for torch.compile, run by eager and compiled alike ----

@torch.library.custom_op("g4rt::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("g4rt::gelu_tanh_mul", mutates_args=())
def _gelu_tanh_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_mul(gate, up)


@_gelu_tanh_mul_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("g4rt::qkv_norm_rope", mutates_args=())
def _qkv_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      k_eq_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in qkv_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads,
                                                       num_kv_heads, k_eq_v))


@_qkv_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads, k_eq_v):
    T, D = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty(T, num_q_heads, D), qkv.new_empty(T, num_kv_heads, D), qkv.new_empty(T, num_kv_heads, D)


@torch.library.custom_op("g4rt::q_norm_rope", mutates_args=())
def _q_norm_rope_op(q: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    return q_norm_rope(q, weight, eps, cos, sin)


@_q_norm_rope_op.register_fake
def _(q, weight, eps, cos, sin):
    D = cos.shape[-1]
    return q.new_empty(q.shape[0], q.shape[-1] // D, D)


@torch.library.custom_op("g4rt::add_rms_norm", mutates_args=())
def _add_rms_norm_op(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                     eps: float, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(residual, x, x_weight, out_weight, eps, scale)


@_add_rms_norm_op.register_fake
def _(residual, x, x_weight, out_weight, eps, scale=None):
    return torch.empty_like(residual), torch.empty_like(residual)


@torch.library.custom_op("g4rt::router_inputs", mutates_args=())
def _router_inputs_op(h: torch.Tensor, scale: torch.Tensor, root: float, experts_weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return router_inputs(h, scale, root, experts_weight, eps)


@_router_inputs_op.register_fake
def _(h, scale, root, experts_weight, eps):
    return torch.empty_like(h), torch.empty_like(h)


@torch.library.custom_op("g4rt::normed_sum", mutates_args=())
def _normed_sum_op(a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    return normed_sum(a, a_weight, b, b_weight, eps)


@_normed_sum_op.register_fake
def _(a, a_weight, b, b_weight, eps):
    return torch.empty_like(a)


@torch.library.custom_op("g4rt::softcap_logits", mutates_args=())
def _softcap_logits_op(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    softcap_logits_(x, cap, out)
    return out


@_softcap_logits_op.register_fake
def _(x, cap):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("g4rt::softcap_logits_", mutates_args=("out",))
def _softcap_logits_into_op(x: torch.Tensor, cap: float | None, out: torch.Tensor) -> None:
    softcap_logits_(x, cap, out)
