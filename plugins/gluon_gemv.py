"""A batch-1 skinny matmul for small weights, each program's weight slice copied into shared memory before it waits
(Gluon, Hopper).

Why: at batch 1 the small models' step is 400-480 launches, and each small one costs about 3 us beyond its bytes
(export/results/README.md, "Two launch-boundary experiments on the small models" and the sections after it): the
Triton kernel (triton_gemv.py) reads its first weight tile before it waits for the kernel before it (programmatic
dependent launch) and streams the rest after, so every launch pays the stream's ramp after the wait. Here every
program asks the copy engine for its whole slice of the weight, [16 or 8, K], into shared memory before it waits:
the copies run while the kernel before it does (the launch starts when that one has passed its own wait), and what
is left after the wait is x's read from L2 in one round trip, the sums and the store. On the H200 a chain of 32
square stages took 1.81 / 3.31 / 5.19 us a stage at N 1,024 / 2,048 / 2,560 this way, against 3.53 / 5.24 / 6.35 as
the Triton kernel's launches, and a persistent kernel holding two slices in flight took 3.09 / 4.63
(bench/handoff.py's `copies`, `launches` and `prefetch` arms; export/results/README.md, "Weight slices copied into
shared memory before a launch waits").

Scope (`copies_take`): one row of x (batch-1 decode), bf16, a Hopper GPU, K a multiple of BLOCK_K, N of `slice_rows`,
a program's slice within SLICE_BYTES, the weight within COPIES_MAX_BYTES (larger weights stream at the copy
bandwidth in the Triton kernel) and a program for half the SMs or more. The same launch can form its input from a
residual step first (`copied_add_norm_linear`, the op `g4rt::add_norm_linear`: a layer's tail and the next layer's
q/k/v), so that its copies start while the layer's last kernel runs; and the PLE gate is its launch with the
residual step after the MLP as prologue and the gated GELU as epilogue (`copied_add_norm_gelu_linear`,
`gate_copies_take`). A launch lets the next one in before its own wait, so a chain of them copies two launches
ahead: E4B batch 1 on the H200 3.71 -> 3.57 ms a step with both (export/results/README.md, "the next launch let in
before the wait"). The sums are fp32 on the CUDA cores in an order of their own, so the bits differ from the Triton
kernel's (not from run to run); the eager and compiled engines call one op, so they compute the same bits. Gluon has
no interpreter: CPU runs take the Triton kernel, and CI compiles this one for sm_90
(tests/test_plugins_gluon_gemv.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_attention import _sync, _tma_load
from .launch import hopper, interpreting, sm_count
from .triton_norm import gelu_tanh_rounded

# Weight rows (output columns) a program, the most whose slice fits SLICE_BYTES (`slice_rows`): 16 for K up to
# 3,072 (the most programs for a small weight), 8 up to 6,144 (the E2B's down_proj, the E4B's full o_proj).
BLOCK_NS = (16, 8)
BLOCK_K = 256  # columns a copy box (the copy engine's widest box); x is read as [K / BLOCK_K, BLOCK_K]
NUM_WARPS = 4
GATE_WARPS = 8  # the PLE gate's 16 programs: twice the threads for the sums and norms left after the wait
SLICE_BYTES = 96 << 10  # a program's weight slice: two programs an SM (this launch's and the next's) in 227 KB
COPIES_MAX_BYTES = 32 << 20  # the E4B's full q/k/v (30 MiB), the E2B's down_proj (18 MiB); the E4B's 50 MiB streams
# A weight box [rows, BLOCK_K] in shared memory, for each slice height.
W_LAYOUTS = {bn: gl.NVMMASharedLayout.get_default_for([bn, BLOCK_K], gl.bfloat16) for bn in BLOCK_NS}


@gluon.jit
def x_tile(NT: gl.constexpr, XP: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """Offsets and row mask of a vector of NT * BK elements read as [XP, BK] (XP the next power of two of NT)."""
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    xr = gl.arange(0, XP, layout=gl.SliceLayout(1, layout))
    return xr[:, None] * BK + c[None, :], (xr < NT)[:, None]


@gluon.jit
def slice_dot(bar, phase, w_smem, first, x_smem, NT: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """The weight slice in w_smem[first : first + NT] (once `bar` completes `phase`) times x in x_smem [XP, BK]: BN
    fp32 sums on the CUDA cores, tile by tile."""
    _sync()  # x whole in shared memory before any thread reads another's columns
    mbarrier.wait(bar, phase)
    acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, layout))
    for t in gl.static_range(NT):
        x = x_smem.slice(t, 1).load(layout).to(gl.float32)  # [1, BK]
        acc += gl.sum(w_smem.index(first + t).load(layout).to(gl.float32) * x, axis=1)
    return acc


@gluon.jit
def _rms(v, K, eps):
    """Root mean square of the K elements of v [XP, BK] (masked ones 0), plus eps under the root."""
    return gl.sqrt(gl.sum(gl.sum(v * v, axis=1), axis=0) / K + eps)


@gluon.jit
def _copied_gemv_kernel(w_desc, x_ptr, out_ptr, res_ptr, xw_ptr, ow_ptr, scale_ptr, h_ptr, up_ptr, eps, K,
                        NT: gl.constexpr, XP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NORM: gl.constexpr,
                        HAS_SCALE: gl.constexpr, GELU: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Program p: out[p BN : (p + 1) BN] = w[p BN : (p + 1) BN] z, its NT boxes [BN, BK] of w asked of the copy
    engine before the program waits for the kernel before it (nothing writes weights); z read after. z is x, or the
    residual step add_normed forms (plugins/triton_norm.py, its roundings), h = residual + rms_norm(x) * xw [times
    scale]: with NORM == 1 z = h, with NORM == 2 z = rms_norm(h) * ow; every program forms z whole, program 0 stores
    h. With GELU the output is gelu_tanh(the rounded sums) * up, rounded as the Triton kernel's epilogue rounds it."""
    pid = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, BN, BK], w_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()  # the barrier initialised before the copy engine signals it
    mbarrier.expect(bar, NT * BN * BK * 2)
    for t in gl.static_range(NT):
        _tma_load(w_desc, [pid * BN, t * BK], bar, w_smem.index(t))
    # The next launch may start now, before this one waits: its own wait still holds its reads of what this one
    # writes until this one has ended, and this one cannot end before the one before it has. So its weight copies
    # can start two launches early, while the kernel this one waits for runs.
    tl.extra.cuda.gdc_launch_dependents()
    at, ok = x_tile(NT, XP, BK, layout)
    if NORM > 0:  # the norms' weights and the layer scalar: nothing writes them
        xw = gl.load(xw_ptr + at, mask=ok, other=0.0).to(gl.float32)
        if NORM == 2:
            ow = gl.load(ow_ptr + at, mask=ok, other=0.0).to(gl.float32)
        if HAS_SCALE:
            scale = gl.load(scale_ptr).to(gl.float32)
    tl.extra.cuda.gdc_wait()  # the kernel before wrote x (and the residual)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [XP, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if NORM > 0:
        x = gl.load(x_ptr + at, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)
        res = gl.load(res_ptr + at, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)
        h = (res + (x / _rms(x, K, eps) * xw).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)
        if HAS_SCALE:  # eager rounds the sum, then the product
            h = (h.to(gl.float32) * scale).to(gl.bfloat16)
        gl.store(h_ptr + at, h, mask=ok & (pid == 0))
        if NORM == 2:
            hf = h.to(gl.float32)
            h = (hf / _rms(hf, K, eps) * ow).to(gl.bfloat16)
        x_smem.store(h)
    else:
        x_smem.store(gl.load(x_ptr + at, mask=ok, other=0.0, cache_modifier=".cg"))
    cols = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    y = slice_dot(bar, 0, w_smem, 0, x_smem, NT, BN, layout).to(gl.bfloat16)
    if GELU:
        y = gelu_tanh_rounded(y.to(gl.float32), gl.load(up_ptr + cols).to(gl.float32), out_ptr)
    gl.store(out_ptr + cols, y)
    mbarrier.invalidate(bar)


