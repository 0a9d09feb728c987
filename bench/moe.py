"""The mixture-of-experts model (26B-A4B) on the H200: the `g4rt::moe` op alone, and the engines'
decode against the **active-weight** roofline, time to first token against HF, in one process.

    python -m g4rt.bench.moe --config 26b-a4b --out DIR [--batches 1,8,64] [--new-tokens 32]
                             [--ttft 2048,8192] [--skip-hf] [--tiles] [--profile]

Stages, each one JSON line in DIR/moe_bench.jsonl as it finishes (a run cut short keeps what it did):

* `setup`: copy bandwidth and bf16 matmul rate (bench.common.ceilings), random bf16 weights on the GPU.
* `moe_check`: the Triton op against the torch reference on the model's first layer, routed by that
  layer's router, at 1 and 2,048 tokens.
* `moe_op`: the op alone on every layer in turn (as a step reads them, so no expert is still in L2),
  per layer: time, the bytes of the distinct experts chosen, GB/s against the copy bandwidth, and the
  time of each of its kernels. `--tiles`: the same for the candidate tiles of `TILES`.
* `eager` / `inductor` per batch: greedy decode, tokens of inductor against eager; the roofline of a
  decode step at that batch: every non-expert weight once (the tied embedding whole, as the lm_head),
  the distinct experts the routers actually chose in the eager engine's decode steps (counted by
  `ExpertCensus`), the KV at the context; at the copy bandwidth; and the ratio reached.
* `decode_profile` (`--profile`): the inductor engine's batch-1 decode graph replayed alone, and its
  kernels by kind (bench.engine.decode_profile); `matmul_GBps` over the non-expert weights (the experts
  are the MoE kernels' reads, not cuBLAS's).
* `ttft`: time to first token of one prompt of each length (warm-up, then three runs) on the inductor
  engine, and on HF `Gemma4ForCausalLM` (sdpa) with the same weights; `hf` decode at batch 1.
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
import traceback
from pathlib import Path

import torch

from g4rt.models.checkpoint import random_model
from g4rt.models.config import load_config
from g4rt.models.layout import PageGeometry
from g4rt.plugins.buckets import token_bucket
from g4rt.runtime.admission import promise_for
from g4rt.runtime.engines.inductor import InductorEngine
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

from .common import ceilings, first_differences, kernel_kinds, log_json, sync, time_ms, time_to_first_token
from .engine import (active_weight_bytes, decode_profile, expert_bytes, hf_decode, hf_model_from, kv_bytes_per_step,
                     prompts_for, run_llm, weight_bytes_per_step)

# Candidate tiles per regime (plugins/triton_moe.py DECODE / PREFILL are the defaults), timed by --tiles:
# the earlier decode tiles (export/results/README_moe.md) and 128-row prefill blocks.
TILES = {
    1: [dict(gate_up_n=32, gate_up_k=256, down_n=32)],
    8: [dict(gate_up_n=32, gate_up_k=256, down_n=32)],
    64: [dict(gate_up_n=32, gate_up_k=256, down_n=32)],
    2048: [dict(block_m=128, num_warps=8)],
}


def moe_roofline(model, batch: int, context: int, distinct: list[float], ceil: dict) -> dict:
    """The active-weight roofline of a decode step of `batch` sequences at `context` positions."""
    w, kv = active_weight_bytes(model, distinct, batch), kv_bytes_per_step(model, batch, context)
    ms = (w + kv) / (ceil["copy_GBps"] * 1e9) * 1e3
    return {"active_weight_bytes": w, "kv_bytes": kv, "distinct_experts_per_layer": round(statistics.mean(distinct), 2),
            "roofline_step_ms": round(ms, 3), "roofline_tok_s_total": round(batch / ms * 1e3, 1)}


class ExpertCensus:
    """Counts, per layer, the distinct experts the real rows chose in the steps of exactly `tokens` tokens
    (decode steps of that batch) while active. Forward hooks on the eager model's `experts` modules keep the
    expert ids on the GPU; nothing syncs until `distinct()`."""

    def __init__(self, model, tokens: int):
        self.tokens, self.seen = tokens, {}
        self._hooks = [layer.experts.register_forward_hook(functools.partial(self._record, i))
                       for i, layer in enumerate(model.layers) if layer.has_moe]

    def _record(self, i, module, args, out):
        idx = args[1]
        if idx.shape[0] == token_bucket(self.tokens):  # the step's rows, padded (plugins/buckets.py)
            self.seen.setdefault(i, []).append(idx[: self.tokens].clone())  # the real rows' choices

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def distinct(self) -> list[float]:
        """Mean over the recorded steps of the distinct experts chosen, one number per layer."""
        if not self.seen:
            raise RuntimeError(f"no step of exactly {self.tokens} rows ran while the census counted")
        return [statistics.mean(len(torch.unique(idx)) for idx in self.seen[i]) for i in sorted(self.seen)]


@torch.inference_mode()
def routed(model, tokens: int, seed: int) -> list[tuple]:
    """Per MoE layer: (normed x, idx, w, gate_up, down) for `tokens` random hidden states, routed by the
    layer's own router (so the choices are as concentrated as that router makes them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for layer in model.layers:
        h = torch.randn(tokens, model.config.hidden_size, device="cuda", generator=g).to(model.dtype)
        w, idx = layer.router(h)
        out.append((layer.pre_feedforward_layernorm_2(h), idx, w, layer.experts.gate_up_proj, layer.experts.down_proj))
    return out


