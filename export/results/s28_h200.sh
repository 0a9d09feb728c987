#!/usr/bin/env bash
# H200 calls of session 28: the copied Gluon kernel for weights up to 32 MiB (branch next/wide-copies) and more
# programs for the matmuls cut over K (next/split2) at batch 1.
# One PART per call:
#
#   b1   with GPU_TESTS="TREE:TESTFILE ..." first those tests of each TREE (`new` = this checkout, else ab/TREE/g4rt),
#        then $MODELS (default "e2b e4b") at batch 1, arms $ARMS alternated (default "new wide", three rounds), a
#        process each of at most $B1_CAP seconds (default 100): `bench.engine --config M --skip-hf --batches 1
#        --new-tokens 32 --profile`. Arm new is this tree; any other arm A is ab/A, a `git archive` of another tree.
#
# The calls:
#   1  b1  budget 585, at b421af2's code (session 27's end), MODELS=e2b ARMS="new both early early2" x3,
#          GPU_TESTS="both:tests/test_plugins_gluon_gemv.py early2:tests/test_plugins_triton.py":
#          ab/both = 8196603 (next/wide-split2: copied launches for weights up to 32 MiB, and a cut over K aims for
#          two programs an SM), ab/early = aeb6063 (next/early-kv: a decode's attention reads its first K tile
#          before its wait), ab/early2 = f4c525f (next/early2: and asks L2 for that tile's V rows before it)
#
#     git archive --prefix=ab/wide/g4rt/ REV | tar -x     # another arm's tree
#     bash export/results/s28_h200.sh PART [budget_s]      # default 570 s; results under $OUT
PART=${1:?PART: b1}
BUDGET=${2:-570}
TAG=s28-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) for t in ${GPU_TESTS:-}; do  # TREE:TESTFILE, TREE `new` (this checkout) or an ab/ tree
        d=$PWD p=/tmp/pkg; [ "${t%%:*}" != new ] && d=$PWD/ab/${t%%:*}/g4rt p=$PWD/ab/${t%%:*}
        (cd "$d" && PYTHONPATH=$p run_part "gpu_tests_${t%%:*}" 150 python3 -m pytest -q -x \
          -p no:cacheprovider "${t#*:}")
        tail -3 "$OUT/gpu_tests_${t%%:*}.log"
      done
      batch1 "${B1_CAP:-100}" "e2b e4b" "new wide new wide new wide" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
