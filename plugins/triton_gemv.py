"""A skinny-matmul kernel for decode: y = x @ w.T for a few rows of x (the op's M <= 8; up to 128 for the bench's
serving sweep) and a weight in the checkpoint's [out, in] layout, read once at the memory's speed.

Why: at batch 1 a decode step is its matmuls, and cuBLAS reads some of their weights well below the copy
bandwidth (the small models' narrow ones furthest). A decode matmul is a stream over the weight: every program
owns BLOCK_N output columns (weight rows), walks K in BLOCK_K steps with `num_stages` tiles in flight, and
accumulates the padded [16, BLOCK_N] product in fp32 on the tensor cores; x is re-read from L2 by every program.
Its first weight tile is read before the program waits for the kernel before it (programmatic dependent launch,
`await_inputs`): nothing writes weights, so that read overlaps the previous kernel's tail, where cuBLAS's kernels
wait for the kernel before them to end. A weight too narrow for one column block per SM can be cut over K as well
(`splits`): each run's program writes an fp32 partial and the block's last program adds them in run order, so
the bits depend on the plan (shape-only, `gemv_plan`), never on timing.

Every projection of the model goes through the op `g4rt::skinny_linear`, which takes the kernel for a few rows and
a weight that gives every SM a program of MODEL_CONFIG (wide, or cut over K), or is at most NARROW_BYTES (then a
narrow tile gives it the programs); everything else is `blas_linear` (cuBLAS, or cuBLASLt where it measured
faster). The gated GELU of the MLP's packed gate/up and of the PLE gate is this kernel's epilogue
(`g4rt::gelu_linear`), and the residual step before such a GELU, its norms included, its prologue
(`g4rt::add_norm_gelu_linear`, `ResidualNorm`): every program forms the input rows whole from L2 into a slice of
its own, so no norm kernel runs between the projections. Each of these choices stays because the H200's decode
step is faster with it than without (`python -m g4rt.bench.engine --matmuls` per role, `--profile` per launch;
the steps are in export/results/README.md): against the kernel for the q/k/v and the lm_head only, the E4B's
batch-1 step takes 3.76 ms instead of 4.42 and the 31B's about 15.8 instead of 16.41.
Under TRITON_INTERPRET=1 bf16 dots are wrong, so the tiles are upcast to fp32 there (set automatically).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .gluon_gemv import (copied_add_norm_gelu_linear, copied_add_norm_linear, copied_linear, copies_take,
                         gate_copies_take)
from .launch import await_inputs, interpreting, pdl_launch, sm_count
from .triton_norm import add_normed, add_rms_norm, gelu_tanh_mul, gelu_tanh_rounded

MAX_ROWS = 128  # rows of x one launch takes, in one row tile (row_tile)
MIN_ROW_TILE = 16  # the smallest row tile: the dot's smallest M; more rows than it are a serving batch's
SKINNY_ROWS = 8  # rows up to which `g4rt::skinny_linear` takes the kernel (measured faster at 1 and 8)
MODEL_CONFIG = (64, 128, 4, 4)  # within 1.5 % of the fastest tile on every role the op serves (31B, batch 1 and 8)
# The op's tiles for weights too narrow to give every SM a MODEL_CONFIG column block, widest first.
NARROW_CONFIGS = ((32, 256, 4, 4), (16, 512, 4, 3))
# A weight that narrow with K at least this long is cut over K instead (gemv_plan): its MODEL_CONFIG column
# blocks, each K run of at most MAX_SPLITS a program. On the H200 at batch 1 the E2B's down_proj [1,536 x
# 6,144] took 0.115 ms over 12 layers cut in 4 against 0.160 for the fastest unsplit tile; K of 1,536-2,048
# gained nothing (export/results/README.md, "A split over K for the skinny matmul").
SPLIT_MIN_K = 4096
MAX_SPLITS = 16
# A cut over K takes the most runs that keep its programs within SPLIT_PROGRAMS an SM (gemv_plan). On the H200 at
# batch 1, 3 an SM rounded up made the E2B's step 1.96 ms against 2.00 (its down_proj [1,536 x 12,288], 24 column
# blocks, cut in 16 runs, not 11) and the E4B's 3.45 against 3.50 (its [2,560 x 10,240] in 10, not 7), but the
# 31B's o_proj and down_proj (84 blocks) in 5 runs, not 4, took 50.9 us a launch against 42.4 (15.6 -> 16.6 ms a
# step); rounded down the 31B keeps 4 and the E2B 16, and the E4B's 9 runs took its step 3.435 ms against 3.49 in 7
# (its 42 cut launches 0.715 ms, 0.831 in 7, 0.777 in 10) (export/results/README.md, "three programs an SM for a
# cut over K").
SPLIT_PROGRAMS = 3
# A weight so narrow that even the narrowest tile gives fewer than 3/5 of the SMs a program (the PLE gates'
# 256 columns, the MoE router's 128) takes the widest narrow tile cut over K from this K on: the E4B's PLE
# gate [256 x 2,560] at batch 1 on the H200, 35 layers, 0.164 ms on 16 unsplit 16-column blocks against
# 0.132 on 8 blocks of 32 cut in 8; the E2B's [256 x 1,536] 0.092 against 0.086 (export/results/README.md,
# "Head-dim-512 prefill by tensor-memory copies; the bounded gelu_linear on the 31B").
NARROW_SPLIT_MIN_K = 1536
# A weight too narrow for MODEL_CONFIG to give every SM a column block, and too short in K to be cut, takes
# the kernel up to this size (the small models' packed q/k/v, their sliding layers' o_proj, the PLE
# projections); beyond it, cuBLAS. 32 MiB measured faster than 64 on the E2B and E4B in the H200's step with
# every weight unsplit; the bound is not measured with weights cut over K (export/results/README.md, "Every
# projection through the skinny matmul at batch 1").
NARROW_BYTES = 32 << 20
# The packed gate/up with its GELU in the epilogue takes MODEL_CONFIG's tile at 3 stages, not 4, from K of
# PACKED_GELU_MIN_K on (gemv_plan's `packed_gelu`): on the H200 at batch 1 the E4B's step (K 2,560) took 3.765 ms
# against 3.804, its 42 gate/up launches 1.192 ms against 1.231; the E2B's (K 1,536) 2.369-2.382 against
# 2.343-2.358, its 20 wide gate/up launches 0.5 us slower each; every MODEL_CONFIG launch of the E4B at 3 stages,
# 3.912, the split down_proj slower (export/results/README.md, "A launch's fixed cost").
PACKED_GELU_CONFIG = (*MODEL_CONFIG[:3], 3)
PACKED_GELU_MIN_K = 2560
# (block_n, block_k, num_warps, num_stages) the bench sweeps; the first is the default.
GEMV_CONFIGS = [(16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 8, 3), (64, 128, 4, 4),
                (64, 256, 8, 3), (16, 1024, 8, 2), (128, 128, 8, 3)]


def row_tile(rows: int) -> int:
    """A launch's row tile for `rows` rows of x: the next power of two, at least MIN_ROW_TILE."""
    return max(MIN_ROW_TILE, triton.next_power_of_2(rows))


