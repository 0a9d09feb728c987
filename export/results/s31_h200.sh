#!/usr/bin/env bash
# H200 calls of session 31: the 31B on the arm `allnorm` (next/all-norm: the cut over K for two programs an SM, the
# copied launches for weights up to 32 MiB, the early key tile, and the decode launch that writes its K/V rows and
# norms and ropes its q itself) before it is merged. One PART per call:
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
#   allnorm = next/all-norm (since session 33 merged with main: 4fa8f6f)
#   ec      = next/early-combine (5ccf5e4, on next/all-norm): the combine launch lets the next kernel in before its
#             wait, so the o_proj after it copies its weights while the split attention runs
#   sp3     = next/split3 (11d39d0, on next/all-norm): a cut over K aims for three programs an SM (the E2B's
#             double-wide down_proj in 16 runs instead of 11; the 31B's o_proj and down_proj in 5 instead of 4)
#   fold, l2, balance, regs = next/fold .. next/regs (session 32's stack on next/all-norm; each lost on an H100 in
#             session 33, not kept: export/results/README.md, "The batch-1 arms on an H100")
#   ring    = next/ring: next/all-norm, and the MLP's packed gate/up of 32-112 MiB at batch 1 (the E2B's and E4B's)
#             streamed through a ring of copy slots in the copied Gluon kernel (not kept)
# The calls of session 31 (export/results/README.md, "The 31B on `next/all-norm`"; allnorm at d3aa09b, ring at 1499742):
#   1  GPU_TESTS="ring:tests/test_plugins_gluon_gemv.py,tests/test_plugins_decode_gpu.py" MODELS=e2b B1_CAP=100 \
#        ARMS="allnorm ring allnorm ring allnorm ring" bash export/results/s31_h200.sh b1 585
#   2  MODELS=31b B1_CAP=120 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh b1 500
#   3  STEPS=64,128,256 STEPS_CAP=100 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh steps 590
#   4  STEPS=128 STEPS_CAP=70 ARMS="write norm new write norm new" bash export/results/s31_h200.sh steps 330
#      (write = next/decode-write, norm = next/decode-norm)
# Session 33's (on an H100, `kind` nvidia-h100-x1; the H200 refused): the results README's section names them.
# The next calls. First the serving batches, on which the merge of next/all-norm rests (an H200: 31B steps at batch
# 128 and 256 do not fit an H100's 80 GB, so `needs_h200`), then the E2B's arms, then the 31B at batch 1 (sp3
# changes its plans). The batch-1 calls fit an H100 (`kind` nvidia-h100-x1) where the H200 refuses: their arms
# compare within a call:
#   STEPS=64,128,256 STEPS_CAP=100 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh steps 590
#   GPU_TESTS="allnorm:tests/test_plugins_decode_gpu.py,tests/test_plugins_gluon_gemv.py \
#     ec:tests/test_plugins_decode_gpu.py" MODELS=e2b B1_CAP=60 \
#     ARMS="allnorm ec sp3 allnorm ec sp3 allnorm ec sp3" bash export/results/s31_h200.sh b1 585
#   MODELS=31b B1_CAP=60 ARMS="allnorm ec sp3 allnorm ec sp3 allnorm ec sp3" bash export/results/s31_h200.sh b1 585
#
#     for a in allnorm:next/all-norm ec:next/early-combine sp3:next/split3; do
#       git archive --prefix=ab/${a%%:*}/g4rt/ ${a#*:} | tar -x; done
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
