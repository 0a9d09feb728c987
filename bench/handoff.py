"""What a stage hand-off costs at batch 1: a chain of S small matmuls (y_s = W_s y_{s-1}, square bf16 weights, a
row of x) run as S launches with programmatic dependent launch, as the engine's step runs them, against one
persistent launch whose programs run every stage and meet at a grid-wide counter between stages (a GPU bench):

    python -m g4rt.bench.handoff --out DIR [--dims 1024,2048,2560,4096] [--stages 32]
                                      [--arms launches,persistent,prefetch,copies]

Why: the small models' batch-1 step (E2B, E4B) is about 400-480 launches, each of which costs about 3 us beyond
the time its bytes take (export/results/README.md has the measurements). Arms:
- `launches`: the Triton skinny matmul's launches (plugins/triton_gemv.py's tiles), each reading its first weight
  tile before it waits for the launch before it;
- `persistent`: the same stage code in one launch, a grid-wide counter between stages;
- `prefetch` (Gluon, Hopper only): one persistent launch whose programs copy their whole slice of the next stage's
  weight (`--prefetch-slots 2`: the next two) into shared memory while they wait at the counter; after the wait x
  comes from L2 in one round trip, then the sums and the store;
- `copies` (Gluon, Hopper only): a launch a stage, the engine's batch-1 kernel for small weights
  (plugins/gluon_gemv.py): each program's slice copied into shared memory before it waits for the launch before it.
On the H200 a counter hands a stage over no faster than a launch boundary; the prefetch arm costs 2.3-2.7 us a
stage beyond its bytes, the copies arm 1.3 at N 1,024 and 2,048 and 2.1 at 2,560, the launches 3.0-3.3
(export/results/README.md, "what a stage hand-off costs" and "Weight slices copied into shared memory").

Per dimension and arm, one JSON line in DIR/handoff.jsonl: microseconds a stage (median of `time_ms`'s CUDA-graph
replays, cold L2, distinct weights a stage, more bytes than L2), the time its weight bytes take at the copy
bandwidth measured in the same process, and the difference (what the hand-off and the stage's own chain cost;
the persistent arms' also carry a zeroing of their counter per S stages). Each arm's last stage is compared with
an fp32 chain (`max_rel_err_vs_fp32`), and the two Triton arms with each other (`arms_equal`: the same bits).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from g4rt.plugins.gluon_attention import _sync, _tma_load
from g4rt.plugins.gluon_gemv import copied_linear, kernel_fits, slice_dot, slice_rows, x_tile
from g4rt.plugins.launch import await_inputs, hopper, interpreting, pdl_launch
from g4rt.plugins.triton_gemv import MIN_ROW_TILE, NARROW_CONFIGS, _gemv_tile, _weight_tile

from .common import ceilings, log_json, time_ms

NAME = "handoff.jsonl"
BLOCK_N, BLOCK_K, WARPS, STAGES = NARROW_CONFIGS[0]  # the op's tile for the small models' narrow weights
PREFETCH_SMEM = 200 << 10  # the most shared memory a prefetch program's weight slices and x may take


@triton.jit
def _chain_kernel(w_ptr, y_ptr, count_ptr, first, stages, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """Stages [first, first + stages) of the chain over y [S + 1, N] (stage s reads row s, writes row s + 1; row 0
    is x), weights [S, N, N]. Program p computes column block p of every stage with the skinny matmul's tiles
    (plugins/triton_gemv.py: x padded to BLOCK_M rows on the tensor cores); between two stages of this
    launch it adds one to the counter (release) and waits until every program has (acquire)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < 1
    w_rows = w_ptr + n[:, None] * N
    for s in range(first, first + stages):
        w_stage = w_rows + s * N * N  # chain() keeps S N^2 below 2^31
        k = tl.arange(0, BLOCK_K)
        w = _weight_tile(w_stage, k, N, n_ok, EVEN)  # no kernel writes weights: read before the wait
        if s == first:
            await_inputs(PDL)  # the launch before wrote this stage's input
        else:
            target = (s - first) * tl.num_programs(0)
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")
            while seen < target:
                seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        x_rows = y_ptr + s * N + m[:, None] * 0
        acc = _gemv_tile(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), w, x_rows, k, N, m_ok, UPCAST, "tf32")
        for k0 in range(BLOCK_K, N, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            acc = _gemv_tile(acc, _weight_tile(w_stage, k, N, n_ok, EVEN), x_rows, k, N, m_ok, UPCAST, "tf32")
        out = y_ptr + (s + 1) * N + m[:, None] * 0 + n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
        if s + 1 < first + stages:
            tl.debug_barrier()  # every thread's stores made before the counter's release
            tl.atomic_add(count_ptr, 1, sem="release")


@gluon.jit
def _copy_slice(w_desc, stage, N, pid, bar, w_smem, slot, NT: gl.constexpr, BLOCK_N: gl.constexpr,
                BK: gl.constexpr):
    """Ask the copy engine for program `pid`'s slice of `stage`'s weight into ring slot `slot` (NT boxes)."""
    mbarrier.expect(bar, NT * BLOCK_N * BK * 2)
    for t in gl.static_range(NT):
        _tma_load(w_desc, [stage * N + pid * BLOCK_N, t * BK], bar, w_smem.index(slot * NT + t))


@gluon.jit
def _prefetch_chain_kernel(w_desc, y_ptr, count_ptr, S, N, NT: gl.constexpr, XP: gl.constexpr,
                           SLOTS: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The persistent chain with each program's whole slice of a stage's weight [BLOCK_N, N] copied into shared
    memory ahead (NT tensor-memory copies of [BLOCK_N, BK] into a ring of SLOTS slices): with one slot the next
    stage's copy runs while the program meets the others at the counter, with two the one after it is in flight
    through a whole stage. After the wait a stage reads x from L2 in one round trip (as [XP, BK], XP the next
    power of two of NT, into shared memory) and its weights from shared memory (fp32 sums on the CUDA cores, a
    row of x). Weights are w_desc over [S N, N]; y as _chain_kernel's."""
    pid = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [SLOTS * NT, BLOCK_N, BK], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(SLOTS):
        mbarrier.init(bars.index(j), count=1)
    fence_async_shared()  # the barriers initialised before the copy engine signals them
    for j in gl.static_range(SLOTS):
        if j < S:
            _copy_slice(w_desc, j, N, pid, bars.index(j), w_smem, j, NT, BLOCK_N, BK)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [XP, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for s in range(S):
        slot = s % SLOTS
        if s > 0:
            target = s * gl.num_programs(0)
            seen = gl.atomic_add(count_ptr, 0, sem="acquire")
            while seen < target:
                seen = gl.atomic_add(count_ptr, 0, sem="acquire")
        x_at, x_ok = x_tile(NT, XP, BK, layout)
        x_smem.store(gl.load(y_ptr + s * N + x_at, mask=x_ok, other=0.0, cache_modifier=".cg"))
        acc = slice_dot(bars.index(slot), (s // SLOTS) & 1, w_smem, slot * NT, x_smem, NT, BLOCK_N, layout)
        gl.store(y_ptr + (s + 1) * N + pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout)),
                 acc.to(gl.bfloat16))
        if s + 1 < S:
            _sync()  # every thread done with the slot and x and its stores made, before the copies and the release
            fence_async_shared()
            if s + SLOTS < S:
                _copy_slice(w_desc, s + SLOTS, N, pid, bars.index(slot), w_smem, slot, NT, BLOCK_N, BK)
            gl.atomic_add(count_ptr, 1, sem="release")
    for j in gl.static_range(SLOTS):
        mbarrier.invalidate(bars.index(j))


SMEM_PER_SM = 227 << 10  # an H200 SM's shared memory for blocks (the opt-in maximum of one block)


def prefetch_smem(n: int, block_n: int, slots: int) -> int:
    """Shared memory of a prefetch program: its ring of weight slices, x, and 1 KB for its barriers and alignment."""
    return slots * block_n * n * 2 + triton.next_power_of_2(n // BLOCK_K) * BLOCK_K * 2 + 1024


def prefetch_fits(n: int, block_n: int, slots: int, sms: int) -> bool:
    """Whether a prefetch chain of [n, n] weights in slices of `block_n` rows, `slots` slices a program, runs on
    `sms` SMs: whole [block_n, BLOCK_K] copies, a program within PREFETCH_SMEM, and every program resident at once
    (they wait for each other at the counter)."""
    smem = prefetch_smem(n, block_n, slots)
    return (n % block_n == 0 and n % BLOCK_K == 0 and smem <= PREFETCH_SMEM
            and n // block_n <= sms * (SMEM_PER_SM // smem))


def prefetch_takes(n: int, block_n: int, slots: int) -> bool:
    """Whether the prefetch arm runs here: a Hopper GPU (Gluon has no interpreter) that `prefetch_fits`."""
    return (torch.cuda.is_available() and hopper(torch.device("cuda")) and not interpreting()
            and prefetch_fits(n, block_n, slots, torch.cuda.get_device_properties(0).multi_processor_count))


def copied_chain(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """chain()'s launches as the engine's batch-1 kernel for small weights runs them (plugins/gluon_gemv.py: each
    program's weight slice copied into shared memory before it waits for the launch before it)."""
    for s in range(w.shape[0]):
        copied_linear(y[s:s + 1], w[s], out=y[s + 1:s + 2])
    return y


def prefetch_chain(w: torch.Tensor, y: torch.Tensor, count: torch.Tensor, block_n: int, slots: int) -> torch.Tensor:
    """chain()'s persistent arm with the stages' weights copied into shared memory ahead, a program a slice of
    `block_n` rows, `slots` slices in flight (`prefetch_takes`)."""
    S, N, _ = w.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.bfloat16)
    desc = TensorDescriptor(w.view(S * N, N), [S * N, N], [N, 1], [block_n, BLOCK_K], layout)
    count.zero_()
    _prefetch_chain_kernel[(N // block_n,)](desc, y, count, S, N, NT=N // BLOCK_K,
                                            XP=triton.next_power_of_2(N // BLOCK_K), SLOTS=slots, BLOCK_N=block_n,
                                            BK=BLOCK_K, NUM_WARPS=WARPS, num_warps=WARPS)
    return y


def chain(w: torch.Tensor, y: torch.Tensor, count: torch.Tensor, persistent: bool) -> torch.Tensor:
    """Rows 1..S of y [S + 1, N] = the chain of w [S, N, N] from row 0: S launches of one stage each (`persistent`
    False) or one launch of every stage (the counter zeroed first), a program a BLOCK_N columns. A persistent
    launch needs all its programs resident at once, and the interpreter runs them one after another, so there
    it takes one column block."""
    S, N, _ = w.shape
    if y.shape != (S + 1, N) or not y.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"chain needs contiguous w [S, N, N] and y [S + 1, N], got {tuple(w.shape)} and "
                         f"{tuple(y.shape)}")
    if w.numel() >= 2 ** 31:
        raise ValueError(f"chain's weights index in 32 bits: S N^2 = {w.numel():,} is too many")
    programs = triton.cdiv(N, BLOCK_N)
    if interpreting() and persistent and programs > 1:
        raise ValueError(f"the interpreter runs programs one after another: a persistent chain takes one program, "
                         f"N <= {BLOCK_N}, got N = {N}")
    launch = dict(BLOCK_M=MIN_ROW_TILE, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, EVEN=N % BLOCK_N == 0 and N % BLOCK_K == 0,
                  UPCAST=interpreting(), num_warps=WARPS, num_stages=STAGES, **pdl_launch(w.device))
    if persistent:
        count.zero_()
        _chain_kernel[(programs,)](w, y, count, 0, S, N, **launch)
    else:
        for s in range(S):
            _chain_kernel[(programs,)](w, y, count, s, 1, N, **launch)
    return y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m g4rt.bench.handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="1024,2048,2560,4096",
                   help=f"square weight sizes N (comma-separated; N / {BLOCK_N} programs a launch)")
    p.add_argument("--stages", type=int, default=32, help="stages S of the chain (distinct weights)")
    p.add_argument("--prefetch-block-n", type=int, default=BLOCK_N,
                   help="rows of the weight a prefetch program holds (fewer: more programs, more SMs streaming)")
    p.add_argument("--prefetch-slots", type=int, default=1, choices=(1, 2),
                   help="weight slices a prefetch program holds: 1, the next stage's copy overlaps the counter's wait; "
                        "2, the one after it is in flight through a whole stage")
    p.add_argument("--arms", default="launches,persistent,prefetch,copies",
                   help="which arms this process runs (a process an arm, alternated, for an A/B)")
    p.add_argument("--out", type=Path, required=True, help=f"results directory (appends {NAME})")
    a = p.parse_args(argv)
    arms = [arm for arm in a.arms.split(",") if arm]
    if not arms or set(arms) - {"launches", "persistent", "prefetch", "copies"}:
        p.error(f"--arms: some of launches, persistent, prefetch, copies; got {a.arms!r}")
    a.out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(False)
    log_json(a.out, {"stage": "setup", "gpu": torch.cuda.get_device_name(), **ceil}, NAME)
    for n in [int(d) for d in a.dims.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(n)
        w = torch.randn(a.stages, n, n, device="cuda", dtype=torch.bfloat16, generator=g) / n ** 0.5
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = x.float()  # the chain in fp32 from the same bf16 weights, each stage rounded as the kernel rounds it
        for s in range(a.stages):
            ref = (w[s].float() @ ref).to(torch.bfloat16).float()
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        bytes_us = n * n * w.element_size() / (ceil["copy_GBps"] * 1e9) * 1e6
        outs = {}
        for arm in arms:
            if arm == "prefetch" and not prefetch_takes(n, a.prefetch_block_n, a.prefetch_slots):
                log_json(a.out, {"stage": "handoff", "n": n, "arm": arm, "skipped": "prefetch_takes is false"}, NAME)
                continue
            if arm == "copies" and not (hopper(w.device) and not interpreting() and kernel_fits(1, n, n, w.dtype)):
                log_json(a.out, {"stage": "handoff", "n": n, "arm": arm, "skipped": "kernel_fits is false"}, NAME)
                continue
            run = {"launches": lambda: chain(w, y, count, False), "persistent": lambda: chain(w, y, count, True),
                   "prefetch": lambda: prefetch_chain(w, y, count, a.prefetch_block_n, a.prefetch_slots),
                   "copies": lambda: copied_chain(w, y)}[arm]
            y = torch.full((a.stages + 1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            y[0] = x
            run()
            outs[arm] = y.clone()
            err = ((y[-1].float() - ref).abs().max() / ref.abs().max()).item()
            us = time_ms(run) * 1e3 / a.stages
            block_n = {"prefetch": a.prefetch_block_n, "copies": slice_rows(n)}.get(arm, BLOCK_N)
            extra = {"block_n": block_n, **({"slots": a.prefetch_slots} if arm == "prefetch" else {})}
            log_json(a.out, {"stage": "handoff", "n": n, "stages": a.stages, "programs": -(-n // block_n), **extra,
                             "arm": arm, "us_a_stage": round(us, 3),
                             "bytes_us_a_stage": round(bytes_us, 3), "over_bytes_us": round(us - bytes_us, 3),
                             "max_rel_err_vs_fp32": round(err, 5), "copy_GBps": round(ceil["copy_GBps"], 1)}, NAME)
        if {"launches", "persistent"} <= set(outs):  # the same stage code: the same bits
            log_json(a.out, {"stage": "handoff_check", "n": n,
                             "arms_equal": bool(torch.equal(outs["launches"], outs["persistent"]))}, NAME)
        del w
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