@triton.jit
def _weight_tile(w_rows, k, K, n_ok, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _gemv_tile(acc, w, x_rows, k, K, m_ok, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """acc plus the product of x's columns k with weight tile w."""
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    if UPCAST:
        w, x = w.to(tl.float32), x.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision=PREC)


@triton.jit
def _residual_rows(x_ptr, stride_x, res_ptr, w1_ptr, w2_ptr, h_ptr, in_ptr, M, K, eps, h_cols,
                   NORM: tl.constexpr, KB: tl.constexpr):
    """The matmul's input rows from a residual step, written to in_ptr [M, K]: h = residual + rms_norm(x) * w1,
    rounded as add_normed rounds it (the norm's product, then the sum), or (NORM == 2) rms_norm(h) * w2. A row
    at a time, whole (KB >= K lanes): one round trip to L2 for its inputs, both norms from registers. Its first
    `h_cols` columns of h (K in the program that writes h, else 0) are stored to h_ptr [M, K]."""
    c = tl.arange(0, KB)
    ok = c < K
    w1 = tl.load(w1_ptr + c, mask=ok, other=0.0).to(tl.float32)
    if NORM == 2:
        w2 = tl.load(w2_ptr + c, mask=ok, other=0.0).to(tl.float32)
    for m in range(M):
        x = tl.load(x_ptr + m * stride_x + c, mask=ok, other=0.0)
        res = tl.load(res_ptr + m * K + c, mask=ok, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        y = xf / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps) * w1
        h = (res + y.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + m * K + c, h, mask=c < h_cols)
        if NORM == 2:
            hf = h.to(tl.float32)
            h = (hf / tl.sqrt(tl.sum(hf * hf, axis=0) / K + eps) * w2).to(x.dtype)
        tl.store(in_ptr + m * K + c, h, mask=ok)


@triton.jit
def _store(out_ptr, stride_out, up_ptr, stride_up, acc, m, m_ok, pid, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           GELU: tl.constexpr):
    """Round the block's fp32 sums to the output type and store them; with GELU the gated GELU of them first,
    as the gelu kernel (plugins/triton_norm.py) forms it from the rounded matmul output: GELU == 1, the
    tile's columns are (gate, up) pairs; GELU == 2, the sums are the gate and up is read from up_ptr."""
    dtype = out_ptr.dtype.element_ty
    if GELU == 1:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        c = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ok = m_ok[:, None] & (c < N // 2)[None, :]
        y = gelu_tanh_rounded(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), out_ptr)
    else:
        c = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = m_ok[:, None] & (c < N)[None, :]
        y = acc.to(dtype)
        if GELU == 2:
            up = tl.load(up_ptr + m[:, None] * stride_up + c[None, :], mask=ok, other=0.0)
            y = gelu_tanh_rounded(y.to(tl.float32), up.to(tl.float32), out_ptr)
    tl.store(out_ptr + m[:, None] * stride_out + c[None, :], y, mask=ok)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, up_ptr, part_ptr, lock_ptr, res_ptr, w1_ptr, w2_ptr, h_ptr, in_ptr, eps, M,
                 N, K, split_k, stride_x, stride_w, stride_out, stride_up, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 GELU: tl.constexpr, NORM: tl.constexpr, KB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (i, s) sums K's columns [s * split_k, (s + 1) * split_k) for tile column block i. With SPLITS
    > 1 each writes its fp32 partial, and the block's last program to finish (a counter per block, which
    that program resets) adds the partials in split order, so the bits do not depend on which finished last.
    With GELU == 1 the weight's N rows are gate rows then up rows, and tile column 2j + h is row h * N/2 + j
    of the block's pairs: each program holds a gate column and its up column for the epilogue. With NORM
    the input is a residual step formed from x (see ResidualNorm): every program forms all of it itself from
    L2 (a few rows of K elements) into its own slice of in_ptr [programs, M, K] and reads its tiles from there;
    program (0, 0) also writes h."""
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_N)
    n = pid * BLOCK_N + r  # tile columns: the partials' index
    if GELU == 1:
        pair = pid * (BLOCK_N // 2) + r // 2
        n_ok = pair < N // 2
        row = pair + (r % 2) * (N // 2)
    else:
        n_ok = n < N
        row = n
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    w_rows = w_ptr + row.to(tl.int64)[:, None] * stride_w
    k_lo = tl.program_id(1) * split_k
    k_hi = tl.minimum(k_lo + split_k, K)
    k = k_lo + tl.arange(0, BLOCK_K)
    w = _weight_tile(w_rows, k, K, n_ok, EVEN_N and EVEN_K)  # no kernel writes weights: read before the wait
    await_inputs(PDL)
    if NORM:
        own = in_ptr + (pid * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * M * K
        _residual_rows(x_ptr, stride_x, res_ptr, w1_ptr, w2_ptr, h_ptr, own, M, K, eps,
                       tl.where((pid == 0) & (tl.program_id(1) == 0), K, 0), NORM, KB)
        tl.debug_barrier()  # the program's input rows stored before any of its threads reads them
        x_rows = own + m[:, None] * K
    else:
        x_rows = x_ptr + m[:, None] * stride_x
    acc = _gemv_tile(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), w, x_rows, k, K, m_ok, UPCAST, PREC)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc = _gemv_tile(acc, _weight_tile(w_rows, k, K, n_ok, EVEN_N and EVEN_K), x_rows, k, K, m_ok, UPCAST, PREC)
    if SPLITS == 1:
        _store(out_ptr, stride_out, up_ptr, stride_up, acc, m, m_ok, pid, N, BLOCK_M, BLOCK_N, GELU)
    else:
        part_ok = m_ok[:, None] & n_ok[None, :]
        part = part_ptr + m[:, None] * N + n[None, :]  # partials [SPLITS, M, N], fp32
        tl.store(part + tl.program_id(1) * M * N, acc, mask=part_ok)
        tl.debug_barrier()  # every thread's partial stored before the counter's release
        if tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel") == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(part + s * M * N, mask=part_ok, other=0.0, cache_modifier=".cg")
            _store(out_ptr, stride_out, up_ptr, stride_up, total, m, m_ok, pid, N, BLOCK_M, BLOCK_N, GELU)
            tl.atomic_xchg(lock_ptr + pid, 0)


_LOCKS: dict[torch.device, torch.Tensor] = {}
LOCKS = 4096  # column blocks a split launch may have (a split weight has fewer than the SMs' count)


def _locks(device: torch.device) -> torch.Tensor:
    """The split launches' counters, one per column block, zero between launches (each block's last program
    resets its own). One fixed buffer per device, never replaced, so every CUDA graph keeps the counters it
    was captured with; launches on a device run in one stream order, as every engine's do."""
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return _LOCKS[device]


