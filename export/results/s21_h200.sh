#!/usr/bin/env bash
# H200 calls of session 21, a fresh process per arm, arms alternated. One PART per call:
#
#   prof    batch-1 decode of each of $MODELS (default e4b e2b), this checkout: `bench.engine --config MODEL
#           --skip-hf --batches 1 --new-tokens 32 --profile`, whose decode_profile record now holds the replayed
#           graph's exposed time by launch (bench/engine.py replay_exposure)
#   mm      decode's matmuls role by role at batch 1 for each of $MODELS (default e4b e2b), this checkout:
#           `bench.engine --config MODEL --matmuls --batches 1` (cuBLAS and the skinny matmul's tiles and splits)
#   b1      the same for each of $MODELS (default e4b), arms $ARMS (default base new base new base new): base =
#           ab/base (the tree before), new = this checkout
#   moe     batch-1 decode of the 26B-A4B, arms $ARMS (default new base new base): `bench.moe --config 26b-a4b
#           --batches 1 --ttft "" --skip-hf --profile`
#
# The calls (ab/base: ff11de1 in every call):
#   1  prof  refused (no machine started), ~90 s of the budget
#   2  b1    MODELS=e4b ARMS="new base new base new base": aac90b1 with plugins/triton_gemv.py as
#            `export/results/h200_s21_tile_prologue.patch` makes ff11de1's (the prologue tile by tile in the K loop)
#   3  b1    MODELS=e4b ARMS="new base new base new base", budget 400: aac90b1 (the rows formed whole, per program)
#   4  mm    MODELS="e4b e2b" (default), budget 330: aac90b1
#   5  b1    MODELS=e2b ARMS="new base new base new base", budget 330: d845102 (aac90b1's code, its tests)
#   6  moe   ARMS="new base new base" (default), budget 520: 3ded4bf with this script's moe part (committed in
#            2a9b82c); the code is aac90b1's
#   7  b1    MODELS=e2b ARMS=new, budget 140: 7dbdd66 (the exposure accounting refactored into bench.engine.exposure;
#            same kernels): 421.2 tok/s, replay 2.359 ms, tokens equal eager
#   8  b1    MODELS="e2b e4b" ARMS=new, budget 200: 9918f99 (the review: the prologue's second norm weight loaded only
#            where it is used): E2B 421.7 tok/s, replay 2.363 ms; E4B 261.8 tok/s (57.0 %), 3.798 ms; tokens equal eager
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s21_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: prof, mm, moe or b1}
BUDGET=${2:-570}
TAG=s21-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  prof) batch1 150 "e4b e2b" "new" ;;
  mm) for m in ${MODELS:-e4b e2b}; do arm new 1 mm_$m 150 engine --config $m --matmuls --batches 1; done ;;
  moe)
    n=0
    for a in ${ARMS:-new base new base}; do
      n=$((n + 1)); arm $a $n b1_26b 150 moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile
    done
    ;;
  b1) batch1 100 e4b "base new base new base new" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
