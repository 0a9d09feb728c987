#!/usr/bin/env bash
# H200 calls of session 23, a fresh process per arm, arms alternated. One PART per call:
#
#   b1      batch-1 decode of each of $MODELS (default "e4b e2b"), arms $ARMS (default base new base new base new):
#           `bench.engine --config MODEL --skip-hf --batches 1 --new-tokens 32 --profile`; base = ab/base (the tree
#           before), new = this checkout, any other arm = ab/ARM (a tree the call carries)
#   p31     one 31B process at batch 128 and 256, the decode step profiled by launch (`bench.engine --config 31b
#           --skip-hf --engines inductor --batches 128,256 --prompt-len 224 --new-tokens 16 --profile`)
#   n31     the q/k/v norm kernel's tiles at 64, 128 and 256 tokens (`bench.kernels --norms --norm-tokens
#           64,128,256`; NORMS=0 skips it), then the 31B's decode steps at the batches $STEPS (default 128), arms
#           $ARMS (default base new base new base new), a process each: `bench.engine --config 31b --skip-hf
#           --batches "" --engines inductor --decode-steps $STEPS --reps 3` (three contexts as the requests grow)
#
# The calls (ab/base: cebea4d in every call, session 22's last commit):
#   1  b1    MODELS=e4b, budget 585: dbf3db5 (the layer's tail in the PLE projection's last program,
#            `g4rt::linear_add_rms_norm`; reverted in bfe8525, kept as h200_s23_tail.patch). Before the arms it ran
#            that tree's GPU test: `TRITON_INTERPRET=0 python3 -m pytest -q -x tests/test_plugins_gemv.py -k on_the_gpu`
#   2  b1    budget 585: 53c222e (the first weight tile's product after the K loop, so that the loop's pipelined
#            loads are issued right after the wait; reverted in 098c275, kept as h200_s23_first_tile_last.patch)
#   3  p31   budget 480, at 098c275 (the kernels of cebea4d)
#   4  n31   budget 560: 9f456f7 (the q/k/v norm kernel's 4-token tile from 128 tokens, 256 before)
#   5  n31   NORMS=0 STEPS=64,128, budget 280: ea69ff1 (the 4-token tile from 2,560 one-token programs, tokens x
#            heads, NORM_ROPE_MIN_PROGRAMS: the 31B's from 40 tokens); the machine was taken back, no results
#   6  n31   NORMS=0 STEPS=64, budget 195, ea69ff1: the budget ended before the sixth arm (two processes new)
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s23_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: b1, p31 or n31}
BUDGET=${2:-570}
TAG=s23-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) batch1 100 "e4b e2b" "base new base new base new" ;;
  p31) run_part p31 "$BUDGET" python3 -m g4rt.bench.engine --config 31b --out "$OUT/p31" --skip-hf --engines inductor \
         --batches 128,256 --prompt-len 224 --new-tokens 16 --profile ;;
  n31) [ "${NORMS:-1}" = 0 ] || run_part norms 90 python3 -m g4rt.bench.kernels --out "$OUT/norms" --norms \
         --norm-tokens 64,128,256
       each_arm "${ARMS:-base new base new base new}" steps_31b 110 engine --config 31b --skip-hf --batches "" \
         --engines inductor --decode-steps "${STEPS:-128}" --reps 3 ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
