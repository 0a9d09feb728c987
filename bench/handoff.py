"""What a stage hand-off costs at batch 1: a chain of S small matmuls (y_s = W_s y_{s-1}, square bf16 weights, a
row of x) run as S launches with programmatic dependent launch, as the engine's step runs them, against one
persistent launch whose programs run every stage and meet at a grid-wide counter between stages (a GPU bench):

    python -m g4rt.bench.handoff --out DIR [--dims 1024,2048,2560,4096] [--stages 32] [--arms launches,persistent]

Why: the small models' batch-1 step (E2B, E4B) is about 400-480 launches, each of which costs about 3 us beyond
the time its bytes take (export/results, sessions 20-23). A persistent kernel per layer would replace launch
boundaries by such counters; this measures whether a counter hands a stage over faster than a launch boundary
does, on the same stage code. Both arms read a stage's first weight tile before they wait for the stage before.

Per dimension and arm, one JSON line in DIR/handoff.jsonl: microseconds a stage (median of `time_ms`'s CUDA-graph
replays, cold L2, distinct weights a stage, more bytes than L2), the time its weight bytes take at the copy
bandwidth measured in the same process, and the difference (what the hand-off and the stage's own chain cost;
the persistent arm's also carries a zeroing of its counter per S stages). Each arm's last stage is compared with
an fp32 chain (`max_rel_err_vs_fp32`), and the two arms with each other (`arms_equal`: the same bits).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from g4rt.plugins.triton_attention import await_inputs, interpreting, pdl_launch
from g4rt.plugins.triton_gemv import MIN_ROW_TILE, NARROW_CONFIGS, _gemv_tile, _weight_tile

from .common import ceilings, log_json, time_ms

NAME = "handoff.jsonl"
BLOCK_N, BLOCK_K, WARPS, STAGES = NARROW_CONFIGS[0]  # the op's tile for the small models' narrow weights


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
    p.add_argument("--arms", default="launches,persistent",
                   help="which arms this process runs (a process an arm, alternated, for an A/B)")
    p.add_argument("--out", type=Path, required=True, help=f"results directory (appends {NAME})")
    a = p.parse_args(argv)
    arms = [arm for arm in a.arms.split(",") if arm]
    if not arms or set(arms) - {"launches", "persistent"}:
        p.error(f"--arms: launches and/or persistent, got {a.arms!r}")
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
        for persistent in [arm == "persistent" for arm in arms]:
            y = torch.full((a.stages + 1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            y[0] = x
            chain(w, y, count, persistent)
            outs[persistent] = y.clone()
            err = ((y[-1].float() - ref).abs().max() / ref.abs().max()).item()
            us = time_ms(lambda: chain(w, y, count, persistent)) * 1e3 / a.stages
            log_json(a.out, {"stage": "handoff", "n": n, "stages": a.stages, "programs": -(-n // BLOCK_N),
                             "arm": "persistent" if persistent else "launches", "us_a_stage": round(us, 3),
                             "bytes_us_a_stage": round(bytes_us, 3), "over_bytes_us": round(us - bytes_us, 3),
                             "max_rel_err_vs_fp32": round(err, 5), "copy_GBps": round(ceil["copy_GBps"], 1)}, NAME)
        if len(outs) == 2:
            log_json(a.out, {"stage": "handoff_check", "n": n, "arms_equal": bool(torch.equal(outs[False], outs[True]))},
                     NAME)
        del w
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
