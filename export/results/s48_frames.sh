#!/usr/bin/env bash
# Session 48's device call: which frame strides make a batched decode's pages read slowly on this card, and the
# engine with frames padded by models/layout.py's frame_stride against the tree before it (ab/pre: git archive
# --prefix=ab/pre/g4rt/ 39af465, carried).
#   bash export/results/s48_frames.sh [budget_s]     # results under $OUT/all.tgz
# 1. bench.kernels, the 31B's sliding layer at batch 256, context 200, bf16, the fma tiles: the layer's page at
#    offset 0 of frames of $FRAMES KiB (default below; `engine`: this checkout's 31B frame, the page at the middle
#    layer's offset), a process each (about 10 s)
# 2. bench.engine, batch 256 with every sequence decoding, arms $ARMS alternated (a process each of at most
#    $STEPS_CAP s); on a card of less than 100 GB the first 30 layers (`--layers 30`), else the whole 31B
# FRAMES=" " or ARMS=" " (a blank, not empty: empty takes the default) skips that part.
set -u
BUDGET=${1:-570}
O=${OUT:?OUT must name the results directory}
for f in ${FRAMES:-256 1280 1536 12800 12928 engine 3072 1280 12928}; do
  OUT=$O/f$f-$SECONDS BATCHES=256 TABLES=fma KV=bfloat16 KERNELS_ARGS="--frame-kib $f" \
    bash export/results/s36_h200.sh kernels 45 > /dev/null 2>&1
done
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=""; [ "$mem" -lt 100000 ] && layers="--layers 30"
left=$((BUDGET - SECONDS - 15))
OUT=$O/s STEPS=256 STEPS_ARGS="$layers ${STEPS_ARGS:-}" ARMS="${ARMS:-bf16 pre/bf16 pre/bf16 bf16 bf16 pre/bf16}" \
  STEPS_CAP=${STEPS_CAP:-60} bash export/results/s36_h200.sh steps $left 2>&1 | grep -v '^{' | tail -40
cd "$O" && tar czf /tmp/all.tgz . && mv /tmp/all.tgz "$O/all.tgz"
