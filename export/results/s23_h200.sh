#!/usr/bin/env bash
# H200 calls of session 23, a fresh process per arm, arms alternated. One PART per call:
#
#   b1      the GPU test of the tail launch (tests/test_plugins_gemv.py -k on_the_gpu), then batch-1 decode of each of $MODELS (default "e4b e2b"), arms $ARMS (default base new base new base new):
#           `bench.engine --config MODEL --skip-hf --batches 1 --new-tokens 32 --profile`; base = ab/base (the tree
#           before), new = this checkout, any other arm = ab/ARM (a tree the call carries)
#   p31     one 31B process at batch 128 and 256, the decode step profiled by launch (`bench.engine --config 31b
#           --skip-hf --engines inductor --batches 128,256 --prompt-len 224 --new-tokens 16 --profile`)
#
# The calls (ab/base: cebea4d in every call, session 22's last commit):
#   1  b1    MODELS=e4b, budget 585: dbf3db5 (the layer's tail in the PLE projection's last program,
#            `g4rt::linear_add_rms_norm`; reverted in bfe8525, kept as h200_s23_tail.patch). Its GPU test
#            ran from that tree: `TRITON_INTERPRET=0 python3 -m pytest -q -x tests/test_plugins_gemv.py -k on_the_gpu`
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s23_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: b1 or p31}
BUDGET=${2:-570}
TAG=s23-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) run_part tail_test 150 env TRITON_INTERPRET=0 python3 -m pytest -q -x tests/test_plugins_gemv.py -k on_the_gpu
      batch1 100 "e4b e2b" "base new base new base new" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
