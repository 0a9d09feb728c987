#!/usr/bin/env bash
# Session 49's device call: whether a weight's row stride camps on the memory stacks as the KV frames' did, and the
# engine with every weight in padded rows (next/rowpad: layout.padded_rows at pack_weights) against main.
#   git archive --prefix=ab/m/g4rt/ main | tar -x; git archive --prefix=ab/rp/g4rt/ next/rowpad | tar -x  # carried
#   bash export/results/s49_rowpad.sh [budget_s]      # results under $OUT/all.tgz
# It ran once, on d925dac's tree (export/results/README.md, "Weights in padded rows"); `bench.engine --row-pad` and
# next/rowpad (h100_s49_rowpad.patch) are gone since, so part 1 needs that tree.
# 1. bench.engine --matmuls --no-gemv --row-pad on this checkout, the 31B's first 30 layers and the E4B, batches 1,
#    64, 256: each weight role's cuBLAS matmul on the checkpoint layout and in padded rows ($MATMULS=" " skips)
# 2. the 31B's decode steps at batches $STEPS (default 64,256), arms $ARMS alternated (default m/bf16 rp/bf16
#    rp/bf16 m/bf16, a process each of at most $STEPS_CAP s); on a card of less than 100 GB the first 30 layers
set -u
BUDGET=${1:-570}
O=${OUT:?OUT must name the results directory}
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/g4rt
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$O/gpu.txt"
for c in ${MATMULS:-31b e4b}; do
  a=(); [ "$c" = 31b ] && a=(--layers 30)
  PYTHONPATH=/tmp/pkg timeout 120 python3 -m g4rt.bench.engine --config "$c" "${a[@]}" --out "$O/m-$c" --skip-hf \
    --matmuls --no-gemv --row-pad --batches 1,64,256 > "$O/m-$c.log" 2>&1
  echo "matmuls $c rc $? at ${SECONDS}s"
done
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=""; [ "$mem" -lt 100000 ] && layers="--layers 30"
left=$((BUDGET - SECONDS - 15))
OUT=$O/s STEPS=${STEPS:-64,256} STEPS_ARGS="$layers ${STEPS_ARGS:-}" ARMS="${ARMS:-m/bf16 rp/bf16 rp/bf16 m/bf16}" \
  STEPS_CAP=${STEPS_CAP:-80} bash export/results/s36_h200.sh steps $left 2>&1 | grep -v '^{' | tail -20
cd "$O" && tar czf /tmp/all.tgz . && mv /tmp/all.tgz "$O/all.tgz"
