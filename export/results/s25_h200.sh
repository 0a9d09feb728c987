#!/usr/bin/env bash
# H200 calls of session 25: the cuBLASLt rule (plugins/triton_gemv.py: cublaslt_takes) in the step where session 24
# measured it only role by role. One PART per call, arms $ARMS (default base new base new base new), a process each;
# base = ab/base (cccf4a9: cuBLAS for every matmul the Triton kernel does not take), new = this checkout:
#
#   b16   the 31B's decode steps at batch 16 (`bench.engine --config 31b --skip-hf --batches "" --engines inductor
#         --decode-steps 16 --reps 3`, three contexts as the requests grow)
#   moe   the 26B-A4B's decode steps at batches 16 and 64, the same command with `--config 26b-a4b --decode-steps 16,64`
#         (its o_proj, N 2,816 and K 4,096, is the weight the rule gives cuBLASLt at 9-64 rows)
#   board issue 12's targets in one process of this checkout, HF beside: the 31B at batch 1 (eager, inductor, HF),
#         its decode steps at 64 / 128 / 256 and its time to first token at 2,048 / 8,192 with 2,048-token chunks
#         (`bench.engine --config 31b --batches 1 --new-tokens 64 --decode-steps 64,128,256 --ttft 2048,8192
#         --ttft-chunks 2048 --reps 3`)
#   b1    $MODELS (default 31b) at batch 1, arms alternated (`bench.engine --config M --skip-hf --batches 1 --new-tokens
#         32`), base = ab/base at a00500a (the tree of session 18's batch-1 record, h200_s18_call8_b1_31b.jsonl)
#   small the E4B and E2B at batch 1, eager, inductor and HF, $REPS (default 3) processes each, models alternated
#         (`bench.engine --config M --batches 1 --new-tokens 32`); the SM clock and power sampled each second (clocks.csv)
#   handoff  a stage hand-off: `bench.handoff` (every arm in one process, then a process an arm, alternated, three
#            each: `--arms A` for A in $HANDOFF_ARMS, default launches persistent prefetch; $HANDOFF_FLAGS added to each)
#
# The calls:
#   1  b16    budget 420, at 2144d2e (this script as 78d9de0 has it), ab/base = cccf4a9
#   2  moe    budget 540, the same tree and base
#   3  board  budget 570, at 78d9de0
#   4  b1     budget 520, at 190aac4, ab/base = a00500a
#   5  small  budget 500, at cca54b3
#   6  handoff  budget 480, at f5c3c0f (the launches and persistent arms; the process of both named handoff_both)
#   7  handoff  budget 400, at 5eb2316 (the three arms, prefetch in slices of 32 rows)
#   8  handoff  budget 240, at 6c8c1e4, HANDOFF_ARMS="launches prefetch" HANDOFF_FLAGS="--prefetch-block-n 16 --dims
#               1024,2048,2560"
#   9  handoff  budget 240, at fb25ca1, the same arms and flags as call 8 (the prefetch arm reads x in one round trip)
#   10 (not run: too little device time was left to start a machine) handoff at d80ba5f, HANDOFF_ARMS="launches
#               prefetch" HANDOFF_FLAGS="--prefetch-block-n 16 --prefetch-slots 2 --dims 1024,2048"
#
#     git archive --prefix=ab/base/g4rt/ cccf4a9 | tar -x   # the base arm (a00500a for b1)
#     bash export/results/s25_h200.sh PART [budget_s]      # default 570 s; results under $OUT
PART=${1:?PART: b16, moe, board, b1, small or handoff}
BUDGET=${2:-570}
TAG=s25-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
ARMS=${ARMS:-base new base new base new}  # b16, moe and b1
case $PART in
  b16) each_arm "$ARMS" steps_31b_b16 90 engine --config 31b --skip-hf --batches "" --engines inductor \
         --decode-steps 16 --reps 3 ;;
  moe) each_arm "$ARMS" steps_26b 150 engine --config 26b-a4b --skip-hf --batches "" --engines inductor \
         --decode-steps 16,64 --reps 3 ;;
  board) run_arm /tmp/pkg new 1 board_31b "$BUDGET" engine --config 31b --batches 1 --new-tokens 64 \
           --decode-steps 64,128,256 --ttft 2048,8192 --ttft-chunks 2048 --reps 3 ;;
  b1) batch1 80 31b "$ARMS" ;;
  small) nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 1000 \
           > "$OUT/clocks.csv" 2>&1 & sampler=$!
         for rep in $(seq "${REPS:-3}"); do
           for m in e4b e2b; do
             run_arm /tmp/pkg new "$rep" board_$m 90 engine --config $m --batches 1 --new-tokens 32
           done
         done
         kill $sampler ;;
  handoff) run_part handoff_all 150 python3 -m g4rt.bench.handoff --out "$OUT/handoff_all" \
             --arms "$(echo ${HANDOFF_ARMS:-launches persistent prefetch} | tr ' ' ,)" ${HANDOFF_FLAGS:-}
           for rep in 1 2 3; do
             for a in ${HANDOFF_ARMS:-launches persistent prefetch}; do
               run_arm /tmp/pkg $a $rep handoff 90 handoff --arms $a ${HANDOFF_FLAGS:-}
             done
           done
           cp "$OUT/handoff_all/handoff.jsonl" "$OUT/handoff_all.jsonl" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
