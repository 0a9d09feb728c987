#!/usr/bin/env bash
# H200 calls for the decode split rule (decode_splits: no split under 16,384 key elements per head) and
# the Triton skinny matmul on the packed q/k/v and the lm_head (g4rt::skinny_linear). One PART per call:
#
#   ab    E2B (2 per arm) and 31B (1 per arm) batch-1 decode, three arms alternated, a fresh process each:
#         base (ab/base, the commit before both), splits (ab/splits, the split rule only) and new (this
#         checkout): greedy tokens against the eager engine, tok/s, the decode graph's replay and its
#         kernels by kind (bench.engine --profile); then the E2B's matmul roles, cuBLAS against the
#         skinny matmul (--matmuls), and the short-context decode attention sweep (bench.kernels
#         --decode-short, forced splits 1-32).
#   big   this checkout's 31B decode step wall vs replay at batch 1, 64, 128, 256 (2 repetitions) and the
#         8k time to first token.
#   prof  where the 31B's batch-64 and batch-256 decode steps go: the decode graph's kernels by kind
#         (--profile, 32 new tokens so that every sequence decodes in one step) and each matmul role at
#         those batches (--matmuls); the 26B-A4B at batch 1 and 8 (bench.moe: tokens against eager,
#         tok/s against the active-weight roofline, the batch-1 profile).
#   clocks (not run in session 10) the batch-256 decode steps again with `nvidia-smi dmon` sampling the
#         SM clock and power every second beside them: the decode-steps run replayed the batch-256 graph
#         in 44-46 ms at context ~200 where the profile replayed it in 34-37 ms at ~160, and the context
#         explains only ~2.4 ms of that.
#   moe   the 26B-A4B at batch 1, base against new (bench.moe, one arm each), and its matmul roles at
#         batch 1 and 8, cuBLAS against the skinny matmul (--matmuls): the op's width rule was set on
#         the 31B's shapes.
#
#     git archive --prefix=ab/base/g4rt/ 1f5e15f | tar -x; git archive --prefix=ab/splits/g4rt/ 3ebb29a | tar -x
#     bash export/results/s10_h200.sh PART [budget_s]   # default 560 s; results under $OUT; carry ab
PART=${1:?PART: ab, big, prof, clocks or moe}
BUDGET=${2:-560}
TAG=s10-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
small=(--skip-hf --batches 1 --new-tokens 32 --profile)
case $PART in
  ab)
    for rep in 1 2; do
      for a in base splits new; do arm $a $rep e2b 80 engine --config e2b "${small[@]}"; done
    done
    for a in base splits new; do arm $a 1 31b 90 engine --config 31b "${small[@]}"; done
    run_part matmuls_e2b 60 python3 -m g4rt.bench.engine --config e2b --out "$OUT/m_e2b" --skip-hf --batches 1,8 \
      --matmuls
    cp "$OUT/m_e2b/export_bench.jsonl" "$OUT/matmuls_e2b.jsonl" 2>/dev/null; rm -rf "${OUT:?}/m_e2b"
    run_part kernels_short 110 python3 -m g4rt.bench.kernels --out "$OUT/short" --decode-short
    ;;
  big)
    run_part big 330 python3 -m g4rt.bench.engine --config 31b --out "$OUT/31b" --skip-hf --batches "" \
      --engines inductor --decode-steps 1,64,128,256 --reps 2 --ttft 8192 --ttft-chunks 2048,8192
    cp "$OUT/31b/export_bench.jsonl" "$OUT/engine_31b.jsonl" 2>/dev/null; rm -rf "$OUT/31b"
    ;;
  prof)
    run_part profile 200 python3 -m g4rt.bench.engine --config 31b --out "$OUT/p" --skip-hf --batches 64,256 \
      --new-tokens 32 --engines inductor --profile
    run_part matmuls 80 python3 -m g4rt.bench.engine --config 31b --out "$OUT/m" --skip-hf --batches 64,256 --matmuls
    run_part moe 200 python3 -m g4rt.bench.moe --config 26b-a4b --out "$OUT/moe" --batches 1,8 --new-tokens 32 \
      --ttft '' --skip-hf --profile
    cat "$OUT"/p/export_bench.jsonl > "$OUT/profile_31b.jsonl" 2>/dev/null
    cat "$OUT"/m/export_bench.jsonl > "$OUT/matmuls_31b.jsonl" 2>/dev/null
    cat "$OUT"/moe/*.jsonl > "$OUT/moe_26b.jsonl" 2>/dev/null
    rm -rf "$OUT/p" "$OUT/m" "$OUT/moe"
    ;;
  clocks)
    nvidia-smi dmon -s pcu -d 1 > "$OUT/dmon.txt" 2>&1 &
    dmon=$!
    run_part steps256 300 python3 -m g4rt.bench.engine --config 31b --out "$OUT/s" --skip-hf --batches "" \
      --engines inductor --decode-steps 256 --reps 3
    kill $dmon
    cp "$OUT/s/export_bench.jsonl" "$OUT/steps_31b_b256.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    ;;
  moe)
    for a in base new; do
      arm $a 1 moe_26b 110 moe --config 26b-a4b --batches 1 --new-tokens 32 --ttft '' --skip-hf --profile
    done
    run_part matmuls 60 python3 -m g4rt.bench.engine --config 26b-a4b --out "$OUT/m" --skip-hf --batches 1,8 --matmuls
    cp "$OUT/m/export_bench.jsonl" "$OUT/matmuls_26b.jsonl" 2>/dev/null; rm -rf "$OUT/m"
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