@torch.inference_mode()
def moe_check(model, tokens: int, seed: int) -> dict:
    """Triton op against the reference on layer 0, bf16: max error over the output's max magnitude."""
    args = routed(model, tokens, seed)[0]
    got = torch.ops.g4rt.moe(*args, "triton")
    want = torch.ops.g4rt.moe(*args, "reference")
    return {"stage": "moe_check", "tokens": tokens, "finite": bool(torch.isfinite(got).all()),
            "max_err_over_max": round(((got.float() - want.float()).abs().max() / want.float().abs().max()).item(), 5),
            "mean_abs_err_over_mean_abs": round(((got.float() - want.float()).abs().mean()
                                                 / want.float().abs().mean()).item(), 5)}


@torch.inference_mode()
def moe_op_times(model, tokens: int, ceil: dict, seed: int, tiles: dict | None = None) -> dict:
    """The op on every layer in turn: GPU ms per layer (CUDA graph, L2 flushed), the bytes it must read,
    and its kernels' times (one profiled pass). `tiles` overrides the default tiles of that regime."""
    from g4rt.plugins import triton_moe

    layers = routed(model, tokens, seed)
    config = {**triton_moe.default_config(tokens, model.config.top_k_experts, model.config.num_experts), **(tiles or {})}

    def run():
        return [triton_moe.moe(*a, config=config) for a in layers]

    ms = time_ms(run) / len(layers)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    distinct = [len(torch.unique(a[1])) for a in layers]
    nbytes = statistics.mean(distinct) * expert_bytes(model)
    cfg = model.config
    flops = 2 * tokens * cfg.top_k_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    return {"stage": "moe_op", "tokens": tokens, "tiles": config, "ms_per_layer": round(ms, 4),
            "distinct_experts_per_layer": round(statistics.mean(distinct), 2),
            "expert_GBps": round(nbytes / ms / 1e6, 1), "of_copy_bw": round(nbytes / ms / 1e-3 / (ceil["copy_GBps"] * 1e9), 3),
            "TFLOPs": round(flops / ms / 1e9, 1), "kernels_ms": kernel_kinds(prof)["top"][:6]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m g4rt.bench.moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="26b-a4b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ttft", default="2048,8192", help="prompt lengths for time to first token ('' for none)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="also time the candidate tiles of TILES")
    ap.add_argument("--profile", action="store_true", help="profile the inductor engine's batch-1 decode step")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    log = functools.partial(log_json, a.out, name="moe_bench.jsonl")
    batches = [int(x) for x in a.batches.split(",")]
    ttft_lens = [int(x) for x in a.ttft.split(",") if x]
    ceil = ceilings(quick=True)
    t0 = time.perf_counter()
    model = random_model(load_config(a.config), dtype=torch.bfloat16, device="cuda", seed=a.seed)
    if not model.config.enable_moe_block:
        ap.error(f"--config {a.config}: not a mixture-of-experts model")
    log({"stage": "setup", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": a.config,
         **{k: round(v, 1) for k, v in ceil.items()}, "build_s": round(time.perf_counter() - t0, 1),
         "expert_bytes": expert_bytes(model), "all_weight_bytes": weight_bytes_per_step(model)})
    ok = True

    def stage(fn, name, **ids):
        """Run one stage; record an error and go on, so one failure does not hide the rest."""
        nonlocal ok
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            ok = False
            log({"stage": name, **ids, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})

    for tokens in (1, 2048):
        stage(lambda: log(moe_check(model, tokens, a.seed)), "moe_check", tokens=tokens)
    for tokens in (1, 8, 64, 2048):
        stage(lambda: log(moe_op_times(model, tokens, ceil, a.seed)), "moe_op", tokens=tokens)
    for tokens, candidates in TILES.items() if a.tiles else ():
        for tiles in candidates:
            stage(lambda: log(moe_op_times(model, tokens, ceil, a.seed, tiles)), "moe_op", tokens=tokens, tiles=tiles)

    geometry = PageGeometry.build(model.layout)
    longest = max([a.prompt_len] + ttft_lens)
    cfg = SchedulerConfig(max_num_batched_tokens=longest, chunk=longest, max_num_seqs=max(batches))
    frames = max(sum(promise_for(geometry, a.prompt_len, a.new_tokens, cfg.chunk).frames for _ in range(max(batches))),
                 promise_for(geometry, longest, 2, cfg.chunk).frames) + 8
    engines = {}
    results, distinct = {}, {}
    for b in batches:
        prompts = prompts_for(model, b, a.prompt_len, a.seed + b)
        for name in ("eager", "inductor"):
            def run():
                if name not in engines:
                    engines[name] = (LLM.paged(model, num_frames=frames, config=cfg) if name == "eager" else
                                     LLM(InductorEngine(model, geometry, frames, "default", "layers"), frames, cfg,
                                         eos_ids=model.config.eos_token_ids))
                llm = engines[name]
                t = time.perf_counter()
                r = run_llm(llm, prompts, a.new_tokens)
                results[(name, b)] = r
                if name == "eager":  # count the experts the routers choose in these decode steps
                    census = ExpertCensus(model, b)
                    try:
                        # long enough that all b sequences decode together for a few steps: with a token
                        # budget of one prompt, the prefills run one per step beside the earlier decodes
                        llm.generate(prompts, SamplingParams(max_new_tokens=2 * b + 4, ignore_eos=True))
                    finally:
                        census.close()
                    distinct[b] = census.distinct()
                eager = results.get(("eager", b), {}).get("tokens")
                roof = moe_roofline(model, b, a.prompt_len + a.new_tokens, distinct[b], ceil) if b in distinct else {}
                log({"stage": name, "batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "decode_tok_s_per_seq": round(r["decode_tok_s_per_seq"], 2),
                     "decode_tok_s_total": round(r["decode_tok_s_total"], 1), **roof,
                     "of_roofline": round(r["decode_tok_s_total"] / roof["roofline_tok_s_total"], 3) if roof else None,
                     "ttft_s": round(r["ttft_s"], 3), "stage_s": round(time.perf_counter() - t, 1),
                     "warmup_s": r["warmup_s"], "tokens_equal_eager": None if eager is None else r["tokens"] == eager,
                     "first_difference_at": first_differences(r["tokens"], eager or [])})
                if a.profile and name == "inductor" and b == 1:
                    non_expert = active_weight_bytes(model, [0] * len(distinct[b]), b)  # what cuBLAS reads
                    log(decode_profile(llm.engine, model, b, roof["active_weight_bytes"], matmul_bytes=non_expert))
                return eager is None or r["tokens"] == eager
            ok &= bool(stage(run, name, batch=b))
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    if "inductor" in engines:
        for n in ttft_lens:
            prompt = prompts_for(model, 1, n, a.seed + n)
            stage(lambda: log({"stage": "ttft", "engine": "inductor", "prompt_len": n,
                               **time_to_first_token(lambda p: engines["inductor"].generate(p, one), prompt)}),
                  "ttft", engine="inductor", prompt_len=n)
    engines.clear()
    gc.collect()
    torch.cuda.empty_cache()
    if not a.skip_hf:
        def hf_stages():
            hf = hf_model_from(model)
            for n in ttft_lens:
                ids = torch.tensor(prompts_for(model, 1, n, a.seed + n), device="cuda")
                with torch.inference_mode():
                    log({"stage": "ttft", "engine": "hf", "prompt_len": n, **time_to_first_token(
                        lambda p: hf.generate(p, max_new_tokens=1, min_new_tokens=1, do_sample=False), ids)})
            r = hf_decode(hf, prompts_for(model, 1, a.prompt_len, a.seed + 1), a.new_tokens)
            ours = results.get(("eager", 1), {}).get("tokens")
            log({"stage": "hf", "batch": 1, "decode_tok_s_per_seq": round(r["decode_tok_s_per_seq"], 2),
                 "prefill_s": round(r["prefill_s"], 3), "tokens_equal_eager": r["tokens"] == ours,
                 "first_difference_at": first_differences(r["tokens"], ours or [])})
        stage(hf_stages, "hf")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
