#!/usr/bin/env bash
# H200 calls prepared in session 28 for the batch-1 step of the E2B and E4B: the copied Gluon kernel for weights up to
# 32 MiB, more programs for the matmuls cut over K, and a decode attention that reads its first key tile before its
# wait.
# One PART per call:
#
#   b1   with GPU_TESTS="TREE:TESTFILE[,TESTFILE] ..." first those tests of each TREE (`new` = this checkout, else ab/TREE/g4rt),
#        then $MODELS (default "e2b e4b") at batch 1, arms $ARMS alternated (default "new all", three rounds), a
#        process each of at most $B1_CAP seconds (default 100): `bench.engine --config M --skip-hf --batches 1
#        --new-tokens 32 --profile`. Arm new is this tree; any other arm A is ab/A, a `git archive` of another tree.
#
# The calls: none ran (no device machine was lent in session 28). Prepared, CPU-tested branches (arms as ab/NAME):
#   all    = next/all: wide + split2 + early2 together
#   both   = next/wide-split2: copied launches for weights up to 32 MiB (next/wide-copies) and a cut over K that aims
#            for two programs an SM (next/split2)
#   early  = next/early-kv: a decode's attention reads its split's first K tile before its wait
#   early2 = next/early2: and asks L2 for that tile's V rows before it
# Session 28's first call (superseded by session 29's below, whose allnorm arm holds `all`; budget 585):
#   GPU_TESTS="all:tests/test_plugins_gluon_gemv.py,tests/test_plugins_triton.py" MODELS="e2b e4b" \
#     ARMS="new all new all new all" bash export/results/s28_h200.sh b1 585
# then, if `all` gains, one call that splits it: MODELS=e2b ARMS="new both early2 new both early2 new both early2",
# and one on the 31B, whose batch-1 cuts over K and 60 attention launches `all` changes too:
#   MODELS=31b ARMS="new all new all" B1_CAP=240 bash export/results/s28_h200.sh b1 585
#
# Arms added in session 29 (no device lent either; CPU-tested branches):
#   write   = next/decode-write: a decode's attention launch writes the step's K/V rows itself (no KV write launch)
#   norm    = next/decode-norm: and norms and ropes its q and those rows from the packed projection (no q/k/v norm
#             launch either: 50 launches fewer a step on the E2B, 120 on the 31B)
#   allnorm = next/all-norm: next/all and next/decode-norm together
# The first call to make (budget 585; the GPU tests compare the fused launch with the three it replaces):
#   GPU_TESTS="allnorm:tests/test_plugins_decode_gpu.py,tests/test_plugins_gluon_gemv.py" MODELS=e2b \
#     ARMS="new allnorm norm new allnorm norm new allnorm norm" bash export/results/s28_h200.sh b1 585
# then the E4B the same way, and the 31B (its serving batches with `bench.engine --decode-steps`, where the fused
# launch's one-warp tile spills 232 bytes against 180) before any of these is merged.
# Session 30 ran that call and the E4B's (export/results/README.md, session 30: allnorm -8.2 % / -1.5 % a replay,
# norm slower); the GPU tests faulted on the fixture's unaligned arena, fixed on next/all-norm (d3aa09b). Next:
#   GPU_TESTS="allnorm:tests/test_plugins_decode_gpu.py,tests/test_plugins_gluon_gemv.py,tests/test_plugins_gluon.py" \
#     MODELS=31b B1_CAP=200 ARMS="new allnorm new allnorm new allnorm" bash export/results/s28_h200.sh b1 585
# then the 31B's serving batches per arm: bench.engine --config 31b --skip-hf --batches "" --engines inductor
#   --decode-steps 64,128,256 --reps 3 (the one-warp tile spills 384 bytes on allnorm against 180).
# Session 31 ran those (and more) with s31_h200.sh, whose header names the calls after them.
#
#     for a in all:next/all both:next/wide-split2 early:next/early-kv early2:next/early2 write:next/decode-write \
#              norm:next/decode-norm allnorm:next/all-norm; do
#       git archive --prefix=ab/${a%%:*}/g4rt/ ${a#*:} | tar -x; done                 # the arms' trees
#     bash export/results/s28_h200.sh PART [budget_s]      # default 570 s; results under $OUT
PART=${1:?PART: b1}
BUDGET=${2:-570}
TAG=s28-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1) gpu_tests "${GPU_TESTS:-}"
      batch1 "${B1_CAP:-100}" "e2b e4b" "new all new all new all" ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
