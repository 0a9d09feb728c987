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
#   allnorm = next/all-norm
#   fold    = next/fold: next/all-norm, and a decode cut over its keys merges its splits in its launch (the last
#             program of each (sequence, KV head)) where a group's partials are at most 64 KB: no combine launch
#   l2      = next/l2: next/fold, and the skinny matmul asks L2 for up to 16 MiB of its weight before its wait
#   balance = next/balance: next/l2, and a wide weight whose 64-column blocks fall unevenly on the SMs takes 32 (the
#             E2B's packed gate/up, the 31B's full q/k/v)
#   regs    = next/regs: next/balance, and a decode launch that writes its K/V rows takes its own key from them
#   ring    = next/ring: next/all-norm, and the MLP's packed gate/up of 32-112 MiB at batch 1 (the E2B's and E4B's)
#             streamed through a ring of copy slots in the copied Gluon kernel (at 1499742 also the plain weights of
#             that size: the E2B's and E4B's down_proj, the 31B's sliding o_proj)
# The calls of session 31 (export/results/README.md, "The 31B on `next/all-norm`"; allnorm at d3aa09b, ring at 1499742):
#   1  GPU_TESTS="ring:tests/test_plugins_gluon_gemv.py,tests/test_plugins_decode_gpu.py" MODELS=e2b B1_CAP=100 \
#        ARMS="allnorm ring allnorm ring allnorm ring" bash export/results/s31_h200.sh b1 585
#   2  MODELS=31b B1_CAP=120 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh b1 500
#   3  STEPS=64,128,256 STEPS_CAP=100 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh steps 590
#   4  STEPS=128 STEPS_CAP=70 ARMS="write norm new write norm new" bash export/results/s31_h200.sh steps 330
#      (write = next/decode-write, norm = next/decode-norm)
# The next calls (session 32 had no GPU): next/all-norm fuses only a decode cut over its keys (131a2b4); on it, each
# on the one before: next/fold (254bc35) merges such a decode's splits in its launch where they are small, no combine
# launch; next/l2 (b380da5) has the skinny matmul ask L2 for up to 16 MiB of its weight before its wait;
# next/balance (25fbcaf) gives unevenly spread wide weights 32-column blocks; next/regs (e085fa1) takes a decode's
# own key from the rows it writes, one round trip after the wait. next/ring (a7df82d, on next/all-norm) streams the
# packed gate/up through the ring. The E2B's stack first (the target furthest off), then the serving batches (the
# merge of next/all-norm rests on them), the 31B at batch 1, and the E2B's increments (a 31B process takes about
# 30-45 s, an E2B one 25-35 s):
#   GPU_TESTS="regs:tests/test_plugins_decode_gpu.py,tests/test_plugins_gemv.py,tests/test_plugins_gluon_gemv.py" \
#     MODELS=e2b B1_CAP=60 ARMS="allnorm balance regs allnorm balance regs allnorm balance regs" \
#     bash export/results/s31_h200.sh b1 585
#   STEPS=64,128,256 STEPS_CAP=100 ARMS="new allnorm new allnorm new allnorm" bash export/results/s31_h200.sh steps 590
#   MODELS=31b B1_CAP=60 ARMS="allnorm balance regs allnorm balance regs allnorm balance regs" \
#     bash export/results/s31_h200.sh b1 585
#   MODELS=e2b B1_CAP=60 ARMS="fold l2 balance fold l2 balance fold l2 balance" bash export/results/s31_h200.sh b1 400
#
#     for a in allnorm:next/all-norm fold:next/fold l2:next/l2 balance:next/balance regs:next/regs; do
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
