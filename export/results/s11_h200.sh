#!/usr/bin/env bash
# H200 calls of session 11. One PART per call:
#
#   where  the 31B's batch-256 decode steps (3 repetitions) with `nvidia-smi dmon` sampling SM clock,
#          power and utilisation every second beside them (the decode-steps run replayed the batch-256
#          graph in 44-46 ms at context ~200 where session 10's profile replayed it in 34-37 ms at ~160),
#          then the 8k time to first token with its prefill's kernels by kind (--ttft 8192 --profile):
#          which of the 0.928 s is matmuls, attention, the rest, and gaps.
#
#   ab     base (ab/base: 61d05b4) against new (this checkout): the q/k/v norm kernel on token tiles for
#          prefill chunks, prefill attention programs numbered longest first, a chunk's slots built a
#          page at a time. The 31B's 8k time to first token (chunks 2,048 and 8,192, 3 rounds, with the
#          prefill's kernels by kind and its idle stretches: --profile), 2 repetitions, arms alternated, a
#          fresh process each; then the E2B at batch 1 (tokens against eager, tok/s, decode profile), one
#          per arm.
#
#   ab2    base (ab/base: 61d05b4) against new (this checkout, with the q/k/v norm tiles set from `tiles`):
#          the 31B's decode steps at batch 1 and 256 and the 8k time to first token (chunks 2,048 and
#          8,192), 2 repetitions inside each process, arms alternated twice, a fresh process each.
#   pw     the piecewise graphs without the q/k/v copies (aliases of the segments' outputs): the E2B's
#          staggered requests (mixed steps; each piecewise step against the compiled module on the same
#          batch, tokens against the eager engine: --staggered), then the 31B's 8k time to first token
#          with 2,048 and 8,192 chunks and their prefill kernels by kind (--profile).
#   last   the batch-256 decode graph profiled at the decode-steps runs' context (prompt 160, 64 new
#          tokens: the last graph replays at ~224), and the 2k time to first token (chunks 2,048, 8,192).
#   tiles  the q/k/v norm kernel's tiles at 8,192, 2,048 and 256 tokens (bench.kernels --norms), then the
#          31B's batch-256 decode graph profiled (--profile, 32 new tokens) with `nvidia-smi dmon` beside
#          it: the clocks of session 10's profile replays (34-37 ms) against the decode-steps runs' (44-46).
#
#     git archive --prefix=ab/base/g4rt/ 61d05b4 | tar -x   # for ab; carry ab
#     bash export/results/s11_h200.sh PART [budget_s]   # default 560 s; results under $OUT
PART=${1:?PART: where, ab, tiles, ab2, pw or last}
BUDGET=${2:-560}
TAG=s11-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  where)
    nvidia-smi dmon -s pcu -d 1 -o T > "$OUT/dmon.txt" 2>&1 &
    dmon=$!
    run_part where 480 python3 -m g4rt.bench.engine --config 31b --out "$OUT/w" --skip-hf --batches "" \
      --engines inductor --decode-steps 256 --reps 3 --ttft 8192 --ttft-chunks 8192 --profile
    kill $dmon
    cp "$OUT/w/export_bench.jsonl" "$OUT/where_31b.jsonl" 2>/dev/null; rm -rf "$OUT/w"
    ;;
  ab)
    # the new q/k/v kernel on the GPU against the torch reference, both tiles, the 31B's head shapes. Its
    # error is relative to |reference| clamped at 1e-3, large where a RoPE output cancels to near 0 (the
    # call printed 0.7-3.9 for q and k); bench.kernels --norms (`tiles`) reports the absolute error instead.
    run_part norm_check 60 python3 -c "
import torch; from g4rt.plugins import triton_norm as tn; from g4rt.models import blocks as ref
from g4rt.models.model import rope_cos_sin
for T, hq, hkv, D, kv in [(3, 32, 16, 256, False), (8195, 32, 16, 256, False), (5, 32, 4, 512, True), (8195, 32, 4, 512, True)]:
    g = torch.Generator(device='cuda').manual_seed(T + D)
    x = torch.randn(T, (hq + hkv * (1 if kv else 2)) * D, device='cuda', generator=g, dtype=torch.bfloat16)
    w = [(0.5 + 0.1 * torch.randn(D, device='cuda', generator=g)).bfloat16() for _ in range(2)]
    cos, sin = rope_cos_sin(1 / (10000 ** (torch.arange(0, D, 2, device='cuda').float() / D)),
                            torch.randint(0, 8192, (T,), device='cuda', generator=g), torch.bfloat16)
    a = (x, w[0], w[1], 1e-6, cos, sin, hq, hkv, kv)
    errs = [((o - r).float().abs() / r.float().abs().clamp_min(1e-3)).max().item() for o, r in zip(tn.qkv_norm_rope(*a), ref.qkv_norm_rope(*a))]
    print({'stage': 'norm_check', 'T': T, 'D': D, 'tile': tn.norm_rope_tile(T, D), 'max_rel_err_q_k_v': errs})
"
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep ttft_31b 110 engine --config 31b --skip-hf --batches "" --engines inductor --ttft 8192 \
          --ttft-chunks 2048,8192 --reps 3 --profile
      done
    done
    for a in base new; do arm $a 1 e2b 80 engine --config e2b --skip-hf --batches 1 --new-tokens 32 --profile; done
    ;;
  ab2)
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep steps_ttft_31b 140 engine --config 31b --skip-hf --batches "" --engines inductor \
          --decode-steps 1,256 --reps 2 --ttft 8192 --ttft-chunks 2048,8192
      done
    done
    ;;
  pw)
    run_part staggered_e2b 150 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    run_part ttft_31b 150 python3 -m g4rt.bench.engine --config 31b --out "$OUT/t" --skip-hf --batches "" \
      --engines inductor --ttft 8192 --ttft-chunks 2048,8192 --reps 2 --profile
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null
    cat "$OUT/t/export_bench.jsonl" > "$OUT/ttft_31b.jsonl" 2>/dev/null
    rm -rf "$OUT/s" "$OUT/t"
    ;;
  last)
    run_part prof256 200 python3 -m g4rt.bench.engine --config 31b --out "$OUT/p" --skip-hf --batches 256 \
      --prompt-len 160 --new-tokens 64 --engines inductor --profile
    run_part ttft2k 100 python3 -m g4rt.bench.engine --config 31b --out "$OUT/t" --skip-hf --batches "" \
      --engines inductor --ttft 2048 --ttft-chunks 2048,8192 --reps 3
    cat "$OUT/p/export_bench.jsonl" > "$OUT/profile_31b_b256_ctx224.jsonl" 2>/dev/null
    cat "$OUT/t/export_bench.jsonl" > "$OUT/ttft2k_31b.jsonl" 2>/dev/null
    rm -rf "$OUT/p" "$OUT/t"
    ;;
  tiles)
    run_part norms 120 python3 -m g4rt.bench.kernels --out "$OUT/n" --norms
    cp "$OUT/n/results.json" "$OUT/norms.json" 2>/dev/null; rm -rf "$OUT/n"
    nvidia-smi dmon -s pcu -d 1 -o T > "$OUT/dmon.txt" 2>&1 &
    dmon=$!
    run_part prof256 300 python3 -m g4rt.bench.engine --config 31b --out "$OUT/p" --skip-hf --batches 256 \
      --new-tokens 32 --engines inductor --profile
    kill $dmon
    cp "$OUT/p/export_bench.jsonl" "$OUT/profile_31b_b256.jsonl" 2>/dev/null; rm -rf "$OUT/p"
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
