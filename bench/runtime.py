"""GPU checks of the runtime, for the H200 (`make bench-gpu` runs them; results are committed
under runtime/results/ with the command that produced them).

* `long`: one request of `--context` positions (chunked prefill plus a few decode tokens) on a
  published config with random bf16 weights, sliding reclamation on. The peak frames each group held
  are compared with `g4rt plan`'s arithmetic (models/layout.py): they must agree within 5%.
* `equal`: the paged engine (Triton kernels) against the linear reference cache (torch `attend`),
  same scheduler and step batches, bf16, prompts several windows long: greedy tokens must be equal.

    python -m g4rt.bench.runtime --config 31b --out DIR [--context 262144] [--chunk 8192] [--skip-long]
                                 [--layers N] [--dtype float32]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

import torch

from g4rt.models.checkpoint import random_model
from g4rt.models.config import load_config
from g4rt.models.layout import PageGeometry
from g4rt.runtime.admission import promise_for
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

from .common import first_differences, log_json, sync


def long_context(model, out: Path, context: int, chunk: int, decode: int, seed: int) -> dict:
    """Run one request to `context` positions; record per-group peak frames against the plan."""
    geometry = PageGeometry.build(model.layout)
    prompt_len = context - decode
    promise = promise_for(geometry, prompt_len, decode, chunk)
    cfg = SchedulerConfig(max_num_batched_tokens=chunk, chunk=chunk, max_num_seqs=1)
    llm = LLM.paged(model, num_frames=promise.frames, config=cfg)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    rid = llm.add_request(prompt, SamplingParams(max_new_tokens=decode, ignore_eos=True))
    seq = llm.scheduler.waiting[0]
    peak = {"sliding": 0, "full": 0}
    step_times, done = [], []
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        while llm.has_unfinished():
            ts = time.perf_counter()
            done += llm.step()
            sync()
            step_times.append(time.perf_counter() - ts)
            if seq.pages is not None and not seq.pages.released:
                peak["sliding"] = max(peak["sliding"], seq.pages.peak_sliding)
                peak["full"] = max(peak["full"], len(seq.pages.full.frames))
            if len(step_times) % 8 == 0:
                log_json(out, {"check": "long.progress", "steps": len(step_times), "computed": seq.computed,
                           "elapsed_s": round(time.perf_counter() - t0, 1)})
    total = time.perf_counter() - t0
    (res,) = [o for o in done if o.request_id == rid]
    layout = model.layout  # in the model's dtype, as the arena's frames are
    frame = geometry.frame_bytes()
    plan = {"sliding": layout.sliding.bytes_per_token * layout.sliding.resident_positions(context, chunk),
            "full": layout.full.bytes_per_token * context}
    measured = {g_: peak[g_] * frame for g_ in peak}
    n_prefill = -(-prompt_len // chunk)
    record = {
        "check": "long", "context": context, "chunk": chunk, "page_tokens": geometry.page_tokens,
        "frame_bytes": frame, "finish_reason": res.finish_reason, "error": res.error,
        "generated": len(res.token_ids), "peak_frames": peak, "measured_bytes": measured, "plan_bytes": plan,
        "ratio": {g_: measured[g_] / plan[g_] for g_ in plan},
        "within_5pct": all(abs(measured[g_] / plan[g_] - 1) <= 0.05 for g_ in plan),
        "prefill_s": round(sum(step_times[:n_prefill]), 2), "decode_step_s": [round(t, 4) for t in step_times[n_prefill:]],
        "total_s": round(total, 2), "arena_frames": promise.frames,
        "all_frames_returned": llm.pool.num_free == llm.pool.num_frames and llm.pool.reserved == 0,
    }
    log_json(out, record)
    llm.engine.arena.close()
    return record


def paged_vs_linear(model, out: Path, prompt_lens: list[int], new_tokens: int, chunk: int, seed: int) -> dict:
    """Greedy tokens of the paged engine (Triton) and the linear reference, same step batches."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    geometry = PageGeometry.build(model.layout)
    frames = sum(promise_for(geometry, n, new_tokens, chunk).frames for n in prompt_lens)
    cfg = SchedulerConfig(max_num_batched_tokens=chunk, chunk=chunk, max_num_seqs=len(prompts))
    runs = {}
    for name in ("paged", "linear"):
        llm = LLM.paged(model, num_frames=frames, config=cfg, record_logits=True) if name == "paged" else \
            LLM.reference(model, num_frames=frames, config=cfg, record_logits=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        runs[name] = [o.token_ids for o in outs]
        runs[name + "_logits"] = [o.logits[0] for o in outs]  # the prompt's last row: same inputs both ways
        runs[name + "_s"] = round(time.perf_counter() - t0, 2)
        if name == "paged":
            llm.engine.arena.close()
    same = [a == b for a, b in zip(runs["paged"], runs["linear"])]
    first_diff = first_differences(runs["paged"], runs["linear"])
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(runs["paged_logits"], runs["linear_logits"])]
    record = {"check": "equal", "prompt_lens": prompt_lens, "first_logits_rel_err": rel, "new_tokens": new_tokens, "chunk": chunk,
              "identical": same, "first_difference_at": first_diff, "paged_s": runs["paged_s"],
              "linear_s": runs["linear_s"], "tokens_paged": runs["paged"], "tokens_linear": runs["linear"]}
    log_json(out, record)
    return record


