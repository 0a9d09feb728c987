"""GPU benchmark of the paged-attention kernels against the machine's own ceilings.

    python -m g4rt.bench.kernels --out DIR [--quick]
    python -m g4rt.bench.kernels --out DIR --sampler [--sampler-rows 1,64,256] [--reps 3] [--sampler-tiles]
    python -m g4rt.bench.kernels --out DIR --decode-short      # batch-1 decode at short context, split counts
    python -m g4rt.bench.kernels --out DIR --decode-batch      # the 31B's decode at batch 64-256, tiles forced
    python -m g4rt.bench.kernels --out DIR --decode-batch --decode-batch-splits   # ... split counts forced
    python -m g4rt.bench.kernels --out DIR --decode-batch --decode-batch-tiles    # ... smaller sliding CTAs
    python -m g4rt.bench.kernels --out DIR --decode-batch --decode-batch-fma      # ... products on the CUDA cores
    python -m g4rt.bench.kernels --out DIR --decode-batch --decode-batch-pipe     # ... those, key loop pipelined
    python -m g4rt.bench.kernels --out DIR --prefill-only      # 8k prefill chunks and PREFILL_SWEEP
    python -m g4rt.bench.kernels --out DIR --norms [--norm-tokens 8192,2048,256]  # the q/k/v norm kernel's tiles

Measures, in one run: device-to-device copy bandwidth and the bf16 8192^3 matmul rate (the
ceilings), then for Gemma 4's real attention shapes

* decode (split-K) at contexts 1k..256k and batch 1/8/64: correctness against the fp32
  reference on sampled sequences, median time vs the bandwidth roofline (KV bytes the step must
  read / copy bandwidth; for sliding layers only the window counts) and vs torch SDPA (and
  flex_attention where it works) on the same data laid out contiguously;
* the sliding layer's time over growing context with *whole-history* page tables: it must stay flat
  once context > window, which shows out-of-window pages are skipped, not just masked;
* chunked prefill of 8k tokens (full and sliding layer) in TFLOP/s vs the matmul rate;
* small tile-config sweeps, so defaults can be set from numbers.

`--sampler` instead times the token sampler (plugins/triton_sampling.py, `g4rt::sample`) against the
torch sampler it replaced (`OldSampler`, kept here as the baseline) at 262,144 vocabulary entries,
after checking each of its outputs against the torch reference (sampler_cases).

Every case runs in its own try block: a failing shape is recorded with its error and the run goes
on. Results: DIR/results.json (everything) and DIR/results.md (tables). Inputs are random (never
zeros) and page tables are shuffled. Total runtime target: ~5 min on an H200, < 90 s with --quick.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import traceback
import zlib
from dataclasses import dataclass

import torch

from g4rt.models.config import load_config
from g4rt.models.layout import KV_DTYPES, KVLayout, PageGeometry, torch_dtype
from g4rt.models.step import to_device
from g4rt.plugins import reference
from g4rt.plugins import triton_attention as ta
from g4rt.runtime.sampling import BatchSampler, SamplingRows

from .common import ceilings, kernel_kinds, time_ms, time_ms_eager

DTYPE = torch.bfloat16  # of every case's KV arena, queries and activations
SIZES = {"31B": "31b", "26B": "26b-a4b", "E2B": "e2b", "E4B": "e4b"}  # name: published config


def _layer_shapes() -> dict:
    """Each published size's sliding and full layer, by name ("31B-sliding"): (num_q_heads, num_kv_heads,
    head_dim, window W or None, page_size, k_eq_v), read off the KV layout of its config (models/layout.py)
    and the page sizes PageGeometry gives it by default."""
    shapes = {}
    for size, config in SIZES.items():
        layout = KVLayout.from_config(load_config(config), DTYPE)
        pages = PageGeometry.build(layout).page_tokens
        for group in layout.groups:
            layer = layout.layers[group.layers[0]]
            shapes[f"{size}-{group.name}"] = (layer.num_q_heads, group.num_kv_heads, group.head_dim, group.window,
                                             pages[group.name], layer.k_eq_v)
    return shapes


SHAPES = _layer_shapes()
LAYERS = {name: shape[:5] for name, shape in SHAPES.items()}  # name: (q heads, kv heads, head_dim, W, page_size)
DECODE_LAYERS = ("31B-sliding", "26B-sliding", "31B-full")  # the full decode grid's layers
# --decode-short: batch 1 at short context, where one program per KV head is latency-bound; forced split
# counts, which set decode_splits' shortest run (SPLIT_MIN_ELEMS).
SHORT_LAYERS = ("E2B-sliding", "E2B-full", "E4B-sliding", "E4B-full", "31B-sliding", "31B-full")
SHORT_CONTEXTS = {"sliding": (160, 512), "full": (160, 1024)}
SHORT_SPLITS = (1, 2, 4, 8, 16, 32)
# --decode-batch: the 31B's layers at the batches and short context of a serving step, where a program's
# run of keys is a few tiles long, so its start and end weigh against its bytes; decode tiles forced
# (block_n, num_warps, num_stages[, splits[, maxnreg]]): the split decode's tile first, the two-warp unsplit tile among
# the rest. BATCH_SMALL (--decode-batch-tiles): the sliding layer on smaller CTAs (fewer warps, 16-key tiles),
# so more of them share an SM; the one-warp default from WIDE_DECODE programs an SM among them. BATCH_SPLITS
# (--decode-batch-splits): split counts forced over unsplit tiles: shorter programs and a shorter last wave,
# against the combine kernel.
BATCH_SIZES, BATCH_CTX = (64, 128, 256), 200
BATCH_DECODE = {"31B-sliding": ((64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 1), (16, 4, 3), (64, 8, 2), (128, 4, 1),
                                (32, 2, 2), (64, 2, 2)),
                "31B-full": ((32, 4, 2), (16, 4, 2), (16, 4, 3), (32, 4, 1), (64, 4, 1), (32, 8, 2), (16, 2, 3),
                             (32, 2, 2))}
BATCH_SMALL = {"31B-sliding": ((32, 2, 2), (16, 2, 2), (16, 2, 3), (16, 2, 4), (32, 2, 3), (16, 1, 2), (32, 1, 2),
                               (16, 1, 3))}
# BATCH_FMA (--decode-batch-fma): the sliding layer's decode with its group's 2 heads alone as the tile's rows and
# the products on the CUDA cores (the `fma` tile: no MMA's 16-row padding), small CTAs and deeper pipelines, and
# cut in 2 (more programs at batch 64). The full layer's group of 8 took 2-5x its MMA tile's time this way
# (export/results/README.md, session 37), so it is not swept. It also runs below WIDE_DECODE programs an SM
# (FMA_BATCHES 16 and 32: about 2 and 4 programs an SM on the 31B's sliding layer, still unsplit), where the
# default is the two-warp MMA tile.
FMA_BATCHES = (16, 32) + BATCH_SIZES
BATCH_FMA = {"31B-sliding": ((8, 1, 2), (8, 1, 3), (8, 1, 4), (16, 1, 2), (16, 1, 3), (8, 2, 2), (16, 2, 2),
                             (8, 1, 2, 2), (8, 1, 3, 2), (8, 1, 2, None, 128))}
# BATCH_PIPE (--decode-batch-pipe): BATCH_FMA's tiles with their interior loop software-pipelined (`pipe`: the
# K and V tiles read by asynchronous copies num_stages - 1 tiles ahead, where the plain fma tile waits for each
# tile's loads in turn), at the same batches. In both tables a fifth element caps the registers a thread
# (`maxnreg`): 128 keeps 16 one-warp programs an SM where ptxas takes up to 168 for a pipelined 8-key tile (Triton
# 3.6; one-warp 16-key tiles spill hundreds of bytes at it).
BATCH_PIPE = {"31B-sliding": ((8, 1, 2), (8, 1, 3), (8, 1, 4), (8, 1, 2, None, 128), (8, 1, 3, None, 128),
                              (16, 1, 3), (8, 2, 2), (16, 2, 3), (8, 1, 2, 2), (8, 1, 3, 2))}
BATCH_SPLITS = {"31B-sliding": ((32, 2, 2, 1), (32, 2, 2, 2), (32, 2, 2, 3), (32, 4, 2, 2), (64, 4, 2, 2)),
                "31B-full": ((32, 4, 2, 1), (32, 4, 2, 2), (32, 4, 2, 3), (16, 4, 3, 2))}
CONTEXTS = [1024, 4096, 8192, 32768, 131072, 262144]
BATCHES = [1, 8, 64]
MAX_CASE_BYTES = 8 << 30  # KV bytes one case may allocate
# Prefill tiles tried at 8k (--prefill-only): around the defaults, and for head dim 512 the output
# columns cut across 2 or 4 programs (dv_split), which frees the registers and shared memory that
# bound its tiles.
PREFILL_SWEEP = {
    # Triton tiles (wgmma False: the default at head dim 512 is the Gluon kernel, run as the case before the sweep)
    "31B-full": [dict(rows=r, block_n=n, num_warps=w, num_stages=st, dv_split=v, interior=i, tma=False, wgmma=False)
                 for r, n, w, st, v, i in [(64, 32, 8, 1, 1, True), (64, 32, 8, 1, 1, False),
                                           (128, 64, 8, 1, 2, False), (128, 32, 8, 1, 2, True),
                                           (64, 64, 8, 1, 2, True), (128, 64, 8, 1, 4, True),
                                           (64, 32, 4, 2, 2, True), (128, 128, 8, 1, 4, True),
                                           # whole columns (QK^T computed once): 64 rows keep the
                                           # fp32 accumulator within the registers a thread may hold
                                           # (128 at 8 warps, 64 at 16; Q stays in shared memory);
                                           # 2 stages where K/V tiles of 32 keys leave the room
                                           (64, 64, 8, 1, 1, False), (64, 32, 8, 2, 1, False),
                                           (64, 64, 16, 1, 1, False), (64, 32, 16, 2, 1, False),
                                           # the default's tile with twice the warps
                                           (128, 64, 16, 1, 2, False),
                                           # the default's rows and column cut with 32-key tiles, which
                                           # leave room for a second stage (Q 128 KB + 2 x 48 KB)
                                           (128, 32, 8, 2, 2, False), (128, 32, 8, 2, 2, True),
                                           # 16-key tiles: room for 3 and 4 stages
                                           (128, 16, 8, 3, 2, True), (128, 16, 8, 4, 2, True),
                                           # 64 rows: Q 64 KB, room for a third stage
                                           (64, 32, 8, 3, 2, True)]]
                # the interior tiles by tensor-memory copies (kv_descriptors; the default takes them)
                + [dict(rows=r, block_n=n, num_warps=w, num_stages=st, dv_split=v, interior=True, tma=True,
                        wgmma=False)
                   for r, n, w, st, v in [(128, 32, 8, 2, 2), (128, 32, 8, 3, 2), (64, 32, 8, 3, 2),
                                          (64, 32, 4, 3, 2), (64, 32, 8, 2, 1)]],
    "31B-sliding": [dict(rows=r, block_n=n, num_warps=w, num_stages=st, dv_split=v)
                    for r, n, w, st, v in [(128, 32, 8, 3, 1), (128, 64, 4, 2, 1), (64, 64, 4, 3, 1),
                                           (128, 128, 8, 1, 1), (128, 64, 8, 2, 2)]]
                   + [dict(rows=128, block_n=64, num_warps=8, num_stages=2, interior=False)],
}


@dataclass
class Case:
    q: torch.Tensor
    arena: torch.Tensor
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    table: torch.Tensor
    first: torch.Tensor
    hkv: int
    page: int
    wl: int
    k_off: int = 0  # of the layer's K in a frame; its V follows

    def args(self):
        blk = self.page * self.hkv * self.q.shape[2]
        return (self.q, self.arena, self.cu_q, self.kv_lens, self.table, self.first, self.k_off, self.k_off + blk,
                self.page, self.hkv, self.wl, 1.0)


def engine_frame(layer: str, kv_dtype) -> tuple[int, int]:
    """(frame elements, K offset) of `layer` in its model's engine arena (PageGeometry of its config, KV in
    `kv_dtype`): a frame holds a page of every layer of the group, and the layer is the group's middle one."""
    size, group = layer.split("-")
    layout = KVLayout.from_config(load_config(SIZES[size]), kv_dtype)
    geometry = PageGeometry.build(layout)
    owners = getattr(layout, group).layers
    return geometry.frame_elems, geometry.offsets[owners[len(owners) // 2]][0]


def build(batch, ctx, q_len, layer, whole_table=False, seed=0, kv_dtype=DTYPE, frame=None):
    """Random paged case: every sequence at kv_len ctx with q_len new tokens, frames shuffled, the arena in
    `kv_dtype`. Sliding layers get resident-only tables (first_page > 0) unless `whole_table`. A frame holds the
    layer's page alone, unless `frame` = (elements, K offset): then each frame is that large, the layer's page at
    that offset and the rest never written, so the layer's KV lies spread over memory as in an engine's arena (of
    frames `engine_frame`, 13.1 MB for the 31B in bf16)."""
    hq, hkv, d, window, page = LAYERS[layer]
    wl = window - 1 if window else -1
    first = 0
    if wl >= 0 and not whole_table:
        first = max(0, ctx - q_len - wl) // page
    m = math.ceil(ctx / page) - first
    g = torch.Generator(device="cuda").manual_seed(seed)
    frames = torch.randperm(batch * m + 1, device="cuda", generator=g).to(torch.int32)
    kv = torch.randn(batch * m + 1, 2 * page * hkv * d, device="cuda", dtype=DTYPE, generator=g).to(kv_dtype)
    k_off = 0
    if frame is not None:
        frame_elems, k_off = frame
        if k_off < 0 or k_off + kv.shape[1] > frame_elems:
            raise ValueError(f"a frame of {frame_elems} elements has no room for the layer's page of {kv.shape[1]} "
                             f"at offset {k_off} (--frame-kib, --frame-offset-kib)")
        arena = torch.empty(kv.shape[0], frame_elems, device="cuda", dtype=kv.dtype)
        arena[:, k_off:k_off + kv.shape[1]] = kv
        del kv
    else:
        arena = kv
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=DTYPE, generator=g)
    i32 = dict(device="cuda", dtype=torch.int32)
    return Case(q, arena, torch.arange(batch + 1, **i32) * q_len, torch.full((batch,), ctx, **i32),
                frames[:batch * m].view(batch, m).contiguous(), torch.full((batch,), first, **i32), hkv, page, wl,
                k_off)


def visible_keys(ctx, q_len, wl):
    """Sum over the chunk's queries of the keys each sees, and the keys the step must read."""
    total = sum(min(p + 1, wl + 1) if wl >= 0 else p + 1 for p in range(ctx - q_len, ctx))
    read = ctx - (max(0, ctx - q_len - wl) if wl >= 0 else 0)
    return total, read


def rel_err(got, want):
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def reference_rows(case, rows_b):
    """fp32 reference output of sequences `rows_b` (decode), grouped so no head is repeated in memory:
    the 256k full layer would otherwise need tens of GiB."""
    hq, d = case.q.shape[1:]
    g = hq // case.hkv
    outs = []
    for b in rows_b:
        k, v, k_pos = reference.gather_kv(case.arena, case.table[b], int(case.first[b]), int(case.kv_lens[b]),
                                          case.k_off, case.k_off + case.page * case.hkv * d, case.page, case.hkv, d)
        p = int(case.kv_lens[b]) - 1
        keep = k_pos >= p - case.wl if case.wl >= 0 else torch.ones_like(k_pos, dtype=torch.bool)
        k, v = k[keep].float(), v[keep].float()
        qf = case.q[b].float().view(case.hkv, g, d)
        probs = torch.softmax(torch.einsum("hgd,nhd->hgn", qf, k), dim=-1)
        outs.append(torch.einsum("hgn,nhd->hgd", probs, v).reshape(hq, d))
    return torch.stack(outs)


def contiguous_kv(case, n):
    """The last n keys of every sequence as [B, Hkv, n, D] K and V (for SDPA / flex)."""
    hq, d = case.q.shape[1:]
    b, m = case.table.shape
    blk = case.page * case.hkv * d
    frames = case.arena[case.table.long()]  # [B, M, frame]
    start = int(case.kv_lens[0]) - int(case.first[0]) * case.page - n
    out = []
    for lo in (case.k_off, case.k_off + blk):
        x = frames[..., lo:lo + blk].reshape(b, m * case.page, case.hkv, d)[:, start:start + n]
        out.append(x.transpose(1, 2).contiguous())
    del frames
    return out


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def decode_case(layer, batch, ctx, peak, try_flex, flex_fn, config=None, splits=None, sdpa=True, whole=False,
                kv_dtype=DTYPE, frame=None):
    hq, hkv, d, window, page = LAYERS[layer]
    case = build(batch, ctx, 1, layer, whole_table=whole, seed=ctx + batch, kv_dtype=kv_dtype, frame=frame)
    _, read = visible_keys(ctx, 1, case.wl)
    kv_bytes = batch * read * hkv * d * 2 * case.arena.element_size()  # K and V
    io_bytes = kv_bytes + 2 * case.q.numel() * case.q.element_size()  # q in, the output out
    rec = {"layer": layer, "batch": batch, "ctx": ctx, "page_size": page, "whole_table": whole,
           "kv_dtype": str(case.arena.dtype).removeprefix("torch."), "kv_bytes_read": kv_bytes, "config": config,
           "frame_elems": case.arena.shape[1]}
    if splits is None:
        max_keys = case.table.shape[1] * page if case.wl < 0 else min(case.table.shape[1] * page, case.wl + 1)
        splits = ta.decode_splits(batch, hkv, max_keys, d, case.q.device)
    rec["splits"] = splits
    run = lambda: ta.paged_attention(*case.args(), num_splits=splits, config=config)  # noqa: E731
    out = run()
    sample = [0, batch - 1] if batch > 1 else [0]
    rec["rel_err"] = rel_err(out[sample], reference_rows(case, sample))
    rec["finite"] = bool(torch.isfinite(out).all())
    t = time_ms(run)
    rec["us_eager"] = time_ms_eager(run) * 1e3  # what an uncaptured eager step pays (host launch cost)
    rec.update(us=t * 1e3, roofline_us=io_bytes / (peak["copy_GBps"] * 1e9) * 1e6,
               GBps=io_bytes / (t * 1e-3) / 1e9)
    rec["frac_of_copy_bw"] = rec["GBps"] / peak["copy_GBps"]
    if sdpa:
        try:
            k, v = contiguous_kv(case, read)
            q4 = case.q.view(batch, hq, 1, d)
            f = torch.nn.functional.scaled_dot_product_attention
            ref = f(q4, k, v, scale=1.0, enable_gqa=True)
            rec["sdpa_rel_diff"] = rel_err(out.view(batch, hq, 1, d), ref)
            rec["sdpa_us"] = time_ms(lambda: f(q4, k, v, scale=1.0, enable_gqa=True)) * 1e3
            if try_flex and flex_fn is not None:
                try:
                    flex_fn(q4, k, v, scale=1.0, enable_gqa=True)
                    rec["flex_us"] = time_ms(lambda: flex_fn(q4, k, v, scale=1.0, enable_gqa=True)) * 1e3
                except Exception as e:  # noqa: BLE001
                    rec["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            del k, v
        except Exception as e:  # noqa: BLE001
            rec["sdpa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del case
    torch.cuda.empty_cache()
    return rec


def prefill_case(layer, q_len, ctx, peak, config=None, check=True):
    hq, hkv, d, window, page = LAYERS[layer]
    case = build(1, ctx, q_len, layer, seed=q_len + ctx)
    flops_keys, _ = visible_keys(ctx, q_len, case.wl)
    flops = 4 * flops_keys * hq * d
    run = lambda: ta.paged_attention(*case.args(), config=config)  # noqa: E731
    out = run()
    rec = {"layer": layer, "q_len": q_len, "ctx": ctx, "page_size": page, "config": config,
           "finite": bool(torch.isfinite(out).all())}
    if check:  # first and last 128 queries of the chunk, through the reference op itself
        a = list(case.args())
        errs = []
        for lo, hi in ((0, 128), (q_len - 128, q_len)):
            a[0] = case.q[lo:hi]
            a[2] = torch.tensor([0, hi - lo], device="cuda", dtype=torch.int32)
            a[3] = case.kv_lens - (q_len - hi)
            errs.append(rel_err(out[lo:hi], reference.paged_attention_ref(*a)))
        rec["rel_err"] = max(errs)
    t = time_ms(run)
    rec.update(ms=t, TFLOPs=flops / (t * 1e-3) / 1e12)
    rec["frac_of_matmul"] = rec["TFLOPs"] / peak["matmul_TFLOPs"]
    del case
    torch.cuda.empty_cache()
    return rec


class OldSampler:
    """The torch sampler `g4rt::sample` replaced (runtime/sampling.py before issue 12's kernel), kept as
    the speed baseline: per-(seed, counter, id) noise from a 32-bit integer hash in eager int64 torch ops
    over [rows, vocab], `torch.topk` per top-k width group, a full sort for top-p."""

    M32 = 0xFFFFFFFF

    @classmethod
    def _mix32(cls, x):
        x = x ^ (x >> 16)
        x = (x * 0x21F0AAAD) & cls.M32
        x = x ^ (x >> 15)
        x = (x * 0x735A2D97) & cls.M32
        return x ^ (x >> 15)

    @classmethod
    def gumbel(cls, seeds, counters, index):
        k = cls._mix32(seeds & cls.M32)
        k = cls._mix32(k ^ ((seeds >> 32) & cls.M32))
        k = cls._mix32(k ^ (counters & cls.M32))
        k = cls._mix32(k ^ ((counters >> 32) & cls.M32))
        mult, offset = k | 1, cls._mix32(k ^ 0x5BD1E995)
        idx = index if index.dim() == 2 else index[None, :]
        x = cls._mix32((idx * mult[:, None] + offset[:, None]) & cls.M32)
        u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        return -torch.log(-torch.log(u))

    @classmethod
    def _race(cls, scores, ids, top_p, seeds, counters):
        if bool((top_p < 1.0).any()):
            probs = torch.softmax(scores.double(), dim=-1)
            sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= top_p[:, None]
            scores = scores.masked_fill(torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted), float("-inf"))
        vocab_ids = ids if ids is not None else torch.arange(scores.shape[1], device=scores.device)[None, :]
        z = scores + cls.gumbel(seeds, counters, vocab_ids)
        best = z.max(dim=-1, keepdim=True).values
        return torch.where(z == best, vocab_ids, torch.iinfo(torch.int64).max).min(dim=-1).values

    def __call__(self, logits, rows: SamplingRows):
        out = logits.argmax(dim=-1)
        host = rows.pack
        temp, k = host[0].view(torch.float64), host[2]
        sampled = temp > 0.0
        if not bool(sampled.any()):
            return out
        vocab = logits.shape[1]
        pow2 = torch.where(k > 1, torch.ones_like(k) << torch.ceil(torch.log2(k.clamp(min=1).double())).long(), k)
        width = torch.where((k > 0) & (k < vocab), pow2.clamp(max=vocab), 0)
        pack = to_device(host, logits.device)
        floats = pack[:2].view(torch.float64)
        for w in torch.unique(width[sampled]).tolist():
            sel = torch.nonzero(sampled & (width == w)).flatten().to(logits.device)
            t, top_p = floats[0, sel].float(), floats[1, sel]
            top_k, seeds, counters = pack[2, sel], pack[3, sel], pack[4, sel]
            scores = logits.index_select(0, sel).float() / t[:, None]
            if w == 0:
                chosen = self._race(scores, None, top_p, seeds, counters)
            else:
                vals, ids = torch.topk(scores, w, dim=-1, sorted=True)
                kth = vals.gather(1, (top_k - 1)[:, None])
                chosen = self._race(vals.masked_fill(vals < kth, float("-inf")), ids, top_p, seeds, counters)
            out.index_copy_(0, sel, chosen)
        return out


# top_k_1000: more gathered entries than the row's program takes in registers (triton_sampling.CANDIDATES), so it
# cuts its gathered list in memory; top_k_4000: k beyond the pivot's groups (PIVOT_GROUPS), so each row lists its
# own entries in its own program (two histogram passes and a listing pass over its row), then cuts that list.
SAMPLER_KINDS = {"greedy": (0.0, 0, 1.0), "temperature": (1.0, 0, 1.0), "top_k_50": (1.0, 50, 1.0),
                 "top_p_0.9": (1.0, 0, 0.9), "top_k_50_top_p_0.9": (1.0, 50, 0.9), "top_k_1000": (1.0, 1000, 1.0),
                 "top_k_1000_top_p_0.9": (1.0, 1000, 0.9), "top_k_4000": (1.0, 4000, 1.0)}


SAMPLER_TILES = [(1024, 8), (1024, 4), (4096, 8), (2048, 16)]  # (block, num_warps) besides the default (2048, 8)


# --norms: the q/k/v norm + RoPE kernel (plugins/triton_norm.py) on a step of T tokens of these layers'
# heads (q, kv, head dim, k_eq_v), each (tokens per program, warps) tile; (1, 1) is the decode tile.
NORM_LAYERS = {name: (*SHAPES[name][:3], SHAPES[name][5]) for name in ("31B-sliding", "31B-full", "E2B-sliding")}
NORM_TILES = [(1, 1), (1, 2), (2, 2), (4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8)]
NORM_TOKENS = (8192, 2048, 256)  # the step sizes --norms times unless --norm-tokens says others


def norm_cases(peak: dict, tokens=NORM_TOKENS) -> list[dict]:
    """Per layer and step size, each tile of `NORM_TILES` timed as a
    CUDA-graph replay with a cold L2, against the copy bandwidth over the bytes it must move (packed
    q/k/v in, q, k, v out, cos/sin). Each record says whether the tile's outputs equal the default
    tile's bit for bit (the order of a row's sum depends on the tile) and their largest difference from
    the eager torch reference (`max_abs_err_vs_torch`; the outputs are O(1))."""
    from g4rt.models import blocks
    from g4rt.models.model import rope_cos_sin
    from g4rt.plugins import triton_norm as tn

    out = []
    for name, (hq, hkv, d, kv) in NORM_LAYERS.items():
        for t in tokens:
            g = torch.Generator(device="cuda").manual_seed(t + d)
            width = (hq + hkv * (1 if kv else 2)) * d
            x = torch.randn(t, width, device="cuda", generator=g).to(DTYPE)
            qw, kw = [(0.5 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(DTYPE) for _ in range(2)]
            cos, sin = rope_cos_sin(1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)),
                                    torch.randint(0, 8192, (t,), device="cuda", generator=g), DTYPE)
            args = (x, qw, kw, 1e-6, cos, sin, hq, hkv, kv)
            want = blocks.qkv_norm_rope(*args)  # the eager torch reference
            default = tn.qkv_norm_rope(*args)
            assert all(torch.isfinite(o).all() for o in default)
            moved = x.element_size() * (x.numel() + sum(o.numel() for o in default) + 2 * cos.numel())
            default_tile = tn.norm_rope_tile(t, d, hq + 2 * hkv)
            for bt, w in [default_tile] + [tl_ for tl_ in NORM_TILES if tl_ != default_tile]:
                got = tn.qkv_norm_rope(*args, tile=(bt, w))
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                same = all(torch.equal(a, b) for a, b in zip(got, default))
                ms = time_ms(lambda: tn.qkv_norm_rope(*args, tile=(bt, w)))
                rec = {"layer": name, "tokens": t, "tile": [bt, w], "default": (bt, w) == default_tile,
                       "same_as_default": same, "max_abs_err_vs_torch": err, "us": round(ms * 1e3, 2),
                       "GBps": round(moved / ms / 1e6, 1), "of_copy_bw": round(moved / ms / 1e6 / peak["copy_GBps"], 3)}
                out.append(rec)
                print("norms", rec, flush=True)
    return out


def _events_ms(fn, calls: int) -> float:
    """Mean GPU ms per call of `calls` back-to-back calls (after two warm-up calls), by CUDA events: what
    a step pays, host launch cost included where the GPU waits for it."""
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _kernels_ms(fn, calls: int) -> list:
    """GPU ms per call of each kernel `fn` launches ([name, ms], longest first): `calls` calls under the
    profiler after a warm-up call, so a change in the whole can be traced to the launch that made it."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [[name, round(ms / calls, 4)] for name, ms in kernel_kinds(prof)["top"]]


def sampler_cases(vocab: int = 262144, row_counts=(1, 64, 256), reps: int = 3, calls: int = 10,
                  tiles: bool = False) -> list[dict]:
    """Old (OldSampler) vs new (`g4rt::sample`'s Triton kernel) per row count and kind of row settings.

    Before timing, per case: fresh random logits (N(0, 4^2), never zeros) and a poisoned output (-7);
    the kernel's tokens must be in range and are compared with the torch reference (`sample_ref`, the
    oracle; `mismatches` counts rows that differ, expected 0 up to the GPU's approximate exp/log), the
    old sampler's greedy rows with the argmax; `correct`: the kernel's tokens all in range, at most 1 % of
    rows differ, and for greedy rows the old sampler's ids are the argmax. `old_in_range` says whether the
    old sampler's tokens are in range (its top-p path can return 2**63 - 1:
    export/results/cpu_old_sampler_top_p.txt).
    Then the arms alternate `reps` times, each timed over `calls` calls (`_events_ms`; both through
    their sampler's call, the settings' host-to-device copy included); the new kernel also alone as a
    CUDA-graph replay (`graph_ms`, no host cost) with each of its kernels' GPU ms (`kernels_ms`), and at
    the smallest and largest row count for other tiles with `tiles` (`SAMPLER_TILES`: same tokens, graph ms), so
    defaults can follow numbers. (Each tile compiles every kernel again: on a GPU's cold cache most of a process's
    first two minutes.)"""
    from g4rt.plugins import triton_sampling as ts

    old, new_sampler = OldSampler(), BatchSampler("triton")
    records = []
    for rows in row_counts:
        for kind, (t, k, p) in SAMPLER_KINDS.items():
            rec = {"rows": rows, "vocab": vocab, "kind": kind}
            # seeded by the case itself, so cases added to SAMPLER_KINDS leave the others' logits as they were
            g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{rows} {kind}".encode()))
            logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
            settings = SamplingRows([t] * rows, [k] * rows, [p] * rows, [1000 + i for i in range(rows)], [3] * rows)
            pack = settings.pack.cuda()
            hints = dict(nucleus=settings.nucleus, top_k=settings.top_k)  # as BatchSampler passes them
            out = torch.full((rows,), -7, dtype=torch.int64, device="cuda")
            new = ts.sample(logits, pack, out=out)
            want = reference.sample_ref(logits, pack)
            got_old = old(logits, settings)
            rec["in_range"], rec["old_in_range"] = (bool(((ids >= 0) & (ids < vocab)).all()) for ids in (new, got_old))
            rec["mismatches"] = int((new != want).sum())
            if t == 0.0:
                rec["old_greedy_exact"] = bool(torch.equal(got_old, logits.argmax(-1)))
            rec["distinct_tokens"] = len(set(new.tolist()))
            rec["correct"] = rec["in_range"] and rec["mismatches"] <= rows // 100 and rec.get("old_greedy_exact", True)
            times = {"old_ms": [], "new_ms": []}
            for _ in range(reps):
                times["old_ms"].append(_events_ms(lambda: old(logits, settings), calls))
                times["new_ms"].append(_events_ms(lambda: new_sampler(logits, settings), calls))
            for name, ts_ in times.items():
                rec[name] = [round(min(ts_), 4), round(statistics.median(ts_), 4), round(max(ts_), 4)]
            rec["graph_ms"] = round(time_ms(lambda: ts.sample(logits, pack, out=out, **hints)), 4)
            rec["kernels_ms"] = _kernels_ms(lambda: ts.sample(logits, pack, out=out, **hints), calls)
            if tiles and rows in (min(row_counts), max(row_counts)) and t > 0.0:  # other tiles, each checked first
                rec["tiles"] = []
                for block, warps in SAMPLER_TILES:
                    out.fill_(-7)
                    same = torch.equal(ts.sample(logits, pack, block=block, num_warps=warps, out=out), new)
                    ms = time_ms(lambda: ts.sample(logits, pack, block=block, num_warps=warps, out=out))
                    rec["tiles"].append({"block": block, "num_warps": warps, "same_tokens": same,
                                         "graph_ms": round(ms, 4)})
            rec["speedup_median"] = round(rec["old_ms"][1] / rec["new_ms"][1], 1)
            records.append(rec)
            print("sampler", rec, flush=True)
            torch.cuda.empty_cache()
    return records


def guarded(results, key, fn, *a, **kw):
    t0 = time.time()
    try:
        rec = fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - one failing shape must not end the run
        rec = {"args": repr(a)[:200], "kw": repr(kw)[:200], "error": f"{type(e).__name__}: {str(e)[:400]}",
               "trace": traceback.format_exc()[-1500:]}
        torch.cuda.empty_cache()
    rec["wall_s"] = round(time.time() - t0, 2)
    results.setdefault(key, []).append(rec)
    print(key, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if k != "trace"},
          flush=True)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="reduced grid, < 90 s")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the 8k prefill chunks: defaults and the tile sweep (PREFILL_SWEEP), checked")
    ap.add_argument("--layers", default="31B-full,31B-sliding", help="the layers --prefill-only runs")
    ap.add_argument("--configs", help="a JSON list of tile configs --prefill-only runs after each layer's default, "
                                      "in place of PREFILL_SWEEP, e.g. '[{\"wgmma\": false}]' (the Triton kernel)")
    ap.add_argument("--decode-short", action="store_true",
                    help=f"only batch-1 decode of {', '.join(SHORT_LAYERS)} at short context, split counts "
                         f"forced to {SHORT_SPLITS} (what decode_splits' shortest run should be)")
    ap.add_argument("--decode-batch", action="store_true",
                    help="only decode of the 31B's layers at batch 64/128/256 and context 200, decode tiles forced "
                         "(BATCH_DECODE)")
    ap.add_argument("--decode-batch-splits", action="store_true",
                    help="with --decode-batch: split counts forced over the unsplit tiles (BATCH_SPLITS) instead")
    ap.add_argument("--decode-batch-tiles", action="store_true",
                    help="with --decode-batch: the sliding layer on smaller CTAs (BATCH_SMALL) instead")
    ap.add_argument("--decode-batch-fma", action="store_true",
                    help="with --decode-batch: the tiles of the decode on the CUDA cores (BATCH_FMA) instead")
    ap.add_argument("--decode-batch-pipe", action="store_true",
                    help="with --decode-batch: the CUDA-core tiles with a software-pipelined key loop (BATCH_PIPE)")
    ap.add_argument("--decode-batches",
                    help="with --decode-batch: the batch sizes timed, comma-separated (default "
                         f"{','.join(map(str, FMA_BATCHES))} for the CUDA-core tiles, else "
                         f"{','.join(map(str, BATCH_SIZES))})")
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bfloat16",
                    help="with --decode-batch: the arena's dtype (float8_e4m3fn: the one-byte arena)")
    ap.add_argument("--frame-kib", default="",
                    help="with --decode-batch: each frame of the arena this many KiB, the layer's page in it at "
                         "--frame-offset-kib, or `engine`: the engine's frames, the page at its group's middle layer's "
                         "offset (build's `frame`: the KV spread over memory as in a step); default: the page alone")
    ap.add_argument("--frame-offset-kib", type=int, default=0, help="with --frame-kib N: the page's offset in a frame")
    ap.add_argument("--norms", action="store_true", help="only the q/k/v norm kernel's tiles (norm_cases)")
    ap.add_argument("--norm-tokens", default=",".join(map(str, NORM_TOKENS)),
                    help="step sizes in tokens --norms times, comma-separated")
    ap.add_argument("--sampler", action="store_true", help="only the token sampler, old vs new (sampler_cases)")
    ap.add_argument("--sampler-rows", default="1,64,256", help="row counts --sampler times")
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions of each --sampler arm")
    ap.add_argument("--sampler-tiles", action="store_true",
                    help="with --sampler: also the kernels on other tiles (SAMPLER_TILES), at the smallest and largest "
                         "row count (each tile compiles every kernel again)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: it times the compiled kernels (on a CPU the interpreter checks them: `make test`)")
    os.makedirs(args.out, exist_ok=True)
    if args.sampler:
        t_start = time.time()
        res = {"env": {"torch": torch.__version__, "device": torch.cuda.get_device_name()},
               "sampler": sampler_cases(row_counts=[int(r) for r in args.sampler_rows.split(",") if r], reps=args.reps,
                                        tiles=args.sampler_tiles)}
        res["total_s"] = round(time.time() - t_start, 1)
        with open(os.path.join(args.out, "sampler.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"wrote {args.out}/sampler.json in {res['total_s']} s", flush=True)
        return
    import triton
    res = {"env": {"torch": torch.__version__, "triton": triton.__version__,
                   "device": torch.cuda.get_device_name(), "quick": args.quick,
                   "page_sizes": {k: v[4] for k, v in LAYERS.items()}}}
    t_start = time.time()
    peak = ceilings(args.quick)
    res["ceilings"] = peak
    print("ceilings", peak, flush=True)
    if args.norms:
        res["norms"] = norm_cases(peak, tokens=[int(t) for t in args.norm_tokens.split(",") if t])
        return _write(res, args.out, t_start)
    if args.prefill_only:
        for layer in args.layers.split(","):
            guarded(res, "prefill", prefill_case, layer, 8192, 8192, peak)
            for cfg in (json.loads(args.configs) if args.configs else PREFILL_SWEEP[layer]):
                guarded(res, "prefill_sweep", prefill_case, layer, 8192, 8192, peak, config=cfg)
        return _write(res, args.out, t_start)
    if args.decode_short:
        for layer in SHORT_LAYERS:
            for ctx in SHORT_CONTEXTS["sliding" if LAYERS[layer][3] else "full"]:
                for s in SHORT_SPLITS:
                    guarded(res, "decode_sweep", decode_case, layer, 1, ctx, peak, try_flex=False, flex_fn=None,
                            splits=s, sdpa=s == 1)
        return _write(res, args.out, t_start)
    if args.decode_batch:
        fma = args.decode_batch_fma or args.decode_batch_pipe
        table = (BATCH_SPLITS if args.decode_batch_splits else BATCH_SMALL if args.decode_batch_tiles
                 else BATCH_PIPE if args.decode_batch_pipe else BATCH_FMA if fma else BATCH_DECODE)
        rows = dict(rows=1, fma=True, pipe=args.decode_batch_pipe) if fma else dict(rows=16)
        batches = ([int(b) for b in args.decode_batches.split(",") if b] if args.decode_batches
                   else FMA_BATCHES if fma else BATCH_SIZES)
        kv_dtype = torch_dtype(args.kv_dtype, kv=True)

        def frames(layer):
            if args.frame_kib == "engine":
                return engine_frame(layer, kv_dtype)
            kib = 1024 // kv_dtype.itemsize  # elements a KiB
            return (int(args.frame_kib) * kib, args.frame_offset_kib * kib) if args.frame_kib else None
        for layer, tiles in table.items():
            frame = frames(layer)  # the engine's reads the model's config: once a layer
            for b in batches:
                for n, w, st, splits, regs in ((*t, None, None)[:5] for t in tiles):
                    guarded(res, "decode_sweep", decode_case, layer, b, BATCH_CTX, peak, try_flex=False,
                            flex_fn=None, config=dict(**rows, block_n=n, num_warps=w, num_stages=st, maxnreg=regs),
                            splits=splits, sdpa=False, kv_dtype=kv_dtype, frame=frame)
        return _write(res, args.out, t_start)
    try:
        flex_fn = _flex()
    except Exception as e:  # noqa: BLE001
        flex_fn, res["env"]["flex_error"] = None, repr(e)[:300]

    contexts = [1024, 8192, 131072] if args.quick else CONTEXTS
    batches = [1, 64] if args.quick else BATCHES
    for layer in DECODE_LAYERS:
        hq, hkv, d, window, page = LAYERS[layer]
        for ctx in contexts:
            for b in batches:
                keys = min(ctx, window) if window else ctx
                if b * keys * hkv * d * 2 * DTYPE.itemsize > MAX_CASE_BYTES:  # K and V the arena holds
                    continue
                guarded(res, "decode", decode_case, layer, b, ctx, peak,
                        try_flex=(ctx == 8192 and not args.quick), flex_fn=flex_fn)

    # Flatness: whole-history tables for a sliding layer; time must not grow past the window.
    flat_ctx = [1024, 4096, 32768] if args.quick else [1024, 2048, 4096, 16384, 65536, 262144]
    for ctx in flat_ctx:
        guarded(res, "sliding_flat", decode_case, "31B-sliding", 1, ctx, peak, try_flex=False, flex_fn=None,
                sdpa=False, whole=True)
    ok = [r for r in res["sliding_flat"] if "us" in r]
    if len(ok) >= 2:
        base = [r["us"] for r in ok if r["ctx"] >= 2048] or [ok[0]["us"]]
        res["sliding_flat_ratio"] = max(r["us"] for r in ok) / min(base)

    # Chunked prefill of 8k tokens: from scratch (kv 8k) and after 24k of history (kv 32k).
    pre = [("31B-full", 8192, 8192), ("31B-sliding", 8192, 8192)]
    if not args.quick:
        pre += [("31B-full", 8192, 32768), ("31B-sliding", 8192, 32768)]
    for layer, q_len, ctx in pre:
        guarded(res, "prefill", prefill_case, layer, q_len, ctx, peak)

    # Tile sweeps (the defaults in triton_attention.default_config should follow these numbers).
    pre_cfgs = [dict(rows=r, block_n=n, num_warps=w, num_stages=s)
                for r, n, w, s in [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2),
                                   (64, 32, 8, 1), (64, 64, 8, 2), (128, 32, 8, 1), (64, 16, 4, 3)]]
    dec_cfgs = [dict(rows=16, block_n=n, num_warps=w, num_stages=s)
                for n, w, s in [(16, 4, 2), (32, 4, 2), (64, 4, 2), (32, 8, 3), (64, 8, 3), (128, 8, 2)]]
    if args.quick:
        pre_cfgs, dec_cfgs = pre_cfgs[:3], dec_cfgs[1:4]
    for layer in ("31B-full", "31B-sliding"):
        for cfg in pre_cfgs:
            guarded(res, "prefill_sweep", prefill_case, layer, 8192, 8192, peak, config=cfg, check=False)
    for layer, b, ctx in [("31B-full", 1, 131072), ("31B-full", 8, 32768), ("31B-sliding", 64, 8192)]:
        for cfg in dec_cfgs:
            guarded(res, "decode_sweep", decode_case, layer, b, ctx, peak, try_flex=False, flex_fn=None,
                    config=cfg, sdpa=False)
        if not args.quick:
            for f in (0.5, 2.0):
                keys = ctx if "full" in layer else 1024
                s = max(1, int(ta.decode_splits(b, LAYERS[layer][1], keys, LAYERS[layer][2], torch.device("cuda")) * f))
                guarded(res, "decode_sweep", decode_case, layer, b, ctx, peak, try_flex=False, flex_fn=None,
                        splits=s, sdpa=False)
    return _write(res, args.out, t_start)


def _write(res, out, t_start):
    res["total_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(markdown(res))
    print(f"wrote {out}/results.json and results.md in {res['total_s']} s", flush=True)


def _f(x, nd=1):
    return "" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(res) -> str:
    c = res["ceilings"]
    out = [f"# paged attention on {res['env']['device']}", "",
           f"torch {res['env']['torch']}, triton {res['env']['triton']}, quick={res['env']['quick']}, "
           f"page sizes {res['env']['page_sizes']}", "",
           f"Ceilings (same run): copy {c['copy_GBps']:.0f} GB/s (read+write), bf16 matmul 8192^3 "
           f"{c['matmul_TFLOPs']:.0f} TFLOP/s.", "",
           "## Decode (split-K), bf16", "",
           "Times: CUDA-graph replay with a cold L2 (eager column: do_bench, includes host launch cost).", "",
           "| layer | B | ctx | splits | KV MiB read | ours us | ours eager us | roofline us | % copy BW | SDPA us | flex us | rel err |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("decode", []):
        if "error" in r:
            out.append(f"| error | | | | | | | | | | | {r['error'][:80]} |")
            continue
        out.append(f"| {r['layer']} | {r['batch']} | {r['ctx']} | {r['splits']} | {r['kv_bytes_read'] / 2**20:.1f} | "
                   f"{_f(r['us'])} | {_f(r.get('us_eager'))} | {_f(r['roofline_us'])} | {100 * r['frac_of_copy_bw']:.0f} | "
                   f"{_f(r.get('sdpa_us')) or r.get('sdpa_error', '')[:30]} | "
                   f"{_f(r.get('flex_us')) or r.get('flex_error', '')[:30]} | {r['rel_err']:.1e} |")
    out += ["", "## Sliding layer, whole-history tables (time must stay flat past the window)", "",
            "| ctx | us | KV MiB read | rel err |", "|---|---|---|---|"]
    for r in res.get("sliding_flat", []):
        out.append(f"| {r.get('ctx', 'error')} | {_f(r.get('us'))} | "
                   f"{_f(r.get('kv_bytes_read', 0) / 2**20)} | {r.get('rel_err', r.get('error', ''))} |")
    out += ["", f"max/min time ratio (ctx >= 2048): {_f(res.get('sliding_flat_ratio'), 2)}", "",
            "## Prefill chunk (one sequence), bf16", "",
            "| layer | q_len | kv_len | config | ms | TFLOP/s | % matmul | rel err |", "|---|---|---|---|---|---|---|---|"]
    for key in ("prefill", "prefill_sweep"):
        for r in res.get(key, []):
            if "error" in r:
                out.append(f"| error | | | {r.get('kw', '')[:60]} | | | | {r['error'][:80]} |")
                continue
            out.append(f"| {r['layer']} | {r['q_len']} | {r['ctx']} | {r['config'] or 'default'} | {_f(r['ms'], 2)} | "
                       f"{_f(r['TFLOPs'])} | {100 * r['frac_of_matmul']:.0f} | {_f(r.get('rel_err'), 4)} |")
    out += ["", "## Decode sweeps", "", "| layer | B | ctx | config | splits | us | % copy BW |", "|---|---|---|---|---|---|---|"]
    for r in res.get("decode_sweep", []):
        if "error" in r:
            out.append(f"| error | | | {r.get('kw', '')[:60]} | | | {r['error'][:80]} |")
            continue
        out.append(f"| {r['layer']} | {r['batch']} | {r['ctx']} | {r['config'] or 'default'} | {r['splits']} | "
                   f"{_f(r['us'])} | {100 * r['frac_of_copy_bw']:.0f} |")
    out.append(f"\nTotal {res.get('total_s')} s.\n")
    return "\n".join(out)


if __name__ == "__main__":
    main()
