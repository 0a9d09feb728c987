#!/usr/bin/env bash
# H200 calls of session 22, a fresh process per arm, arms alternated. One PART per call:
#
#   b1      batch-1 decode of each of $MODELS (default e4b), arms $ARMS (default base new base new base new):
#           `bench.engine --config MODEL --skip-hf --batches 1 --new-tokens 32 --profile`; base = ab/base (the tree
#           before), new = this checkout, any other arm = ab/ARM (a tree the call carries)
#
# The calls (ab/base: debd3c5 in every call, the code of session 21's review 9918f99):
#   1  b1    ARMS="base new ef base new ef base new ef" MODELS=e4b, budget 575: 694a60f (every gemv program asks L2
#            for the start of its weight rows before it waits, `h200_s22_prefetch.patch`); ef = 694a60f with
#            `h200_s22_evict_first.patch` (the weight tiles loaded evict-first)
#   2  (no part) the tile sweep at f83b15b, where bench/gemv_sweep.py was export/results/s22_gemv_sweep.py:
#            for s in "2560 10240 24" "2560 2048 48" "20480 2560 12" "1536 6144 24"; do set -- $s
#              python3 export/results/s22_gemv_sweep.py --shape $1 $2 --layers $3 --out $OUT/sweep.jsonl; done
#            (now `python -m g4rt.bench.gemv_sweep --shape $1 $2 --layers $3 --out $OUT`, records in gemv_sweep.jsonl)
#   3  b1    ARMS="base s3 s3g base s3 s3g base s3 s3g" MODELS=e4b, budget 560: s3 = f83b15b with MODEL_CONFIG at 3
#            stages; s3g = f83b15b with the packed gate/up's GELU launches at 3 stages (what 1331d58 commits)
#   4  b1    ARMS="base new base new base new" MODELS=e2b, budget 330, then ARMS="new new" MODELS=e4b, budget 150:
#            1331d58 (3 stages for every packed gate/up with the GELU epilogue)
#   5  b1    ARMS=new MODELS="e2b e4b", budget 200: f27df65 (3 stages from K of 2,560 on: the E4B's only)
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s22_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: b1}
BUDGET=${2:-570}
TAG=s22-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) batch1 100 e4b "base new base new base new" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