def rounding_sensitivity(out: Path, layer_counts=(6, 20, 60), seed: int = 0) -> list[dict]:
    """How far a kernel-sized rounding difference carries through random Gemma 4 layers (CPU).

    A narrow 31B-shaped model (real head dims 256/512, k_eq_v, window 128) in bf16 runs one
    400-token prefill twice through the linear cache: once with `attend` as is, once with the
    attention probabilities rounded to bf16 before the P.V product, as the Triton kernel does.
    Any growth of the difference with depth is the model's, not the paging's."""
    import g4rt.models.linear_cache as linear_cache
    from g4rt.plugins import reference

    attend_bf16_probs = functools.partial(reference.attend, probs_dtype=torch.bfloat16)

    base = load_config("31b")
    records = []
    for n in layer_counts:
        cfg = dataclasses.replace(base, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                                  num_key_value_heads=4, num_global_key_value_heads=1, vocab_size=4096,
                                  sliding_window=128, num_hidden_layers=n, layer_types=base.layer_types[:n])
        model = random_model(cfg, torch.bfloat16, "cpu", seed)
        ids = torch.randint(3, cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(seed))
        logits = []
        for fn in (reference.attend, attend_bf16_probs):
            linear_cache.attend = fn
            try:
                cache = linear_cache.LinearCache()
                cache.begin_step([0], [len(ids)])
                with torch.inference_mode():
                    logits.append(model.logits(model(ids, torch.arange(len(ids)), cache)[-1:])[0])
            finally:
                linear_cache.attend = reference.attend
        a, b = logits
        records.append(log_json(out, {"check": "rounding_sensitivity", "layers": n,
                                  "logits_rel_diff": round(((a - b).norm() / a.norm()).item(), 4),
                                  "argmax_equal": a.argmax().item() == b.argmax().item()}))
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m g4rt.bench.runtime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="31b", help="published size or config.json path (random bf16 weights)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--equal-prompts", default="2500,1300,700", help="prompt lengths of the equality check")
    ap.add_argument("--equal-tokens", type=int, default=16)
    ap.add_argument("--equal-chunk", type=int, default=1024)
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--skip-equal", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (a mid-size model)")
    ap.add_argument("--kernels", default=None, help="triton or reference (default: triton on CUDA)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights and compute; float32 separates rounding from logic in the equality check")
    ap.add_argument("--rounding-sensitivity", action="store_true",
                    help="only run the CPU check of how bf16 rounding grows through random layers")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.rounding_sensitivity:
        rounding_sensitivity(a.out, seed=a.seed)
        return 0
    t0 = time.perf_counter()
    cfg = load_config(a.config)
    if a.layers:
        cfg = cfg.first_layers(a.layers)
    model = random_model(cfg, dtype=getattr(torch, a.dtype), device=a.device, seed=a.seed, kernels=a.kernels)
    log_json(a.out, {"check": "build", "config": a.config, "dtype": a.dtype, "layers": cfg.num_hidden_layers, "seconds": round(time.perf_counter() - t0, 1),
                 "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__})
    ok = True
    if not a.skip_equal:
        r = paged_vs_linear(model, a.out, [int(x) for x in a.equal_prompts.split(",")], a.equal_tokens, a.equal_chunk, a.seed)
        ok &= all(r["identical"])
    if not a.skip_long:
        r = long_context(model, a.out, a.context, a.chunk, a.decode, a.seed)
        ok &= r["within_5pct"] and r["finish_reason"] == "length" and r["all_frames_returned"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
