"""The inductor engine on the H200: tokens against the eager paged engine, decode speed against the
bandwidth roofline measured in the same run, and Hugging Face transformers on the same weights.

    python -m g4rt.bench.engine --config 31b --out DIR [--batches 1,8] [--new-tokens 64]
                                 [--runtime-checks] [--long-context 262144] [--profile] [--matmuls]
                                 [--decode-steps 1,64,128,256] [--ttft 2048,8192] [--sampler] [--staggered]

One process builds the model once (random bf16 weights drawn on the GPU) and runs, in order:
ceilings (copy bandwidth), eager engine, inductor engine (torch.compile + CUDA-graph decode),
HF `Gemma4ForCausalLM` (sdpa, its own DynamicCache) with the same weights; then, if asked, the
runtime's checks (bench/runtime.py: paged vs linear tokens, one long request against the plan).
Each stage appends one JSON line to DIR/export_bench.jsonl as it finishes, so a run cut short by a
time limit still reports what it did.

Roofline of a decode step (`roofline`): the bytes the step must read -- every weight once (the tied
embedding whole, as the lm_head), but of the per-layer-input table (E2B/E4B) only the looked-up rows,
plus every attending layer's KV at the context (a sliding layer its window) -- at the copy bandwidth
measured at the start of the same run. Every record carries that bandwidth and the bf16 matmul rate.

Throughput stages (`--decode-steps`, `--ttft`, `--sampler`) share one inductor engine:
* decode steps: B requests decoding together, host wall per `LLM.step()` against the replay of the
  CUDA graph it runs, the overlapped step loop and one-step-at-a-time alternated on the same requests;
* time to first token per prefill chunk size, arms alternated, against the bf16 compute floor (and,
  without --skip-hf, HF's on the same prompt, in the HF stage);
* the sampler's cost at 256 rows of the full vocabulary, old vs new (bench/kernels.py sampler_cases).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from g4rt.models.checkpoint import random_model
from g4rt.models.config import load_config
from g4rt.models.layout import KV_DTYPES, PageGeometry
from g4rt.models.paged import PagedStep
from g4rt.plugins.buckets import pow2_bucket
from g4rt.runtime.admission import promise_for
from g4rt.runtime.engines.inductor import ArenaStep, InductorEngine
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

from . import runtime as rb
from .common import (ceilings, compile_health, first_differences, kernel_kinds, log_json, prefer_shared_carveout,
                     sync, time_to_first_token)


def weight_bytes_per_step(model, batch: int = 1) -> int:
    """Weight bytes a decode step of `batch` sequences reads: every parameter once (the tied embedding
    whole, as the lm_head), but of the per-layer-input table only the `batch` looked-up rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ple = getattr(model, "embed_tokens_per_layer", None)
    if ple is not None:
        rows, row_bytes = ple.weight.shape[0], ple.weight.shape[1] * ple.weight.element_size()
        total -= (rows - min(batch, rows)) * row_bytes
    return total


