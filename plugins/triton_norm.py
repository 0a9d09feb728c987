"""Triton kernels for the decoder's two elementwise blocks: RMSNorm and the gated GELU.

Why kernels for such simple math: the eager and the compiled engine must compute the same bits.
Inductor fuses `x.pow(2).mean()` into a reduction of its own, summed in another order than
ATen's, and one flipped bf16 bit in a norm output is enough to change a greedy token many layers
later. As opaque custom ops (ops.py) these kernels run in both engines, so the compiled graph only
fuses what it can round exactly as eager does (adds, scales, RoPE under `emulate_precision_casts`).
They are also one launch each where eager ATen needs five or six.

Numerics match `plugins.reference` up to rounding of the last fp32 bit before the cast back (the
sum order differs); tests/test_plugins_norm.py bounds the difference at one bf16 ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, stride_token, H, D: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row = token * H + head; the input's heads are D apart
    c = tl.arange(0, BLOCK)
    ok = c < D
    x = tl.load(x_ptr + (row // H) * stride_token + (row % H) * D + c, mask=ok, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, fp32 math, output (contiguous) in x's dtype (see reference.rms_norm).

    Reads [T, H, D] / [T, D] inputs whose tokens are strided, such as the q, k and v column blocks of
    a packed projection's output, without a copy; other layouts are made contiguous first."""
    D = x.shape[-1]
    x3 = x.view(-1, 1, D) if x.dim() == 2 and x.stride(-1) == 1 else x
    if x3.dim() != 3 or x3.stride(-1) != 1 or (x3.shape[1] > 1 and x3.stride(1) != D):
        x3 = x.contiguous().view(-1, 1, D)
    T, H = x3.shape[0], x3.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T * H:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(T * H,)](x3, x3 if weight is None else weight, out, float(eps), x3.stride(0), H, D=D,
                                   BLOCK=block, HAS_W=weight is not None, num_warps=max(1, min(16, block // 512)))
    return out


@triton.jit
def _gelu_tanh_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(gate_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i, mask=ok, other=0.0).to(tl.float32)
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) (x + 0.044715 x^3)
    # 0.5 x (1 + tanh z) = x / (1 + exp(-2z)): no cancellation in the negative tail, exact limits.
    dtype = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-2.0 * z))).to(dtype).to(tl.float32)  # eager rounds gelu before the product
    tl.store(out_ptr + i, (act * u).to(dtype), mask=ok)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, each result rounded to the input dtype as eager torch does."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _gelu_tanh_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, num_warps=4)
    return out
