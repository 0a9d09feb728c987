#!/usr/bin/env bash
# H200 calls for the fused layer tails (the tail of each layer, post-norm + residual + layer scalar +
# the next layer's input norm, one kernel; a KV-shared layer's q norm and RoPE, one kernel) and the
# attention sweeps that set the next defaults. One PART per device call:
#
#   fuse    E2B and E4B batch-1 decode, the package in ab/old (the commit before the fused tails, from
#           `git archive`, carried) against this checkout, arms alternated, a fresh process each (E2B 2
#           per arm, E4B 1): greedy tokens against the eager engine, the decode graph's replay and its
#           kernels by kind (bench.engine --profile); then the E2B's matmul roles (as `gemv`).
#   fuse31  the same for the 31B at batch 1, one arm each, then the kernel sweeps: batch-1 decode
#           attention of the E2B, E4B and 31B layers at short context with forced split counts
#           (bench.kernels --decode-short) and the head-dim-512 8k prefill tiles (--prefill-only
#           --layers 31B-full).
#   big     this checkout's 31B decode step wall vs replay at batch 1, 64, 128, 256 (2 repetitions), the
#           8k time to first token, and a profile of the batch-256 decode step by kernel kind.
#   gemv    every decode matmul role of the 31B at batch 1 and 8, cuBLAS against the Triton skinny
#           matmul (plugins/triton_gemv.py) over its configs (bench.engine --matmuls).
#   moe     the 26B-A4B at batch 1 and 8 with the MoE block's fused norms, ab/old against this checkout,
#           one arm each: tokens against eager, tok/s against its roofline, the batch-1 profile (bench.moe).
# In order of what they decide: fuse, fuse31, gemv, moe, big (each about one 10-minute call).
#
#     git archive --prefix=ab/old/g4rt/ b9b968a | tar -x   # once, before `fuse` / `fuse31` (ab/ is ignored)
#     bash export/results/s9_h200.sh PART [budget_s]      # default 560 s; results under $OUT; carry ab/old
PART=${1:?PART: fuse, fuse31, gemv, moe or big}
BUDGET=${2:-560}
TAG=s9-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
OLD=$PWD/ab/old
# ab ARM REP NAME CAP BENCH ARGS...: run_arm with the package of ARM (old: ab/old, new: this checkout).
ab() {
  local pkg=/tmp/pkg
  [ "$1" = old ] && pkg=$OLD
  run_arm "$pkg" "$@"
}
# matmuls MODEL: its decode matmul roles, cuBLAS and the Triton skinny matmul, to $OUT/matmuls_MODEL.jsonl.
matmuls() {
  run_part "matmuls_$1" 300 python3 -m g4rt.bench.engine --config "$1" --out "$OUT/m_$1" --skip-hf \
    --batches 1,8 --matmuls
  cp "$OUT/m_$1/export_bench.jsonl" "$OUT/matmuls_$1.jsonl" 2>/dev/null; rm -rf "${OUT:?}/m_$1"
}
small=(--skip-hf --batches 1 --new-tokens 32 --profile)
case $PART in
  fuse)
    for rep in 1 2; do
      for arm in old new; do ab $arm $rep e2b 110 engine --config e2b "${small[@]}"; done
    done
    for arm in old new; do ab $arm 1 e4b 120 engine --config e4b "${small[@]}"; done
    matmuls e2b
    ;;
  fuse31)
    for arm in old new; do ab $arm 1 31b 170 engine --config 31b "${small[@]}"; done
    run_part kernels_short 100 python3 -m g4rt.bench.kernels --out "$OUT/short" --decode-short
    run_part kernels_prefill 120 python3 -m g4rt.bench.kernels --out "$OUT/prefill" --prefill-only --layers 31B-full
    ;;
  big)
    run_part big 330 python3 -m g4rt.bench.engine --config 31b --out "$OUT/31b" --skip-hf --batches "" \
      --engines inductor --decode-steps 1,64,128,256 --reps 2 --ttft 8192 --ttft-chunks 2048,8192
    run_part b256 200 python3 -m g4rt.bench.engine --config 31b --out "$OUT/31b_b256" --skip-hf --batches 256 \
      --new-tokens 8 --engines inductor --profile
    cat "$OUT"/31b*/export_bench.jsonl > "$OUT/engine_31b.jsonl" 2>/dev/null
    rm -rf "$OUT/31b" "$OUT/31b_b256"
    ;;
  gemv)
    matmuls 31b
    ;;
  moe)
    for arm in old new; do
      ab $arm 1 26b 270 moe --config 26b-a4b --batches 1,8 --new-tokens 32 --ttft '' --skip-hf --profile
    done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