def _one_expert(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's first expert of a mixture-of-experts model: its gate/up rows and its down."""
    experts = model.layers[0].experts
    return experts.gate_up_proj[0], experts.down_proj[0]


def expert_bytes(model) -> int:
    """Bytes of one expert of one layer of a mixture-of-experts model, as its tensors hold them."""
    return sum(t.numel() * t.element_size() for t in _one_expert(model))


def active_weight_bytes(model, distinct: list[float], batch: int = 1) -> int:
    """A mixture-of-experts decode step's weight bytes: `weight_bytes_per_step`, but of layer i's experts
    only the `distinct[i]` its router chose at that batch (bench/moe.py counts them), not all E."""
    unread = sum(model.config.num_experts - d for d in distinct)
    return weight_bytes_per_step(model, batch) - round(unread * expert_bytes(model))


def uniform_routing(model, batch: int) -> tuple[list[float], float]:
    """A mixture-of-experts model's decode step of `batch` tokens as if each router picked its top_k of E
    experts uniformly: the distinct experts each layer reads, E (1 - (1 - top_k / E)^batch), and the matmul
    parameters a token takes part in (`matmul_params` less the experts it does not run). A dense model:
    no layers, `matmul_params`. bench/moe.py counts the routers' real picks instead (`ExpertCensus`)."""
    cfg = model.config
    if not cfg.enable_moe_block:
        return [], float(matmul_params(model))
    E, k = cfg.num_experts, cfg.top_k_experts
    distinct = [E * (1 - (1 - k / E) ** batch)] * cfg.num_hidden_layers
    per_expert = sum(t.numel() for t in _one_expert(model))
    return distinct, float(matmul_params(model) - (E - k) * per_expert * cfg.num_hidden_layers)


def kv_bytes_per_step(model, batch: int, context: int) -> int:
    """KV bytes a decode step reads at `context` positions: every attending layer reads its cache (a
    KV-shared layer its source's, again), a sliding layer only its window."""
    layout = model.layout
    per_seq = 0
    for layer in layout.layers:
        group = layout.sliding if layer.sliding else layout.full
        per_seq += group.bytes_per_token_per_layer * (min(context, layer.window) if layer.sliding else context)
    return batch * per_seq


def matmul_params(model) -> int:
    """Weights that take part in a matmul per token: every matrix but the embedding lookups, plus the
    tied embedding once as the lm_head."""
    lookups = [model.embed_tokens.weight]
    if getattr(model, "embed_tokens_per_layer", None) is not None:
        lookups.append(model.embed_tokens_per_layer.weight)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    return matrices - sum(w.numel() for w in lookups) + model.embed_tokens.weight.numel()


def attention_flops(model, query_positions) -> float:
    """QK^T and PV FLOPs of queries at `query_positions` (each sees itself and what precedes it; a
    sliding layer at most its window)."""
    total = 0.0
    for layer in model.layout.layers:
        keys = sum(min(p + 1, layer.window) if layer.sliding else p + 1 for p in query_positions)
        total += 4.0 * keys * layer.head_dim * layer.num_q_heads
    return total


def roofline(model, batch: int, context: int, ceil: dict) -> dict:
    """What bounds a decode step of `batch` sequences at `context` positions, with the ceilings it was
    measured against: the bytes it must read over the copy bandwidth (`roofline_*`); its FLOPs over the
    bf16 matmul rate (`flop_floor_ms`, which passes the byte time at large batches); and `serial_*`, the
    matmuls at the slower of their weight bytes and FLOPs plus the attention at the slower of its KV
    bytes and FLOPs: the bound of a step that runs the two one after the other, as ours does (at batch
    256 on the 31B the matmuls are compute-bound while the attention reads tens of GB). A mixture-of-experts
    model's experts count as `uniform_routing` reads and runs them."""
    distinct, params = uniform_routing(model, batch)
    w = active_weight_bytes(model, distinct, batch) if distinct else weight_bytes_per_step(model, batch)
    kv = kv_bytes_per_step(model, batch, context)
    bw, peak = ceil["copy_GBps"] * 1e9, ceil["matmul_TFLOPs"] * 1e12
    mm_flops, at_flops = 2.0 * params * batch, batch * attention_flops(model, [context - 1])
    ms = (w + kv) / bw * 1e3
    serial = (max(w / bw, mm_flops / peak) + max(kv / bw, at_flops / peak)) * 1e3
    return {"weight_bytes": w, "kv_bytes": kv, "roofline_step_ms": round(ms, 3),
            "roofline_tok_s_total": round(batch / ms * 1e3, 1),
            "flop_floor_ms": round((mm_flops + at_flops) / peak * 1e3, 3),
            "serial_floor_ms": round(serial, 3), "serial_tok_s_total": round(batch / serial * 1e3, 1),
            "copy_GBps": round(ceil["copy_GBps"], 1), "matmul_TFLOPs": round(ceil["matmul_TFLOPs"], 1)}


def prompts_for(model, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]


def run_llm(llm, prompts, new_tokens: int) -> dict:
    """Generate greedily; decode tok/s per sequence from first token to finish (median over sequences)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)  # warm-up: compile and capture every graph the timed run will replay
    sync()
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    per_seq = [o.decode_tokens_per_s for o in outs]
    return {"tokens": [o.token_ids for o in outs], "decode_tok_s_per_seq": statistics.median(per_seq),
            "decode_tok_s_total": statistics.median(per_seq) * len(prompts),
            "ttft_s": statistics.median(o.ttft_s for o in outs), "wall_s": round(wall, 2), "warmup_s": round(warmup, 1)}


def replay_times(graph, reps: int) -> list[float]:
    """GPU milliseconds of `reps` replays of a captured CUDA graph, each timed by its own events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def kernel_gaps(prof, top: int = 5) -> dict:
    """When the GPU idled in a profiled region: the span from its first kernel's start to its last one's
    end, the idle time inside it (the span less the union of the kernels' intervals), and the `top`
    longest idle stretches with the kernels either side of them."""
    runs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    if not runs:
        return {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}
    gaps, reach, last = [], runs[0][1], runs[0][2]
    for start, end, name in runs[1:]:
        if start > reach:
            gaps.append((start - reach, last[:60], name[:60]))
        if end >= reach:
            reach, last = end, name
    return {"span_ms": round((reach - runs[0][0]) / 1e3, 3), "idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
            "gaps": [[round(us / 1e3, 3), before, after] for us, before, after in sorted(gaps, reverse=True)[:top]]}


def host_edges(prof, region: str, top: int = 8) -> dict:
    """The host's share of a profiled region (a `record_function` named `region`, profiled with CPU and
    CUDA activity): from the region's start to the GPU's first event (`before_gpu_ms`), from the GPU's
    last event to the region's end (`after_gpu_ms`), and the `top` CPU ops by self time in the first of
    the two, the host work a request waits for before its first kernel runs."""
    events = list(prof.events())
    cpu = torch.autograd.DeviceType.CPU
    spans = [e.time_range for e in events if e.name == region and e.device_type == cpu]
    gpu = [e.time_range for e in events if e.device_type != cpu]
    if not spans or not gpu:
        return {"before_gpu_ms": None, "after_gpu_ms": None, "host_top_before_gpu": []}
    r, first, last = spans[0], min(t.start for t in gpu), max(t.end for t in gpu)
    ops: dict[str, float] = {}
    for e in events:
        if e.device_type == cpu and e.name != region and r.start <= e.time_range.start < first:
            ops[e.name[:60]] = ops.get(e.name[:60], 0.0) + e.self_cpu_time_total
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return {"before_gpu_ms": round((first - r.start) / 1e3, 3), "after_gpu_ms": round((r.end - last) / 1e3, 3),
            "host_top_before_gpu": [[n, round(us / 1e3, 3)] for n, us in ranked]}


ATTENTION_KERNELS = ("_paged_attn_kernel",)  # the decode's attention, whose launches `exposure` lists one by one


def exposure(runs: list[tuple[float, float, str, tuple]], top: int = 24, listed=ATTENTION_KERNELS) -> dict:
    """What each kernel adds to the span of a stream's kernels, `runs` as (start µs, end µs, name, grid).
    Kernels overlap under programmatic dependent launch (a kernel starts while the one before finishes and
    waits in it), so their summed durations overstate the step; a kernel's exposed time is how far its end
    passes the latest end of the kernels that started before it (the span is the exposed times plus the idle
    stretches). Grouped by name and grid, which tells one projection's launch from another's: the `top` groups
    by exposed time, each as [name, grid, count, exposed ms, summed ms]. The kernels named in `listed` also give
    each launch's µs in launch order (`listed`: one per layer for the attention, whose time a layer's place in the
    arena's frames can move)."""
    runs = sorted(runs)
    if not runs:
        return {"span_ms": 0.0, "idle_ms": 0.0, "kernels": 0, "by_launch": [], "listed": {}}
    groups: dict[tuple, list] = {}
    reach, idle = runs[0][0], 0.0
    for start, end, name, grid in runs:
        idle += max(0.0, start - reach)
        g = groups.setdefault((name, tuple(grid)), [0, 0.0, 0.0])
        g[0] += 1
        g[1] += max(0.0, end - max(start, reach))
        g[2] += end - start
        reach = max(reach, end)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    return {"span_ms": round((reach - runs[0][0]) / 1e3, 3), "idle_ms": round(idle / 1e3, 3), "kernels": len(runs),
            "by_launch": [[name, list(grid), c, round(x / 1e3, 3), round(d / 1e3, 3)]
                          for (name, grid), (c, x, d) in ranked[:top]],
            "listed": {n: [round(end - start, 1) for start, end, name, _ in runs if name == n] for n in listed}}


def replay_exposure(graph, top: int = 24) -> dict:
    """`exposure` of one profiled replay of a captured graph (its kernels from the profiler's trace)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return exposure([(e["ts"], e["ts"] + e["dur"], e["name"][:60], tuple(e.get("args", {}).get("grid", ())))
                     for e in events if e.get("cat") == "kernel"], top)


def replay_context(model, kv_lens: list[int]) -> dict:
    """The step a captured decode graph replays, from its static inputs' `kv_lens` (what the last step that used
    the graph left there): its sequences (`replay_rows`; a padded row's kv_len is 1, a decoding sequence's at least
    2), their contexts, and the KV bytes its attention reads at them. The last step of a run whose requests started
    decoding in turn holds fewer sequences than its graph's bucket, so a profile is read against these, not the
    run's nominal batch and context."""
    return {"replay_rows": sum(n > 1 for n in kv_lens),
            "replay_kv_lens": [min(kv_lens), statistics.median(kv_lens), max(kv_lens)],
            "replay_kv_bytes": sum(kv_bytes_per_step(model, 1, n) for n in kv_lens)}


