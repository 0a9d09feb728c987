#!/usr/bin/env bash
# H200 calls of session 20, a fresh process per arm, arms alternated. One PART per call:
#
#   pre     batch-1 decode of MODEL (default e4b) with the skinny matmul reading its first PRE_TILES weight tiles
#           before its wait (plugins/triton_gemv.py): `bench.engine --config MODEL --skip-hf --batches 1
#           --new-tokens 32 --profile`, arms $ARMS (default base new pre4 base new pre4): base = ab/base (one tile,
#           the tree before), new = this checkout, pre4 = ab/pre4 (this checkout with PRE_TILES = 4).
#   merge   a split decode's last program merging the partials (no combine launch; plugins/triton_attention.py
#           MERGE): the decode kernels at short context against the reference (`bench.kernels --decode-short`,
#           this checkout), then batch-1 decode of each of $MODELS (default e4b e2b) as in `pre`, arms $ARMS
#           (default base new base new).
#   b1      batch-1 decode of each of $MODELS (default e4b) as in `pre`, arms $ARMS (default base new).
#
# The calls, each on the tree named (ab/base: 8fd661c in every call):
#   1  pre   the new and pre4 arms did not compile (the pre-wait tile reused the loop's variable `k` with another
#            shape; their records hold the CompilationError); base ran twice
#   2  pre   `export/results/h200_s20_pre_tiles.patch` on 8fd661c (PRE_TILES = 2; pre4: 4), MODEL=e4b
#   3-7      refused or not asked (no machine): with their charges and three fresh starts, 325 s of the 1,800 were
#            left after call 8, too little for another A/B
#   8  merge `export/results/h200_s20_merge.patch` on 479e33e (the split programs merge; the combine kernel only
#            for TensorRT), MODELS="e4b e2b"
#   9  b1    59e10e5 (the row kernels' ROWS constexpr, one row a program on the GPU), MODELS=e4b, budget 200
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s20_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: pre, merge or b1}
BUDGET=${2:-570}
TAG=s20-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  pre) batch1 150 "${MODEL:-e4b}" "base new pre4 base new pre4" ;;
  merge)
    run_part decode_short 120 python3 -m g4rt.bench.kernels --out "$OUT/k" --decode-short
    cp "$OUT/k/results.json" "$OUT/decode_short.json" 2>/dev/null; rm -rf "$OUT/k"
    batch1 150 "e4b e2b" "base new base new"
    ;;
  b1) batch1 100 e4b "base new" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
