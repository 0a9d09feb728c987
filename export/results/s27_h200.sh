#!/usr/bin/env bash
# H200 calls of session 27: the KV-shared layers' compiled pieces (Dynamo's recompile limit had sent them eager)
# and the shared-memory carveout. One PART per call:
#
#   b1   with GPU_TESTS=1 first the Gluon kernel's tests (`pytest tests/test_plugins_gluon_gemv.py`), then
#        $MODELS (default e4b) at batch 1, arms $ARMS alternated (default base new carve, three rounds), a process
#        each of at most $B1_CAP seconds (default 100): `bench.engine --config M --skip-hf --batches 1 --new-tokens 32
#        --profile`. Arm new is this tree; carve is this tree with `--shared-carveout 100` (every Triton/Gluon kernel
#        prefers all of its SM's L1 as shared memory); any other arm A is ab/A, a `git archive` of another tree.
#
# The calls:
#   1  b1  budget 575, at 4f09e0a (the recompile limit), ab/base = a311cd1, MODELS=e4b, ARMS default
#   2  b1  budget 580, at 72061b1 (the next launch let in before the wait), ab/prev = 4f09e0a, GPU_TESTS=1
#          MODELS="e4b e2b" ARMS="prev new prev new prev new"
#   3  b1  budget 560, at f78ca75 (the PLE gate as a copied launch), ab/mid = 72061b1, GPU_TESTS=1 MODELS="e4b e2b"
#          ARMS="mid new mid new mid new"
#   4  b1  budget 170, at 4d10d27 (the gate's launch with 8 warps), ab/w4 = ea9b72f (f78ca75's code), MODELS=e4b
#          ARMS="w4 new w4 new" (the device time left), after `pytest -q tests/test_plugins_gluon_gemv.py -k ple_gate`
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x     # the base arm
#     bash export/results/s27_h200.sh PART [budget_s]      # default 570 s; results under $OUT
PART=${1:?PART: b1}
BUDGET=${2:-570}
TAG=s27-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) if [ "${GPU_TESTS:-0}" = 1 ]; then
        run_part gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_plugins_gluon_gemv.py
        tail -3 "$OUT/gpu_tests.log"
      fi
      for m in ${MODELS:-e4b}; do
        n=0
        for a in ${ARMS:-base new carve base new carve base new carve}; do
          n=$((n + 1))
          args=(engine --config "$m" --skip-hf --batches 1 --new-tokens 32 --profile)
          case $a in
            carve) run_arm /tmp/pkg carve $n "b1_$m" "${B1_CAP:-100}" "${args[@]}" --shared-carveout 100 ;;
            *) arm "$a" $n "b1_$m" "${B1_CAP:-100}" "${args[@]}" ;;
          esac
        done
      done ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