@torch.inference_mode()
def decode_profile(engine: InductorEngine, model, batch: int, weight_bytes: int, replays: int = 50,
                   matmul_bytes: int | None = None) -> dict:
    """Where a decode step's time goes. The batch's decode graph (its bucket's widest table), replayed alone on
    what the last step that ran it left in its inputs (`replay_context` says which step that is), gives
    the step's GPU time without the runtime around it; one profiled step of the compiled module and one
    of the eager step (same inputs, same arena) give each kernel's time. Replays rewrite the same K/V.
    `matmul_bytes`: the weight bytes the cuBLAS matmuls read, where other kernels read the rest (a
    mixture-of-experts model's experts); default `weight_bytes`."""
    key, _ = _graph_of(engine, batch)
    if key is None:
        raise RuntimeError(f"no decode graph of batch {batch} was captured (captured: {sorted(engine._graphs)}); "
                           f"all {batch} sequences must decode together: more --new-tokens")
    graph, _, inputs = engine._graphs[key]
    static = inputs.views
    times = replay_times(graph, replays)
    replay_ms = statistics.median(times)
    record = {"stage": "decode_profile", "batch": batch, "graph_key": list(key), "replays": replays,
              "replay_ms_median": round(replay_ms, 3), "replay_ms_min": round(min(times), 3),
              "weight_GBps_at_replay": round(weight_bytes / replay_ms / 1e6, 1),
              "replay_exposure": replay_exposure(graph), **replay_context(model, inputs.fields["kv_lens"].tolist())}
    eager_step = ArenaStep(PagedStep(model, engine.geometry), engine.arena.tensor)
    for name, step in (("compiled", engine.compiled), ("eager", eager_step)):
        step(*static)
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(*static)
            sync()
        record[name] = kernel_kinds(prof)
    mm = record["compiled"]["by_kind"].get("matmul", {}).get("ms")
    if mm:
        record["matmul_GBps"] = round((weight_bytes if matmul_bytes is None else matmul_bytes) / mm / 1e6, 1)
    at = record["compiled"]["by_kind"].get("attention", {}).get("ms")
    if at:
        record["attention_GBps"] = round(record["replay_kv_bytes"] / at / 1e6, 1)
    return record


def graph_ms(fn, reps: int) -> float:
    """Median GPU time of `fn` captured once as a CUDA graph and replayed (no launch gaps from the host)."""
    fn()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(replay_times(graph, reps))


GEMV_SPLITS = (2, 4, 8)  # the runs over K at which gemv_record also tries MODEL_CONFIG and NARROW_CONFIGS[0]
# The tiles gemv_record sweeps for a serving batch (more than MIN_ROW_TILE rows: a row tile of 32-128 on the
# tensor cores' warp-group MMA), each unsplit and at SERVING_SPLITS runs over K.
SERVING_CONFIGS = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3),
                   (256, 64, 8, 3), (64, 64, 4, 6)]
SERVING_SPLITS = (2, 3, 4)


