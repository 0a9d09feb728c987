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
#   ab     base (ab/base: 161cf1a, cuBLAS for o_proj, gate/up, down and the PLE matmuls) against new (this
#          checkout: `g4rt::skinny_linear` on every matmul of a layer, split over K where a weight is
#          narrow): batch-1 decode (tokens against eager, tok/s, decode profile) of the 31B, the E2B and
#          the E4B, arms alternated, a fresh process each.
#
#     git archive --prefix=ab/base/g4rt/ 161cf1a | tar -x   # for ab; carry ab
#     bash export/results/s12_h200.sh PART [budget_s]   # default 560 s; results under $OUT
PART=${1:?PART: sweep or ab}
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
    arm() { local pkg=/tmp/pkg; [ "$1" != new ] && pkg=$PWD/ab/$1; run_arm "$pkg" "$@"; }
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep b1_31b 110 engine --config 31b --skip-hf --batches 1 --new-tokens 48 --profile
      done
    done
    for a in base new; do
      arm $a 1 b1_e2b 60 engine --config e2b --skip-hf --batches 1 --new-tokens 48 --profile
      arm $a 1 b1_e4b 60 engine --config e4b --skip-hf --batches 1 --new-tokens 48 --profile
    done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
