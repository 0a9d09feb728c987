#!/usr/bin/env bash
# H200 calls of session 26: the small stages' weights copied into shared memory before a launch waits for the one
# before it. One PART per call:
#
#   handoff  `bench.handoff`, a process an arm, alternated, three each (`--arms A` for A in $HANDOFF_ARMS, default
#            launches copies prefetch; $HANDOFF_FLAGS added to each)
#   b1       the Gluon kernel's GPU tests (`pytest tests/test_plugins_gluon_gemv.py`; GPU_TESTS=0 skips them), then
#            $MODELS (default e4b e2b), at most $B1_CAP seconds a process (default 90)
#            at batch 1, arms $ARMS alternated (default base new base new base new; an arm A other than new is
#            ab/A, a `git archive` of another tree), `bench.engine --config M --skip-hf --batches 1 --new-tokens 32
#            --profile`
#   moe1     the 26B-A4B at batch 1, arms $ARMS (default base new base new), `bench.moe --config 26b-a4b --batches 1
#            --ttft "" --skip-hf --profile` (its router keeps the Triton kernel; the norm's change reaches it)
#
# The calls:
#   1  handoff  budget 300, at 07427eb, HANDOFF_FLAGS="--prefetch-block-n 16 --prefetch-slots 2 --dims 1024,2048,2560"
#               (copies in that tree: its own kernel of the same code as plugins/gluon_gemv.py's, then added)
#   2  b1       budget 540, at 6734d6d, MODELS=e4b, ab/base = 07427eb (no change to the step)
#   3  b1       budget 560, at bd95059, MODELS=e4b ARMS="base copies new base copies new base copies new", ab/copies =
#               6734d6d (the Gluon kernel only), new adds the norm's one round trip and late launch_next
#   4  b1       at 177f02a (a program for half the SMs or more), ab/base = 07427eb, two runs in one call:
#               OUT=$OUT/e2b MODELS=e2b, budget 260; then OUT=$OUT/31b MODELS=31b GPU_TESTS=0 B1_CAP=120
#               ARMS="base new base new", budget 300
#   5  moe1     budget 380, at 84232c7, ab/base = 07427eb
#   6  b1       budget 250, at 9b3050e (the tail and the next projection in one launch), ab/prev = bddddb2 (calls 4-5's
#               tree), MODELS=e4b ARMS="prev new prev new prev new" (the device time left allowed no E2B)
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x     # the base arm of b1
#     bash export/results/s26_h200.sh PART [budget_s]      # default 570 s; results under $OUT
PART=${1:?PART: handoff, b1 or moe1}
BUDGET=${2:-570}
TAG=s26-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  handoff) for rep in 1 2 3; do
             for a in ${HANDOFF_ARMS:-launches copies prefetch}; do
               run_arm /tmp/pkg $a $rep handoff 90 handoff --arms $a ${HANDOFF_FLAGS:-}
             done
           done ;;
  b1) if [ "${GPU_TESTS:-1}" = 1 ]; then
        run_part gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_plugins_gluon_gemv.py
        tail -3 "$OUT/gpu_tests.log"
      fi
      batch1 "${B1_CAP:-90}" "e4b e2b" "base new base new base new" ;;
  moe1) each_arm "${ARMS:-base new base new}" b1_26b 120 moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
