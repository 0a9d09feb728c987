#!/usr/bin/env bash
# H200 calls of session 22, a fresh process per arm, arms alternated. One PART per call:
#
#   b1      batch-1 decode of each of $MODELS (default e4b), arms $ARMS (default base new base new base new):
#           `bench.engine --config MODEL --skip-hf --batches 1 --new-tokens 32 --profile`; base = ab/base (the tree
#           before), new = this checkout, any other arm = ab/ARM
#   moe     batch-1 decode of the 26B-A4B, arms $ARMS (default new base new base): `bench.moe --config 26b-a4b
#           --batches 1 --ttft "" --skip-hf --profile`
#   mm      decode's matmuls role by role at batch 1 for each of $MODELS (default e4b), this checkout:
#           `bench.engine --config MODEL --matmuls --batches 1`
#
# The calls (ab/base: debd3c5 in every call):
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s22_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: b1, moe or mm}
BUDGET=${2:-570}
TAG=s22-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) batch1 100 e4b "base new base new base new" ;;
  moe)
    n=0
    for a in ${ARMS:-new base new base}; do
      n=$((n + 1)); arm $a $n b1_26b 150 moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile
    done
    ;;
  mm) for m in ${MODELS:-e4b}; do arm new 1 mm_$m 150 engine --config $m --matmuls --batches 1; done ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