def slice_rows(k: int) -> int | None:
    """Rows of a program's slice of a weight with `k` columns: the most of BLOCK_NS whose bf16 slice fits
    SLICE_BYTES, or None."""
    return next((bn for bn in BLOCK_NS if bn * k * 2 <= SLICE_BYTES), None)


def kernel_fits(rows: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the kernel can run `rows` rows against a weight [n, k] of `dtype`: one bf16 row, whole copy boxes, and
    a program's slice (`slice_rows`) within SLICE_BYTES."""
    bn = slice_rows(k)
    return (rows == 1 and dtype == torch.bfloat16 and bn is not None and n % bn == 0 and k % BLOCK_K == 0
            and k > 0)


def copies_fit(rows: int, n: int, k: int, dtype: torch.dtype, sms: int) -> bool:
    """Whether `g4rt::skinny_linear` gives the kernel such a launch on a Hopper GPU of `sms` SMs (`copies_take`): it
    `kernel_fits`, the weight is within COPIES_MAX_BYTES, and there is a program for at least half the SMs (a narrower
    weight, the MoE router's 128 outputs, would be read by a few SMs)."""
    return kernel_fits(rows, n, k, dtype) and n * k * 2 <= COPIES_MAX_BYTES and 2 * (n // slice_rows(k)) >= sms


def _on_hopper(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x [M, K] and w on a Hopper GPU (never under the interpreter), of one dtype, w contiguous from a 16-byte
    address (the copy engine's grid)."""
    return (x.device.type == "cuda" and hopper(x.device) and not interpreting() and x.dtype == w.dtype
            and x.dim() == 2 and w.dim() == 2 and w.is_contiguous() and w.data_ptr() % 16 == 0)


def copies_take(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `g4rt::skinny_linear` runs x [M, K] against w [N, K] through this kernel: `copies_fit` on a Hopper
    GPU."""
    return _on_hopper(x, w) and copies_fit(x.shape[0], *w.shape, w.dtype, sm_count(x.device))


def gate_copies_take(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `g4rt::add_norm_gelu_linear` runs the PLE gate, x [M, K] against w [N, K], through this kernel:
    `copies_fit` but for the half-the-SMs bound. The gate's 256 outputs are 16 programs, whose copies (1.3 MB on
    the E4B) finish during the long down_proj before it; after the wait they read only the residual step's rows."""
    return _on_hopper(x, w) and copies_fit(x.shape[0], *w.shape, w.dtype, sms=0)  # sms=0: no program bound


def weight_descriptor(w: torch.Tensor, bn: int) -> TensorDescriptor:
    """The copy engine's view of w [N, K] (bf16, contiguous), read in [bn, BLOCK_K] boxes."""
    return TensorDescriptor(w, list(w.shape), [w.shape[1], 1], [bn, BLOCK_K], W_LAYOUTS[bn])


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if not (_on_hopper(x, w) and kernel_fits(x.shape[0], *w.shape, w.dtype)):
        raise ValueError(f"the copied kernel takes one bf16 row against a contiguous bf16 weight [N, K] with K a "
                         f"multiple of {BLOCK_K} and N of a slice height {BLOCK_NS} whose slice fits {SLICE_BYTES} "
                         f"bytes, on a Hopper GPU; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} on {x.device}")


def _launch(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, norm: tuple | None = None,
            up: torch.Tensor | None = None) -> None:
    """The kernel over w's column blocks; `norm`: (residual, x_weight, out_weight or None, scale or None, h, eps);
    `up`: the GELU's other factor [1, N] (unit column stride)."""
    N, K = w.shape
    nt, bn = K // BLOCK_K, slice_rows(K)
    res, xw, ow, scale, h, eps = norm or (x, x, None, None, x, 0.0)
    mode = 0 if norm is None else 1 if ow is None else 2
    warps = NUM_WARPS if up is None else GATE_WARPS
    _copied_gemv_kernel[(N // bn,)](weight_descriptor(w, bn), x, out, res, xw, x if ow is None else ow,
                                    x if scale is None else scale, h, x if up is None else up, float(eps), K,
                                    NT=nt, XP=triton.next_power_of_2(nt), BN=bn, BK=BLOCK_K, NORM=mode,
                                    HAS_SCALE=scale is not None, GELU=up is not None, NUM_WARPS=warps,
                                    num_warps=warps, launch_pdl=True)


def copied_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K].T -> [1, N] (bf16) where the kernel fits (`kernel_fits`, on a Hopper GPU; the op asks
    `copies_take`); `out` (e.g. NaN-poisoned) is where it goes."""
    _check(x, w)
    x = x.contiguous()
    out = torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    _launch(w, x, out)
    return out


def copied_add_norm_linear(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                           eps: float, scale: torch.Tensor | None, w: torch.Tensor,
                           out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm (plugins/triton_norm.py) and the projection of its normed output by w, one launch (where the
    kernel fits, as copied_linear): returns h = residual + rms_norm(x) * x_weight [times scale], and
    rms_norm(h) * out_weight @ w.T. Every program forms the normed row itself while its weight slice is on its way."""
    _check_step(x, w, residual=residual, x_weight=x_weight, out_weight=out_weight)
    x, residual = x.contiguous(), residual.contiguous()
    h = torch.empty_like(residual)
    out = torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    _launch(w, x, out, (residual, x_weight.contiguous(), out_weight.contiguous(), scale, h, eps))
    return h, out


def copied_add_norm_gelu_linear(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, eps: float,
                                w: torch.Tensor, up: torch.Tensor,
                                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The PLE gate after the MLP's residual step, one launch (where the kernel fits, as copied_linear): returns
    h = residual + rms_norm(x) * x_weight and gelu_tanh(h @ w.T) * up, rounded as `g4rt::add_norm_gelu_linear`'s
    Triton epilogue rounds them. Its weight is small and the launch before it (the down_proj) long, so its copies
    are in shared memory before that one ends."""
    _check_step(x, w, residual=residual, x_weight=x_weight)
    if up.shape != (1, w.shape[0]) or up.dtype != x.dtype or up.stride(-1) != 1:
        raise ValueError(f"copied_add_norm_gelu_linear's up must be [1, {w.shape[0]}] {x.dtype} with unit column "
                         f"stride, got {tuple(up.shape)} {up.dtype} stride {tuple(up.stride())}")
    x, residual = x.contiguous(), residual.contiguous()
    h = torch.empty_like(residual)
    out = torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    _launch(w, x, out, (residual, x_weight.contiguous(), None, None, h, eps), up)
    return h, out


def _check_step(x: torch.Tensor, w: torch.Tensor, **rows: torch.Tensor) -> None:
    """`_check`, and each of `rows` (the residual step's vectors) one row of x's length and dtype."""
    _check(x, w)
    for name, t in rows.items():
        if t.numel() != x.shape[1] or t.dtype != x.dtype:
            raise ValueError(f"the residual step's {name} must hold {x.shape[1]} {x.dtype} values like x's row, "
                             f"got {tuple(t.shape)} {t.dtype}")
