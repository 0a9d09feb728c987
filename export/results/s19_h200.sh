#!/usr/bin/env bash
# H200 calls of session 19, a fresh process per arm, arms alternated. One PART per call:
#
#   kern    a persistent Gluon decode kernel (plugins/gluon_decode.py in the trees of calls 1-3, removed after
#           them): the Gluon kernels' tests on the GPU (tests/test_plugins_gluon.py -k "$TESTS", call 1 the whole
#           file, then decode: poisoned arenas against the reference and the Triton kernel, padded buckets,
#           refusals), then the 31B's decode layers at context 200, the default and each ring/CTA count and
#           Triton tile of that tree's BATCH_DECODE (`bench.kernels --decode-batch`), twice.
#   splits  the 31B's decode layers at batch 64/128/256 and context 200 with split counts forced over the unsplit
#           tiles (`bench.kernels --decode-batch --decode-batch-splits`), twice.
#   tiles   the 31B's sliding layer at batch 64/128/256 and context 200 on smaller CTAs (`bench.kernels
#           --decode-batch --decode-batch-tiles`: 16-key tiles, 1-2 warps, 2-4 stages), twice.
#   moe     the 26B-A4B at batch 1 with its full layers' prefill on the Gluon kernel (session 18's default):
#           greedy tokens of the compiled engine against eager, time to first token of 2,048 and 8,192 tokens
#           against HF in the same process (`bench.moe --config 26b-a4b --batches 1 --ttft 2048,8192`).
#   steps   the 31B's decode steps at batch 16, 64, 128 and 256 (`bench.engine --decode-steps`: step wall against
#           graph replay as the requests grow, 3 repetitions a process), new against ab/base (9095e73: 32-key
#           tiles over 2 warps), arms alternated ($ARMS, default new base new).
#
# The calls, each on the tree named:
#   1  874282f  kern (that tree ran the whole test file: 13 tests)  the first version (mma.sync over 16 rows)
#   2  f26a73d  kern  per-warp streams on CUDA cores (2fe8b35)
#   3  3b0cc1d  kern  lanes in two groups of 16, each its own stream
#   4  0406d1d  splits
#   5  91b08a4  moe
#   6  9095e73  tiles
#   7  (refused: no machine; ~120 s of the budget)
#   8  7cad83d  steps ARMS="new base"    (new: the one-warp 16-key tile for every unsplit head-dim-256 decode)
#   9  7cad83d  steps ARMS=new           10  7cad83d  steps ARMS=base     11  7cad83d  steps ARMS=new
#      (calls 8-11 on one machine, back to back; their records in export/results/h200_s19_steps_31b.jsonl with
#      `process` 1-3 per arm; cf51159 then keeps the two-warp tile under WIDE_DECODE programs an SM, so batch
#      16 runs the base's tile again and 64-256 the tile measured here)
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm of steps
#     bash export/results/s19_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: kern, splits, tiles, moe or steps}
BUDGET=${2:-570}
TAG=s19-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
# kernels_twice NAME ARGS...: `bench.kernels --decode-batch ARGS` in two processes, results $OUT/NAME_{1,2}.json
kernels_twice() {
  local name=$1; shift
  for rep in 1 2; do
    run_part ${name}_$rep 150 python3 -m g4rt.bench.kernels --out "$OUT/d$rep" --decode-batch "$@"
    cp "$OUT/d$rep/results.json" "$OUT/${name}_$rep.json" 2>/dev/null; rm -rf "$OUT/d$rep"
  done
}
case $PART in
  kern)
    run_part gluon_tests 240 python3 -m pytest -q -x tests/test_plugins_gluon.py -k "${TESTS:-decode}"
    cp "$OUT/gluon_tests.log" "$OUT/gluon_tests.txt"
    kernels_twice decode_batch
    ;;
  splits) kernels_twice decode_splits --decode-batch-splits ;;
  tiles) kernels_twice decode_tiles --decode-batch-tiles ;;
  moe)
    arm new 1 moe_26b 400 moe --config 26b-a4b --batches 1 --ttft 2048,8192
    ;;
  steps)
    n=0
    for a in ${ARMS:-new base new}; do
      n=$((n + 1))
      arm $a $n steps_31b 135 engine --config 31b --skip-hf --batches "" --engines inductor \
        --decode-steps 16,64,128,256 --reps 3
    done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