def gemv_record(x: torch.Tensor, mats: list[torch.Tensor], reps: int, plans: list | None = None) -> dict:
    """The Triton skinny matmul over `mats` (one launch per weight, as the cuBLAS form), for each of `plans`
    ((tile, splits) pairs; default for up to 16 rows GEMV_CONFIGS unsplit and MODEL_CONFIG and the widest
    narrow tile at GEMV_SPLITS runs over K, for more rows SERVING_CONFIGS unsplit and, where a tile's column
    blocks are fewer than the SMs, at SERVING_SPLITS runs) and the op's own: its values against cuBLAS's on
    the first weight (before any timing), then the median graph replay; the fastest (tile + [splits]) and its
    time as `best_config` and `ms` (None if none ran), every one's beside it, and the plan
    `g4rt::skinny_linear` takes for the shape with its time (`op_config`, `op_ms`; None where the op runs a
    BLAS library for these rows)."""
    from g4rt.plugins import launch
    from g4rt.plugins import triton_gemv as tg
    want = torch.nn.functional.linear(x, mats[0]).float()
    op = tg.gemv_plan(*mats[0].shape, x.device) if tg.takes_gemv(x.shape[0], mats[0]) else None
    if plans is None and x.shape[0] > tg.MIN_ROW_TILE:
        n, sms = mats[0].shape[0], launch.sm_count(x.device)
        plans = [(c, s) for c in SERVING_CONFIGS
                 for s in (1, *(SERVING_SPLITS if -(-n // c[0]) < sms else ()))]
    elif plans is None:
        plans = [(c, 1) for c in tg.GEMV_CONFIGS]
        plans += [(c, s) for c in (tg.MODEL_CONFIG, tg.NARROW_CONFIGS[0]) for s in GEMV_SPLITS]
    plans = plans + ([op] if op is not None and op not in plans else [])
    tried, best = [], None
    for cfg, splits in plans:
        name = [*cfg, splits]
        try:
            out = torch.full_like(want, float("nan"), dtype=x.dtype)
            tg.gemv(x, mats[0], cfg, out=out, splits=splits)
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            ms = graph_ms(lambda: [tg.gemv(x, w, cfg, splits=splits) for w in mats], reps) if err < 2e-2 else None
            tried.append({"config": name, "rel_err": round(err, 5), "ms": None if ms is None else round(ms, 4)})
            if ms is not None and (best is None or ms < best[1]):
                best = (name, ms)
        except Exception as e:  # noqa: BLE001  (a config out of registers or shared memory)
            tried.append({"config": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
    op_name = None if op is None else [*op[0], op[1]]
    return {"stage": "matmul_roles", "layers": len(mats), "shape": list(mats[0].shape),
            "ms": None if best is None else round(best[1], 4), "best_config": None if best is None else best[0],
            "op_config": op_name, "op_ms": next((c.get("ms") for c in tried if c["config"] == op_name), None),
            "op_takes_kernel": tg.takes_gemv(x.shape[0], mats[0]), "configs": tried}


def decode_roles(model) -> tuple[dict, dict]:
    """Decode's matmul weights by role, in model order: {(role, weight shape): every layer's weight} for each
    Linear (and the lm_head), and {(packed role, packed shape): every layer's list of parts} for the weights the
    engines pack on CUDA (gate/up, q/k/v). A model on the meta device gives the shapes alone."""
    roles: dict[tuple[str, tuple], list[torch.Tensor]] = {}

    def add(role: str, w: torch.Tensor) -> None:  # layers of one role may differ (the E2B's wide MLPs)
        roles.setdefault((role, tuple(w.shape)), []).append(w)

    fused: dict[tuple[str, tuple], list[list[torch.Tensor]]] = {}
    for layer in model.layers:
        kind = "sliding" if layer.self_attn.kv.sliding else "full"
        mods = {name: mod for name, mod in layer.named_modules() if isinstance(mod, torch.nn.Linear)}
        for name, mod in mods.items():
            add(f"{kind}.{name}", mod.weight)
        # as pack_weights packs them (k_eq_v layers have no v_proj; KV-shared ones no k or v)
        for packed, parts in (("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj")),
                              ("self_attn.qkv", tuple(f"self_attn.{p}_proj" for p in "qkv"))):
            ws = [mods[p].weight for p in parts if p in mods]
            if len(ws) > 1:
                fused.setdefault((f"{kind}.{packed}", (sum(w.shape[0] for w in ws), ws[0].shape[1])), []).append(ws)
    add("lm_head", model.embed_tokens.weight)
    return roles, fused


@torch.inference_mode()
def matmul_roles(model, bw: float, batches=(1, 8), reps: int = 20, roles_like: tuple[str, ...] = (),
                 gemv: bool = True) -> list[dict]:
    """Decode's matmuls one role at a time, every layer's weight of that role in model order (as a step
    reads them, so no weight is still in L2), against the copy bandwidth. Three forms: cuBLAS on the
    checkpoint layout ([out, in], x @ W.T, what the engines run), on a transposed copy ([in, out]), and
    for gate/up and q/k/v one matmul over the concatenated weights (fewer, wider launches, what the
    engines run on CUDA). For the first and last form, batches up to MAX_ROWS also time the Triton skinny
    matmul (plugins/triton_gemv.py) over its configs (`gemv_record`; not with `gemv` False). `roles_like`:
    only the roles whose name holds one of these (all if empty)."""
    from g4rt.plugins import triton_gemv  # Triton only where --matmuls asks for it
    roles, fused = decode_roles(model)
    records = []
    forms = [(r, "out_in") for r in roles] + [(r, "in_out") for r in roles] + [(f, "concat") for f in fused]
    forms = [(r, form) for r, form in forms if not roles_like or any(p in r[0] for p in roles_like)]
    for (role, shape), form in forms:
        if form == "concat":
            mats = [torch.cat(ws) for ws in fused[role, shape]]
        elif form == "in_out":
            mats = [w.t().contiguous() for w in roles[role, shape]]
        else:
            mats = roles[role, shape]
        nbytes = sum(w.numel() * w.element_size() for w in mats)
        k = mats[0].shape[0] if form == "in_out" else mats[0].shape[1]
        for m in batches:
            x = torch.randn(m, k, device=mats[0].device, dtype=mats[0].dtype)
            ms = graph_ms((lambda: [x @ w for w in mats]) if form == "in_out" else
                           (lambda: [torch.nn.functional.linear(x, w) for w in mats]), reps)
            records.append({"stage": "matmul_roles", "role": role, "form": form, "batch": m, "layers": len(mats),
                            "shape": list(mats[0].shape), "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6, 1),
                            "of_copy_bw": round(nbytes / ms / 1e-3 / bw, 3)})
            if gemv and form != "in_out" and m <= triton_gemv.MAX_ROWS:
                g = gemv_record(x, mats, reps)
                g.update(role=role, form=f"{form}+gemv", batch=m,
                         of_copy_bw=None if g["ms"] is None else round(nbytes / g["ms"] / 1e-3 / bw, 3))
                records.append(g)
        del mats
        torch.cuda.empty_cache()
    return records


STAGGERED_LENS = (300, 40, 700, 17, 129, 1000)


@torch.inference_mode()
def staggered_tokens(llm, model, seed: int, new_tokens: int = 16) -> list[list[int]]:
    """Greedy tokens of prompts of mixed lengths that arrive one per step while the earlier ones decode:
    steps that mix prefill chunks with decodes (the inductor engine's piecewise graphs)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in STAGGERED_LENS]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ids, outs = [], {}
    while prompts or llm.has_unfinished():
        if prompts:
            ids.append(llm.add_request(prompts.pop(0), params))
        for o in llm.step():
            outs[o.request_id] = o.token_ids
    return [outs[i] for i in ids]


class PiecewiseAudit:
    """Wraps an inductor engine's `step`: every step that runs the piecewise graphs is run again by the
    compiled module on the same batch over the arena as it was before the step; per step, the logits'
    largest difference relative to the compiled ones' largest magnitude, whether the greedy choices
    agree, and whether both wrote the same arena."""

    def __init__(self, engine):
        self.engine, self.step_fn, self.records = engine, engine.step, []
        engine.step = self

    def __call__(self, batch, seq_ids=(), feed=None):
        e = self.engine
        if e.piecewise is None or batch.is_decode or not e.piecewise.covers(batch):
            return self.step_fn(batch, seq_ids, feed)
        before = e.arena.tensor.clone()
        got = self.step_fn(batch, seq_ids, feed).clone()
        after = e.arena.tensor.clone()
        e.arena.tensor.copy_(before)
        with torch.inference_mode():
            b = batch.to(e.device)
            if feed is not None:
                feed.apply(b.token_ids)
            want = e.compiled(*b.tensors())
        self.records.append({"tokens": batch.num_tokens, "seqs": batch.num_seqs,
                             "rel_diff": float((got - want).abs().max() / want.abs().max()),
                             "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
                             "arena_equal": bool(torch.equal(after, e.arena.tensor))})
        e.arena.tensor.copy_(after)
        return got


def _graph_of(engine, batch: int):
    """(key, graph) of the widest decode graph captured for `batch`'s bucket, or (None, None)."""
    keys = [k for k in engine._graphs if k[0] == pow2_bucket(batch)]
    return (max(keys), engine._graphs[max(keys)][0]) if keys else (None, None)


DECODE_STEPS_BUDGET = 4096  # decode_steps: the token budget of its prefill steps


def decode_steps_tokens(batch: int, prompt_len: int, window: int, reps: int) -> int:
    """New tokens each decode_steps request asks for: its timed steps (2 arms x reps x (window + 1)), 8
    more, and the head start of the first requests, which decode while later ones still prefill (one
    token budget per step), so that no request finishes inside a window (the batch would shrink)."""
    return 8 + 2 * reps * (window + 1) + -(-batch * prompt_len // DECODE_STEPS_BUDGET)


@torch.inference_mode()
def decode_steps(engine, model, batch: int, prompt_len: int, window: int, reps: int, seed: int,
                 ceil: dict, sampling: dict | None = None, profile: bool = False) -> list[dict]:
    """Steady-state decode of `batch` sequences: host wall per `LLM.step()` against the replay of the
    CUDA graph those steps run, for the overlapped loop and one step at a time, alternated `reps`
    times on the same requests (their prefill runs once, untimed; each arm times `window` steps).
    `sampling`: the requests' temperature / top_k / top_p (SamplingParams fields; request i seeded
    `seed + i`), default greedy, so the sampler's cost at a setting shows in the step. `profile`: then
    `decode_profile` of the graph as the last timed step left it, every one of the `batch` sequences decoding.

    The caller picks `prompt_len` so that the timed steps stay in one table-width bucket (one graph);
    a capture inside a window would show in `captures_in_window`. A record's `round` is the alternation's
    (0 to reps - 1, at a growing context); not `rep`, which the device scripts' run_arm sets to the process."""
    cfg = SchedulerConfig(max_num_batched_tokens=DECODE_STEPS_BUDGET, chunk=prompt_len, max_num_seqs=batch)
    new_tokens = decode_steps_tokens(batch, prompt_len, window, reps)
    frames = sum(promise_for(engine.geometry, prompt_len, new_tokens, cfg.chunk).frames for _ in range(batch)) + 8
    llm = LLM(engine, frames, cfg, eos_ids=model.config.eos_token_ids)
    sampling = sampling or {}
    ids = [llm.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=seed + i, **sampling))
           for i, p in enumerate(prompts_for(model, batch, prompt_len, seed))]
    seqs = [llm.scheduler.seqs[i] for i in ids]
    while not all(s.draws > 0 for s in seqs):  # prefill, untimed
        llm.step()
    for _ in range(4):  # the decode graph is captured here
        llm.step()
    sync()
    out = []
    for rnd in range(reps):
        for overlap in (True, False):
            llm.overlap = overlap
            llm.step()  # the loop settles into this arm's pattern
            captured = len(engine._graphs)
            walls = []
            for _ in range(window):
                t = time.perf_counter()
                llm.step()
                walls.append((time.perf_counter() - t) * 1e3)
            key, graph = _graph_of(engine, batch)
            replay = statistics.median(replay_times(graph, 10)) if graph is not None else None
            wall = statistics.median(walls)
            r = roofline(model, batch, prompt_len + seqs[0].draws, ceil)
            out.append({"stage": "decode_steps", "batch": batch, "overlap": overlap, "round": rnd,
                        "context": prompt_len + seqs[0].draws, "step_wall_ms_median": round(wall, 3),
                        "step_wall_ms_min": round(min(walls), 3), "step_wall_ms_max": round(max(walls), 3),
                        "replay_ms": None if replay is None else round(replay, 3),
                        "wall_over_replay": None if replay is None else round(wall / replay, 3),
                        "tok_s_total": round(batch / wall * 1e3, 1), "of_roofline": round(r["roofline_step_ms"] / wall, 3),
                        "graph_key": key and list(key), "sampling": sampling,
                        "captures_in_window": len(engine._graphs) - captured,
                        "running_after_window": sum(not s.finished for s in seqs), **r})
    if profile:
        out.append(decode_profile(engine, model, batch, weight_bytes_per_step(model, batch)))
    for i in ids:
        llm.cancel(i)
    while llm.has_unfinished():
        llm.step()
    return out


@torch.inference_mode()
def first_launches(engine: InductorEngine, keys, tokens) -> list[dict]:
    """Host and wall milliseconds of three launches right after capture: the decode graphs of `keys`
    and the piecewise segments of token buckets `tokens` (all of a bucket's segments back to back, no
    attention between them). Host: the launch call itself; wall: to the GPU's end.
    Why: a CUDA graph's first launch also uploads it to the device, 0.8-1.6 ms more on the H200
    (export/results/README.md, "A CUDA graph's first launch"). The capture launches each graph once, so
    these are its second to fourth launches, and alike when the capture paid the upload."""
    def three(launch) -> dict:
        host, wall = [], []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            launch()
            t1 = time.perf_counter()
            sync()
            host.append(round((t1 - t0) * 1e3, 3))
            wall.append(round((time.perf_counter() - t0) * 1e3, 3))
        return {"host_ms": host, "wall_ms": wall}

    out = []
    for key in keys:
        graph = engine._graph_for(key)[0]
        out.append({"stage": "first_launches", "graph": "decode", "key": list(key), **three(graph.replay)})
    for t in tokens:
        engine._pool = engine.piecewise.capture(t, engine._pool)
        segments = engine.piecewise._buckets[t].segments
        out.append({"stage": "first_launches", "graph": "piecewise segments", "tokens": t,
                    "segments": len(segments), **three(lambda: [g.replay() for g in segments])})
    return out


def prefill_flops(model, prompt_len: int) -> float:
    """FLOPs of one prompt's prefill: 2 per matmul weight per token (the lm_head for the last row only),
    plus attention's over the keys each query sees."""
    lm_head = model.embed_tokens.weight.numel()
    return 2.0 * (matmul_params(model) - lm_head) * prompt_len + 2.0 * lm_head + attention_flops(model, range(prompt_len))


@torch.inference_mode()
def ttft(engine, model, prompt_len: int, chunks: list[int], reps: int, seed: int, ceil: dict,
         profile: bool = False) -> list[dict]:
    """Time to first token of one `prompt_len` prompt per prefill chunk (the step's token budget equal
    to it), arms alternated `reps` times after one warm-up round; floor: its FLOPs at the matmul rate.
    `profile`: one more prefill per chunk under the profiler, its GPU kernels by kind (`kernel_kinds`)
    beside its wall time, which tells the kernels' time from the gaps between them, and one with the
    host's ops too (`host_edges`: the host time before the first kernel and after the last)."""
    prompt = prompts_for(model, 1, prompt_len, seed)[0]
    floor_s = prefill_flops(model, prompt_len) / (ceil["matmul_TFLOPs"] * 1e12)
    llms = {}
    for c in chunks:
        cfg = SchedulerConfig(max_num_batched_tokens=c, chunk=c, max_num_seqs=1)
        frames = promise_for(engine.geometry, prompt_len, 1, c).frames + 2
        llms[c] = LLM(engine, frames, cfg, eos_ids=model.config.eos_token_ids)
    def first_token(c: int):
        return llms[c].generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]

    times: dict[int, list[float]] = {c: [] for c in chunks}
    for rep in range(reps + 1):
        for c in chunks:
            sync()
            o = first_token(c)
            if rep:  # round 0 compiles the shapes
                times[c].append(o.ttft_s)
    out = [{"stage": "ttft", "prompt_len": prompt_len, "chunk": c, "reps": reps, "ttft_s_min": round(min(t), 4),
            "ttft_s_median": round(statistics.median(t), 4), "ttft_s_max": round(max(t), 4),
            "bf16_floor_s": round(floor_s, 4), "of_floor": round(floor_s / statistics.median(t), 3),
            "matmul_TFLOPs": round(ceil["matmul_TFLOPs"], 1)} for c, t in times.items()]
    for c in chunks if profile else ():
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            o = first_token(c)
            sync()
        out.append({"stage": "ttft_profile", "prompt_len": prompt_len, "chunk": c,
                    "ttft_s_profiled": round(o.ttft_s, 4), **kernel_kinds(prof), **kernel_gaps(prof)})
        sync()  # once more with the host's ops (which the profiler slows): what runs before the first kernel
        cuda_cpu = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=cuda_cpu) as prof:
            with torch.profiler.record_function("ttft.generate"):
                o = first_token(c)
            sync()
        out.append({"stage": "ttft_host", "prompt_len": prompt_len, "chunk": c, "ttft_s_profiled": round(o.ttft_s, 4),
                    **host_edges(prof, "ttft.generate")})
    return out


def hf_model_from(model):
    """HF `Gemma4ForCausalLM` on the GPU holding a copy of `model`'s weights (same names under `model.`)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from g4rt.models.checkpoint import hf_config_dict

    dtype = model.embed_tokens.weight.dtype
    cfg = Gemma4TextConfig(**hf_config_dict(model.config, str(dtype).removeprefix("torch.")))
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(dtype)
    try:
        with torch.device(model.embed_tokens.weight.device):
            hf = Gemma4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    missing, unexpected = hf.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items()}, strict=False)
    if unexpected or any(not m.startswith("lm_head") for m in missing):
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf.eval()


@torch.inference_mode()
def hf_decode(hf, prompts, new_tokens: int) -> dict:
    ids = torch.tensor(prompts, device=hf.device)

    def gen(n):
        sync()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return out, time.perf_counter() - t

    gen(2)  # warm-up
    _, t_one = gen(1)
    out, t_all = gen(new_tokens + 1)
    per_seq = new_tokens / (t_all - t_one)
    return {"tokens": out[:, ids.shape[1]:ids.shape[1] + new_tokens].tolist(), "decode_tok_s_per_seq": per_seq,
            "decode_tok_s_total": per_seq * len(prompts), "prefill_s": t_one}


def throughput(a, model, log, ceil, t_start) -> bool:
    """The throughput stages of `main` on one inductor engine; False if one of them failed."""
    steps = [int(x) for x in a.decode_steps.split(",") if x]
    prompts = [int(x) for x in a.ttft.split(",") if x]
    chunks = [int(x) for x in a.ttft_chunks.split(",") if x]
    if a.sampler:
        from .kernels import sampler_cases  # needs triton, which the other stages do not

        for r in sampler_cases(model.config.vocab_size, row_counts=(256,), reps=a.reps):
            log({"stage": "sampler", **r})
    if not (steps or prompts):
        return True
    geometry = PageGeometry.build(model.layout)
    step_prompt, window = 160, 12  # up to 3 reps stay below position 256: one table-width bucket (decode_steps)
    frames = max([sum(promise_for(geometry, step_prompt, decode_steps_tokens(b, step_prompt, window, a.reps),
                                  step_prompt).frames for _ in range(b)) for b in steps]
                 + [promise_for(geometry, n, 1, max(chunks)).frames for n in prompts]) + 16
    mode = None if a.compile_mode == "none" else a.compile_mode
    engine = InductorEngine(model, geometry, frames, mode, a.compile_scope, a.piecewise)
    log({"stage": "arena", "frames": frames, "frame_bytes": geometry.frame_bytes(),
         "arena_gib": round(engine.arena.nbytes / 2**30, 2)})
    engine.plan_batches(max(steps + [1]))
    ok = True
    sampling = {"temperature": a.decode_temperature, "top_k": a.decode_top_k, "top_p": a.decode_top_p}
    stages = [("decode_steps", b, lambda b=b: decode_steps(engine, model, b, step_prompt, window, a.reps,
                                                               a.seed + b, ceil, sampling, a.profile))
              for b in steps]
    stages += [("ttft", n, lambda n=n: ttft(engine, model, n, chunks, a.reps, a.seed, ceil, a.profile))
               for n in prompts]
    for name, arg, run in stages:
        if a.stop_after and time.perf_counter() - t_start > a.stop_after:
            log({"stage": name, "arg": arg, "skipped": f"past --stop-after {a.stop_after} s"})
            continue
        try:
            for r in run():
                log(r)
        except Exception as e:  # record and go on
            ok = False
            log({"stage": name, "arg": arg, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
        gc.collect()
        torch.cuda.empty_cache()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m g4rt.bench.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="31b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=0,
                    help="only the config's first N layers (its pattern kept; Gemma4Config.first_layers): the "
                         "step of a shallower model of the same layer shapes, e.g. the 31B's first 30 layers at "
                         "batch 256 on an 80 GB card; every record's roofline counts that model's bytes")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode; 'none' captures eager steps")
    ap.add_argument("--compile-scope", default="layers", choices=["layers", "step"])
    ap.add_argument("--engines", default="eager,inductor", help="which of eager,inductor to run")
    ap.add_argument("--no-piecewise", dest="piecewise", action="store_false",
                    help="the inductor engine runs prefill and mixed steps by the compiled module, not as "
                         "piecewise CUDA graphs")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--init", default="default", choices=["default", "deep"],
                    help="random weights: the default init, or the non-chaotic one (DESIGN.md, two inits)")
    ap.add_argument("--staggered", action="store_true",
                    help="also compare the engines' greedy tokens on requests arriving one per step (mixed steps)")
    ap.add_argument("--matmuls", action="store_true",
                    help="only time decode's matmuls role by role and layout by layout (matmul_roles)")
    ap.add_argument("--no-gemv", dest="gemv", action="store_false",
                    help="with --matmuls: cuBLAS only, not the Triton skinny matmul's configs")
    ap.add_argument("--roles", default="", help="with --matmuls: only the roles whose name holds one of these "
                    "comma-separated parts, e.g. qkv,gate_up,o_proj,down_proj,lm_head (the forms a step runs)")
    ap.add_argument("--profile", action="store_true",
                    help="after each inductor run: graph replay time, per-kernel time of one decode step, and "
                         "each launch's exposed time in one replay (replay_exposure), on the inputs of the run's "
                         "last decode step (replay_rows: its sequences, fewer than the batch where requests "
                         "started in turn); with --decode-steps, the same after each batch's timed steps, every "
                         "sequence decoding; with --ttft, each prompt's prefill kernels by kind")
    ap.add_argument("--runtime-checks", action="store_true", help="also run bench/runtime.py's equality check")
    ap.add_argument("--long-context", type=int, default=0, help="also run one request of this many positions")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                    help="the KV arena's dtype (default the weights', bfloat16); the rooflines count its bytes")
    ap.add_argument("--decode-steps", default="", help="batches whose steady-state decode step is timed "
                    "against its graph replay (decode_steps), e.g. 1,64,128,256")
    ap.add_argument("--decode-temperature", type=float, default=0.0,
                    help="the --decode-steps requests' sampling temperature (0: greedy, the default)")
    ap.add_argument("--decode-top-k", type=int, default=0, help="their top-k cut (0: none), e.g. 64")
    ap.add_argument("--decode-top-p", type=float, default=1.0, help="their top-p cut (1: none), e.g. 0.95")
    ap.add_argument("--ttft", default="", help="prompt lengths whose time to first token is measured, e.g. 2048,8192")
    ap.add_argument("--ttft-chunks", default="512,2048,8192", help="prefill chunk sizes the --ttft arms use")
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions of each throughput arm")
    ap.add_argument("--sampler", action="store_true", help="time the sampler at 256 rows, old vs new "
                    "(python -m g4rt.bench.kernels --sampler times it without building a model)")
    ap.add_argument("--first-launches", action="store_true",
                    help="only time three launches of freshly captured decode graphs and piecewise segments "
                         "(first_launches), on an inductor engine of its own")
    ap.add_argument("--stop-after", type=float, default=0.0,
                    help="seconds after which the throughput stages still to run are skipped (0: none)")
    ap.add_argument("--blas", default="default", choices=["default", "cublas", "cublaslt"],
                    help="the library torch's cuBLAS-side matmuls go through (torch.backends.cuda."
                         "preferred_blas_library); default leaves torch's choice")
    ap.add_argument("--no-bf16-reduced-reduction", dest="bf16_reduction", action="store_false",
                    help="forbid cuBLAS reductions in bf16 inside a bf16 matmul (torch.backends.cuda.matmul."
                         "allow_bf16_reduced_precision_reduction = False), which changes the kernels it may pick")
    ap.add_argument("--shared-carveout", type=int, default=None, metavar="PERCENT",
                    help="every Triton/Gluon kernel prefers this share of L1/shared memory as shared memory "
                         "(common.prefer_shared_carveout); default leaves the driver's choice")
    a = ap.parse_args(argv)
    unknown = set(a.engines.split(",")) - {"eager", "inductor"}
    if unknown:
        ap.error(f"--engines: unknown {', '.join(sorted(unknown))}; choose from eager,inductor")
    try:
        SamplingParams(temperature=a.decode_temperature, top_k=a.decode_top_k, top_p=a.decode_top_p)
    except ValueError as e:
        ap.error(f"--decode-temperature / --decode-top-k / --decode-top-p: {e}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: it times the engines on random weights at a model's real size (on a CPU, "
                 "`g4rt run` runs the tiny model and `make test` the engines' checks)")
    if a.shared_carveout is not None:
        prefer_shared_carveout(a.shared_carveout)
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = a.bf16_reduction
    a.out.mkdir(parents=True, exist_ok=True)
    log = functools.partial(log_json, a.out, name="export_bench.jsonl")
    t_start = time.perf_counter()
    ceil = ceilings(quick=False)
    bw = ceil["copy_GBps"] * 1e9
    t0 = time.perf_counter()
    config = load_config(a.config)
    if a.layers:
        config = config.first_layers(a.layers)
    model = random_model(config, dtype=torch.bfloat16, device="cuda", seed=a.seed, init=a.init,
                         kv_dtype=a.kv_dtype)
    wbytes = weight_bytes_per_step(model)
    roof1 = roofline(model, 1, a.prompt_len, ceil)
    log({"stage": "setup", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": a.config,
         "layers": config.num_hidden_layers, "kv_dtype": model.layout.dtype,
         "blas": str(torch.backends.cuda.preferred_blas_library()), "bf16_reduced_reduction": a.bf16_reduction,
         "shared_carveout": a.shared_carveout,
         "build_s": round(time.perf_counter() - t0, 1), "weight_bytes_per_step_batch1": wbytes,
         "roofline_tok_s_batch1": roof1["roofline_tok_s_total"], **roof1})
    batches = [int(x) for x in a.batches.split(",") if x]
    if a.matmuls:
        for r in matmul_roles(model, bw, batches, roles_like=tuple(p for p in a.roles.split(",") if p), gemv=a.gemv):
            log(r)
        return 0
    geometry = PageGeometry.build(model.layout)
    if a.first_launches:
        engine = InductorEngine(model, geometry, 64, None if a.compile_mode == "none" else a.compile_mode,
                                a.compile_scope, a.piecewise)
        for r in first_launches(engine, [(1, 16, 8), (8, 16, 8), (64, 16, 8), (1, 1, 1)], [128, 256]):
            log(r)
        return 0
    cfg = SchedulerConfig.for_device("cuda", max_num_seqs=max(batches, default=1))
    frames = sum(promise_for(geometry, a.prompt_len, a.new_tokens, cfg.chunk).frames for _ in range(cfg.max_num_seqs)) + 8
    if a.staggered:
        frames += sum(promise_for(geometry, n, 16, cfg.chunk).frames for n in STAGGERED_LENS)
    mode = None if a.compile_mode == "none" else a.compile_mode
    makers = {
        "eager": lambda: LLM.paged(model, num_frames=frames, config=cfg),
        "inductor": lambda: LLM(InductorEngine(model, geometry, frames, mode, a.compile_scope, a.piecewise),
                                frames, cfg, eos_ids=model.config.eos_token_ids),
    }
    makers = {k: v for k, v in makers.items() if k in a.engines.split(",")}
    ok, results = True, {}
    for b in batches:
        prompts = prompts_for(model, b, a.prompt_len, a.seed + b)
        for name, make in makers.items():
            try:
                t = time.perf_counter()
                llm = make()
                r = run_llm(llm, prompts, a.new_tokens)
                results[(name, b)] = r
                eager = results.get(("eager", b), {}).get("tokens")  # None when eager is not run
                log({"stage": name, "batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "decode_tok_s_per_seq": round(r["decode_tok_s_per_seq"], 2),
                     "decode_tok_s_total": round(r["decode_tok_s_total"], 1),
                     "of_roofline": round(r["decode_tok_s_total"] / roofline(
                         model, b, a.prompt_len + a.new_tokens // 2, ceil)["roofline_tok_s_total"], 3),
                     "ttft_s": round(r["ttft_s"], 3), "stage_s": round(time.perf_counter() - t, 1),
                     "warmup_s": r["warmup_s"], "tokens_equal_eager": None if eager is None else r["tokens"] == eager,
                     "first_difference_at": first_differences(r["tokens"], eager or []), **compile_health()})
                ok &= eager is None or r["tokens"] == eager
                if a.profile and name == "inductor":
                    log(decode_profile(llm.engine, model, b, wbytes))
            except Exception as e:  # record and go on: one broken engine must not hide the others
                ok = False
                log({"stage": name, "batch": b, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-3000:]})
            llm = None
            gc.collect()
            torch.cuda.empty_cache()
    staggered = {}
    for name, make in makers.items() if a.staggered else ():
        try:
            t = time.perf_counter()
            llm = make()
            audit = PiecewiseAudit(llm.engine) if name == "inductor" else None
            staggered[name] = staggered_tokens(llm, model, a.seed)
            eager = staggered.get("eager")
            log({"stage": "staggered", "engine": name, "stage_s": round(time.perf_counter() - t, 1),
                 "piecewise_vs_compiled": audit and audit.records,
                 "tokens_equal_eager": None if eager is None else staggered[name] == eager,
                 "first_difference_at": first_differences(staggered[name], eager or [])})
            ok &= eager is None or staggered[name] == eager
        except Exception as e:
            ok = False
            log({"stage": "staggered", "engine": name, "error": f"{type(e).__name__}: {e}",
                 "trace": traceback.format_exc()[-3000:]})
        gc.collect()
        torch.cuda.empty_cache()
    ok &= throughput(a, model, log, ceil, t_start)
    if a.runtime_checks or a.long_context:
        try:
            if a.runtime_checks:
                r = rb.paged_vs_linear(model, a.out, [2500, 1300, 700], 16, 1024, a.seed)
                ok &= all(r["identical"])
            if a.long_context:
                r = rb.long_context(model, a.out, a.long_context, a.chunk, 4, a.seed)
                ok &= r["within_5pct"] and r["finish_reason"] == "length"
        except Exception as e:
            ok = False
            log({"stage": "runtime", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
        gc.collect()
        torch.cuda.empty_cache()
    if not a.skip_hf:
        try:
            hf = hf_model_from(model)
            for b in batches:
                prompts = prompts_for(model, b, a.prompt_len, a.seed + b)
                r = hf_decode(hf, prompts, a.new_tokens)
                ours = results.get(("eager", b), {}).get("tokens")  # None when eager is not run
                log({"stage": "hf", "batch": b, "decode_tok_s_per_seq": round(r["decode_tok_s_per_seq"], 2),
                     "decode_tok_s_total": round(r["decode_tok_s_total"], 1), "prefill_s": round(r["prefill_s"], 3),
                     "tokens_equal_eager": r["tokens"] == ours,
                     "first_difference_at": first_differences(r["tokens"], ours or [])})
            for n in [int(x) for x in a.ttft.split(",") if x]:  # the prompt `ttft` gives the engine
                ids = torch.tensor(prompts_for(model, 1, n, a.seed), device="cuda")
                with torch.inference_mode():
                    log({"stage": "ttft", "engine": "hf", "prompt_len": n, "reps": a.reps, **time_to_first_token(
                        lambda p: hf.generate(p, max_new_tokens=1, min_new_tokens=1, do_sample=False), ids, a.reps)})
            del hf
            torch.cuda.empty_cache()
        except Exception as e:
            log({"stage": "hf", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
