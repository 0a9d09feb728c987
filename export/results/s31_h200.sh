#!/usr/bin/env bash
# The device calls since session 31: an arm's tree against another at batch 1 (E2B, 31B) and at the 31B's serving
# batches; first written for `allnorm` (next/all-norm: the cut over K for two programs an SM, the copied launches
# for weights up to 32 MiB, the early key tile, and the decode launch that writes its K/V rows and norms and ropes
# its q itself), in main since session 34. One PART per call:
#
#   b1     with GPU_TESTS="TREE:TESTFILE[,TESTFILE] ..." first those tests of each TREE (`new` = this checkout, else
#          ab/TREE/g4rt), then $MODELS (default 31b) at batch 1, arms $ARMS alternated (default "new allnorm", three
#          rounds), a process each of at most $B1_CAP seconds (default 150): `bench.engine --config M --skip-hf
#          --batches 1 --new-tokens 32 --profile`
#   steps  the 31B's decode steps at the batches $STEPS (default 128,256), arms $ARMS alternated (default "new
#          allnorm", three rounds), a process each of at most $STEPS_CAP seconds (default 95): `bench.engine --config
#          31b --skip-hf --batches "" --engines inductor --decode-steps $STEPS --reps 3` (three contexts as the
#          requests grow)
#
# Arms: new = this checkout, any other A = ab/A, a `git archive` of another tree:
#   old     = main before session 34's merge of next/early-combine (2ab16cf): the decode's norms, KV write and
#             attention as three launches, the combine waiting before it lets the o_proj in
#   sp3     = next/split3 (main at 97aa10c with SPLIT_PROGRAMS 3, rounded up): the E2B's double-wide down_proj in 16
#             runs instead of 11, the E4B's in 10 instead of 7, the 31B's o_proj and down_proj in 5 instead of 4
#             (session 35: the small models gained, the 31B lost 6 %; not merged)
#   pre     = main before `next/wave3` (97aa10c)
#   allnorm, ec = next/all-norm, next/early-combine (in main since session 34, 5ce4264)
#   fold, l2, balance, regs, ring = session 32's stack and the ring (each lost: export/results/README.md)
# The calls of session 31 (export/results/README.md, "The 31B on `next/all-norm`"; allnorm at d3aa09b, ring at 1499742):
#   1  GPU_TESTS="ring:tests/test_plugins_gluon_gemv.py,tests/test_plugins_decode_gpu.py" MODELS=e2b B1_CAP=100 \
#        ARMS="allnorm ring allnorm ring allnorm ring" bash export/results/s31_h200.sh b1 585
#   2  MODELS=31b B1_CAP=120 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh b1 500
#   3  STEPS=64,128,256 STEPS_CAP=100 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh steps 590
#   4  STEPS=128 STEPS_CAP=70 ARMS="write norm new write norm new" bash export/results/s31_h200.sh steps 330
#      (write = next/decode-write, norm = next/decode-norm)
# Sessions 33-35's: the results README's sections name them (session 35: an H200, `needs_h200`, arms `new` = main
# 97aa10c, `old` = 2ab16cf, `sp3` = next/split3; the calls are in its section).
# Session 36 ran the call for `next/wave3` on the 26B-A4B (its o_proj cut in 8 runs on an H100, 6 before; a tie):
#   MODELS="26b-a4b" B1_CAP=90 ARMS="pre new pre new pre new" bash export/results/s31_h200.sh b1 585
# with ab/pre from the loop below (pre:97aa10c); the H200's plan (9 runs) is not measured.
#
#     for a in pre:97aa10c; do git archive --prefix=ab/${a%%:*}/g4rt/ ${a#*:} | tar -x; done
#     bash export/results/s31_h200.sh PART [budget_s]      # default 570 s; results under $OUT
PART=${1:?PART: b1 or steps}
BUDGET=${2:-570}
TAG=s31-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
ARMS=${ARMS:-new allnorm new allnorm new allnorm}
case $PART in
  b1) gpu_tests "${GPU_TESTS:-}"
      batch1 "${B1_CAP:-150}" 31b "$ARMS" ;;
  steps) each_arm "$ARMS" steps_31b "${STEPS_CAP:-95}" engine --config 31b --skip-hf --batches "" \
           --engines inductor --decode-steps "${STEPS:-128,256}" --reps 3 ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