class ResidualNorm(NamedTuple):
    """A residual step the matmul's input is formed from, in the kernel's prologue: h = residual +
    rms_norm(x) * x_weight (add_normed's rounding), written to `h`; the input is h, or with `out_weight`
    rms_norm(h) * out_weight (add_rms_norm's second output). residual and h are [M, K] and contiguous."""
    residual: torch.Tensor
    x_weight: torch.Tensor
    out_weight: torch.Tensor | None
    eps: float
    h: torch.Tensor


def _check_norm(norm: ResidualNorm, x: torch.Tensor) -> None:
    for name, t in (("residual", norm.residual), ("h", norm.h)):
        if t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"gemv's {name} must be a contiguous {tuple(x.shape)} {x.dtype} like x; got "
                             f"{tuple(t.shape)} {t.dtype}{'' if t.is_contiguous() else ', not contiguous'}")
    for name, t in (("x_weight", norm.x_weight), ("out_weight", norm.out_weight)):
        if t is not None and (t.shape != (x.shape[1],) or not t.is_contiguous()):
            raise ValueError(f"gemv's {name} must be a contiguous [{x.shape[1]}] vector, got {tuple(t.shape)}")


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int] | None = None,
         out: torch.Tensor | None = None, splits: int = 1, halves: bool = False,
         up: torch.Tensor | None = None, norm: ResidualNorm | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit column stride) times w [N, K] (unit column stride) transposed ->
    [M, N] in x's dtype, as F.linear(x, w) computes it up to the order of the fp32 sums. `config`:
    (block_n, block_k, num_warps, num_stages), default GEMV_CONFIGS[0]; `out`: where to write it;
    `splits`: runs of whole BLOCK_K tiles K is cut into (fewer where K has fewer tiles). With the gated
    GELU in the epilogue, rounded as the gelu kernel rounds the matmul's output: `halves`, w's rows are
    gate then up and the result is gelu_tanh(gate) * up [M, N/2]; `up` [M, N], it is gelu_tanh(x w^T) * up.
    With `norm`, the matmul's input is the residual step it describes, formed from x (ResidualNorm)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and w [N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x, got {M}: use a matmul")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} and w is {w.dtype}: gemv needs one dtype")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv needs x and w contiguous along K")
    if halves and (up is not None or N % 2):
        raise ValueError(f"gemv's halves need an even row count of w and no up, got {N} rows"
                         f"{' and an up' if up is not None else ''}")
    if up is not None and (up.shape != (M, N) or up.dtype != x.dtype or up.stride(1) != 1):
        raise ValueError(f"gemv's up must be [{M}, {N}] in {x.dtype}, contiguous along N; got {tuple(up.shape)}, "
                         f"{up.dtype}, column stride {up.stride(1)}")
    if norm is not None:
        _check_norm(norm, x)
    config = config or GEMV_CONFIGS[0]
    const, split_k = launch_constexprs(M, N, K, config, splits, x.dtype == torch.float32,
                                       gelu=1 if halves else 0 if up is None else 2,
                                       norm=0 if norm is None else 1 if norm.out_weight is None else 2)
    blocks, splits = triton.cdiv(N, const["BLOCK_N"]), const["SPLITS"]
    if splits > 1 and blocks > LOCKS:
        raise ValueError(f"a split launch takes at most {LOCKS} column blocks, got {blocks}: split a narrower weight")
    out = torch.empty((M, N // 2 if halves else N), dtype=x.dtype, device=x.device) if out is None else out
    if M and N:
        part = torch.empty((splits, M, N) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
        locks = _locks(x.device) if splits > 1 else part
        res, w1, w2, h, rows_in = (x, x, x, x, x) if norm is None else (
            norm.residual, norm.x_weight, norm.x_weight if norm.out_weight is None else norm.out_weight, norm.h,
            torch.empty((blocks * splits, M, K), dtype=x.dtype, device=x.device))  # each program's input rows
        _gemv_kernel[(blocks, splits)](
            x, w, out, out if up is None else up, part, locks, res, w1, w2, h, rows_in,
            0.0 if norm is None else float(norm.eps), M, N, K, split_k, x.stride(0), w.stride(0), out.stride(0),
            0 if up is None else up.stride(0), **const, num_warps=config[2], num_stages=config[3],
            **pdl_launch(x.device))
    return out


def launch_constexprs(M: int, N: int, K: int, config: tuple[int, int, int, int], splits: int, fp32: bool,
                      gelu: int = 0, norm: int = 0) -> tuple[dict, int]:
    """`_gemv_kernel`'s constexprs (less PDL) for x [M, K] against w [N, K] on tile `config` cut in `splits` runs
    over K, and the run length: block_k at most K's next power of two, the runs whole BLOCK_K tiles (fewer
    where K has fewer tiles). gemv's launch, and bench.compile_report's offline compile of the same kernel."""
    block_n, block_k = config[0], min(config[1], max(16, triton.next_power_of_2(K)))
    split_k = triton.cdiv(triton.cdiv(K, block_k), max(1, splits)) * block_k
    return dict(BLOCK_M=row_tile(M), BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=triton.cdiv(K, split_k) if K else 1,
                EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, GELU=gelu, NORM=norm,
                KB=triton.next_power_of_2(K), UPCAST=interpreting(), PREC="ieee" if fp32 else "tf32"), split_k


def gemv_plan(n: int, k: int, device: torch.device,
              packed_gelu: bool = False) -> tuple[tuple[int, int, int, int], int]:
    """The op's (tile, splits over K) for a weight [n, k]: MODEL_CONFIG where its column blocks give every SM
    a program (PACKED_GELU_CONFIG for a packed gate/up with the GELU epilogue, `packed_gelu`, and K of at
    least PACKED_GELU_MIN_K); for a narrower weight with K of at least SPLIT_MIN_K, MODEL_CONFIG with K cut
    into the most runs (at most MAX_SPLITS) that keep its programs within SPLIT_PROGRAMS an SM; else the widest
    tile of MODEL_CONFIG and NARROW_CONFIGS (64, 32 or 16 columns) whose column blocks give 3/5 of the SMs a
    program; else, with K of at least NARROW_SPLIT_MIN_K, the widest narrow tile cut over K the same way; else
    the narrowest (the most programs). The stages never change the order of the sums."""
    sms = sm_count(device)

    def cut(config):  # config's column blocks, K cut into the most runs that keep SPLIT_PROGRAMS programs an SM
        return config, min(MAX_SPLITS, SPLIT_PROGRAMS * sms // triton.cdiv(n, config[0]))

    if triton.cdiv(n, MODEL_CONFIG[0]) >= sms:
        return PACKED_GELU_CONFIG if packed_gelu and k >= PACKED_GELU_MIN_K else MODEL_CONFIG, 1
    if k >= SPLIT_MIN_K:
        return cut(MODEL_CONFIG)
    for config in (MODEL_CONFIG, *NARROW_CONFIGS):
        if 5 * triton.cdiv(n, config[0]) >= 3 * sms:
            return config, 1
    if k >= NARROW_SPLIT_MIN_K:
        return cut(NARROW_CONFIGS[0])
    return NARROW_CONFIGS[-1], 1


def takes_gemv(rows: int, w: torch.Tensor) -> bool:
    """Whether `g4rt::skinny_linear` runs the kernel for `rows` rows of x against weight `w`: at most
    SKINNY_ROWS rows (cuBLAS beyond), and a weight that gemv_plan gives every SM a program of MODEL_CONFIG
    (wide, or split over K), or one of at most NARROW_BYTES (a narrow tile then gives it the programs)."""
    every_sm = gemv_plan(*w.shape, w.device)[1] > 1 or triton.cdiv(w.shape[0], MODEL_CONFIG[0]) >= sm_count(w.device)
    return rows <= SKINNY_ROWS and (every_sm or w.numel() * w.element_size() <= NARROW_BYTES)


# cuBLASLt's heuristic picks other kernels than cuBLAS's for some decode shapes. Measured on the H200, role by
# role and in the decode step (export/results/README.md, "cuBLASLt for long-K weights at 9-128 rows" and
# "cuBLASLt at batch 16 and on the 26B-A4B"): for long-K weights (o_proj, down_proj) it is faster at 9-64 rows
# (the 31B's step 0.6-1.1 % faster at batch 16, 32 and 64), at 65-128 rows only where K >= 3N
# (the 31B's sliding o_proj, K = 1.5N, was slower; its step at batch 128 a tie to 0.8 % faster); above 128 rows the
# step was slower even where the matmuls alone were faster; and below 2,560 outputs slower (the E2B's, N 1,536).
# Rows above the first and up to the second take cuBLASLt for K > N, up to the third for K >= 3N:
CUBLASLT_ROWS = (SKINNY_ROWS, 64, 128)
CUBLASLT_MIN_N = 2560  # and only for a weight of this many outputs or more


def cublaslt_takes(rows: int, n: int, k: int) -> bool:
    """Whether blas_linear runs `rows` rows against a weight [n, k] through cuBLASLt rather than cuBLAS."""
    lo, mid, hi = CUBLASLT_ROWS
    return lo < rows <= hi and CUBLASLT_MIN_N <= n < k and (rows <= mid or k >= 3 * n)


def blas_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) on CUDA through the BLAS library `cublaslt_takes` names for its shape (torch's preferred
    library, set for this call only), elsewhere plain F.linear."""
    if x.device.type != "cuda" or not cublaslt_takes(x.shape[0], *w.shape):
        return F.linear(x, w)
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@torch.library.custom_op("g4rt::skinny_linear", mutates_args=())
def _skinny_linear_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for x [M, K], w [N, K]: at batch 1 on a Hopper GPU a small weight's slices copied into shared
    memory before the launch waits (gluon_gemv.copies_take), else the Triton kernel where `takes_gemv`, else a BLAS
    library's (blas_linear). One opaque op, so the eager and the compiled engine make the same choice and compute
    the same bits."""
    if copies_take(x, w):
        return copied_linear(x, w)
    return _planned_gemv(x, w) if takes_gemv(x.shape[0], w) else blas_linear(x, w)


def _planned_gemv(x: torch.Tensor, w: torch.Tensor, **epilogue) -> torch.Tensor:
    """gemv on gemv_plan's tile and splits for w: the launch both ops share, so their sums are the same."""
    config, splits = gemv_plan(*w.shape, x.device, packed_gelu=epilogue.get("halves", False))
    return gemv(x.contiguous(), w, config, splits=splits, **epilogue)


@_skinny_linear_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


# The largest packed gate/up whose GELU the kernel forms in its epilogue; beyond it, the plain launch then the
# gelu kernel. On the H200 at batch 1 the epilogue took the E4B's step (gate/up 105 MB) from 3.96 to 3.87 ms,
# and the 31B's (462 MB) from 16.07 to 16.46 ms, which this bound keeps off (export/results/README.md, "The gated
# GELU in the skinny matmul's epilogue").
EPILOGUE_MAX_BYTES = 128 << 20


def _unit_stride(up: torch.Tensor | None) -> torch.Tensor | None:
    """The epilogue's `up` as gemv reads it: a row-strided view (a layer's slice of the per-layer inputs) in
    place, else a copy with unit column stride."""
    return up if up is None or up.stride(-1) == 1 else up.contiguous()


def _epilogue_takes(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor | None) -> bool:
    """Whether gelu_linear forms the GELU in the kernel's epilogue (one launch) for input x."""
    return takes_gemv(x.shape[0], w) and (up is not None or w.numel() * w.element_size() <= EPILOGUE_MAX_BYTES)


def _gelu_out(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """An empty result of gelu_linear: [rows, N] with `up`, [rows, N/2] for a packed gate/up."""
    return x.new_empty(x.shape[0], w.shape[0] if up is not None else w.shape[0] // 2)


@torch.library.custom_op("g4rt::gelu_linear", mutates_args=())
def _gelu_linear_op(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """The gated GELU of a projection, rounded as eager rounds it: gelu_tanh(gate) * up with gate, up the two
    halves of F.linear(x, w) (the MLP's packed gate/up), or with `up` given, gate = F.linear(x, w) (the PLE
    gate). The matmul is skinny_linear's (the kernel where `takes_gemv`, else cuBLAS), so are its sums; the
    GELU is the kernel's epilogue, one launch, for the PLE gate and a packed weight of at most
    EPILOGUE_MAX_BYTES, else the gelu kernel after it."""
    if _epilogue_takes(x, w, up):
        return _planned_gemv(x, w, halves=up is None, up=_unit_stride(up))
    y = _planned_gemv(x, w) if takes_gemv(x.shape[0], w) else blas_linear(x, w)
    if up is None:
        y, up = y.split(y.shape[-1] // 2, dim=-1)
    return gelu_tanh_mul(y, up)


@_gelu_linear_op.register_fake
def _(x, w, up):
    return _gelu_out(x, w, up)


@torch.library.custom_op("g4rt::add_norm_gelu_linear", mutates_args=())
def _add_norm_gelu_linear_op(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor,
                             out_weight: torch.Tensor | None, eps: float, w: torch.Tensor,
                             up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual step and the gated GELU of a projection of it: h = add_normed(residual, x, x_weight), then
    gelu_linear of h (the PLE gate) or, with out_weight, of rms_norm(h) * out_weight (the MLP after the
    attention's residual step). Returns (h, the GELU). Where gelu_linear is one launch (`_epilogue_takes`), the
    residual step is that launch's prologue too (ResidualNorm): one kernel where there were two; else the
    norm kernel, then gelu_linear. The PLE gate at one row on a Hopper GPU is the copied kernel's launch
    (gluon_gemv.gate_copies_take), its weight in shared memory before it waits."""
    if out_weight is None and up is not None and gate_copies_take(x, w):
        return copied_add_norm_gelu_linear(residual, x, x_weight, eps, w, _unit_stride(up))
    if not _epilogue_takes(x, w, up):
        if out_weight is None:
            h = z = add_normed(residual, x, x_weight, eps)
        else:
            h, z = add_rms_norm(residual, x, x_weight, out_weight, eps)
        return h, _gelu_linear_op(z, w, up)
    x, residual = x.contiguous(), residual.contiguous()
    h = torch.empty_like(residual)
    norm = ResidualNorm(residual, x_weight.contiguous(), None if out_weight is None else out_weight.contiguous(), eps, h)
    return h, _planned_gemv(x, w, halves=up is None, up=_unit_stride(up), norm=norm)


@_add_norm_gelu_linear_op.register_fake
def _(residual, x, x_weight, out_weight, eps, w, up):
    return torch.empty_like(residual), _gelu_out(x, w, up)


@torch.library.custom_op("g4rt::add_norm_linear", mutates_args=())
def _add_norm_linear_op(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                        eps: float, scale: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's tail and the next layer's first projection: (h, z) = add_rms_norm(residual, x, x_weight,
    out_weight, eps, scale), returned as (h, skinny_linear(z, w)). Where the copied kernel takes x against w (batch 1
    on a Hopper GPU, gluon_gemv.copies_take) one launch: its weight copies start while the layer's last kernel runs,
    a launch earlier than after a norm kernel of its own, and every program forms z while they arrive."""
    if copies_take(x, w):
        return copied_add_norm_linear(residual, x, x_weight, out_weight, eps, scale, w)
    h, z = add_rms_norm(residual, x, x_weight, out_weight, eps, scale)
    return h, _skinny_linear_op(z, w)


@_add_norm_linear_op.register_fake
def _(residual, x, x_weight, out_weight, eps, scale, w):
    return torch.empty_like(residual), x.new_empty(x.shape[0], w.shape[0])
