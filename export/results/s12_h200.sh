#!/usr/bin/env bash
# H200 calls of session 12. One PART per call:
#
#   sweep  (run on b0ed87d with h200_s12_sweep_splitk.patch applied: `git apply` it first) the E2B's
#          staggered requests (piecewise steps against the compiled module on the same batch, tokens
#          against eager: c961588's capture-time zeroing run on the GPU for the first time, with the
#          patch's `g4rt::skinny_linear` on every matmul of a layer); decode's matmuls role by role at
#          batch 1 and 8 for the 31B and the E2B, cuBLAS against the skinny matmul's configs, with the
#          patch's splits over K and the config its rule takes (--matmuls: op_config, op_ms); the 31B's
#          8k time to first token with its prefill's kernels by kind and, profiled once more with the
#          host's ops, what the host does before the first kernel and after the last (ttft_host).
#   ab     base (ab/base: b0ed87d) against new (this checkout: head-dim-512 prefill attention on 128x32
#          tiles with 2 stages, and each cache-owning layer's K/V write inside its attention launch,
#          `g4rt::kv_write_attend_`): the 31B's decode steps at batch 1 and 256 and the 8k time to first
#          token (chunks 2,048 and 8,192), 2 repetitions inside each process, arms alternated twice, a
#          fresh process each.
#          (Measured slower at decode and reverted: 4ade870.)
#   ab2    base (ab/base: b0ed87d) against new (this checkout: head-dim-512 prefill attention on 128x32
#          tiles with 2 stages, without the fused write): the two 16-key head-dim-512 tiles added to the
#          prefill sweep first (bench.kernels --prefill-only --layers 31B-full); then the 31B's 8k time
#          to first token (one 8,192 chunk, 3 rounds, its prefill's kernels by kind: --profile), arms
#          alternated twice, a fresh process each; then the 31B's decode steps at batch 64 and 128.
#   pdl    base (ab/base: ba9d27f) against new (this checkout: the step's Triton kernels launched with
#          programmatic dependent launch, waiting for their inputs at their start; the skinny matmul
#          reads its first weight tile before that wait): the E2B's staggered requests (new: tokens
#          against eager, piecewise steps against the compiled module), then batch 1 (tokens against
#          eager, tok/s, decode profile) of the 31B twice and of the E2B once per arm, arms alternated.
#   last   new only, one process: the 31B's decode steps at batch 1, 64, 128 and 256 with the dependent
#          launches (one repetition each; what the device time left allowed).
#
#     git archive --prefix=ab/base/g4rt/ b0ed87d | tar -x   # for ab and ab2 (ba9d27f for pdl); carry ab
#     bash export/results/s12_h200.sh PART [budget_s]   # default 560 s; results under $OUT
PART=${1:?PART: sweep, ab, ab2, pdl or last}
BUDGET=${2:-560}
TAG=s12-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  sweep)
    run_part staggered_e2b 120 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    run_part matmuls_31b 150 python3 -m g4rt.bench.engine --config 31b --out "$OUT/m31" --skip-hf --batches 1,8 \
      --matmuls
    run_part matmuls_e2b 80 python3 -m g4rt.bench.engine --config e2b --out "$OUT/me2" --skip-hf --batches 1,8 \
      --matmuls
    run_part ttft_31b 200 python3 -m g4rt.bench.engine --config 31b --out "$OUT/t" --skip-hf --batches "" \
      --engines inductor --ttft 8192 --ttft-chunks 8192 --reps 2 --profile
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null
    cat "$OUT/m31/export_bench.jsonl" > "$OUT/matmuls_31b.jsonl" 2>/dev/null
    cat "$OUT/me2/export_bench.jsonl" > "$OUT/matmuls_e2b.jsonl" 2>/dev/null
    cat "$OUT/t/export_bench.jsonl" > "$OUT/ttft_31b.jsonl" 2>/dev/null
    rm -rf "$OUT/s" "$OUT/m31" "$OUT/me2" "$OUT/t"
    ;;
  ab)
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep steps_ttft_31b 140 engine --config 31b --skip-hf --batches "" --engines inductor \
          --decode-steps 1,256 --reps 2 --ttft 8192 --ttft-chunks 2048,8192
      done
    done
    ;;
  ab2)
    run_part prefill_d512 90 python3 -m g4rt.bench.kernels --out "$OUT/p" --prefill-only --layers 31B-full
    cp "$OUT/p/results.json" "$OUT/prefill_d512.json" 2>/dev/null; rm -rf "$OUT/p"
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep ttft_31b 100 engine --config 31b --skip-hf --batches "" --engines inductor --ttft 8192 \
          --ttft-chunks 8192 --reps 3 --profile
      done
    done
    run_part steps_31b 130 python3 -m g4rt.bench.engine --config 31b --out "$OUT/d" --skip-hf --batches "" \
      --engines inductor --decode-steps 64,128 --reps 2
    cat "$OUT/d/export_bench.jsonl" > "$OUT/steps_31b_b64_b128.jsonl" 2>/dev/null; rm -rf "$OUT/d"
    ;;
  pdl)
    small=(--skip-hf --batches 1 --new-tokens 32 --profile)
    run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    for rep in 1 2; do
      for a in base new; do arm $a $rep b1_31b 90 engine --config 31b "${small[@]}"; done
    done
    for a in base new; do arm $a 1 b1_e2b 60 engine --config e2b "${small[@]}"; done
    ;;
  last)
    run_part steps_31b 170 python3 -m g4rt.bench.engine --config 31b --out "$OUT/d" --skip-hf --batches "" \
      --engines inductor --decode-steps 1,64,128,256 --reps 1
    cat "$OUT/d/export_bench.jsonl" > "$OUT/steps_31b.jsonl" 2>/dev/null; rm -rf "$OUT/d"
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
