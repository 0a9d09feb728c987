#!/usr/bin/env bash
# H200 calls of session 24: the skinny matmul at serving batches (a row tile of 32-128 rows). One PART per call:
#
#   mm      the GPU test of the serving tiles (`pytest tests/test_plugins_gemv.py -k on_the_gpu`), then the 31B's
#           decode matmuls by role at batches 64 and 128, cuBLAS against every serving tile and split
#           (`bench.engine --config 31b --matmuls --batches 64,128 --roles qkv,gate_up,o_proj,down_proj,lm_head`)
#   blas    the 31B's decode matmuls by role at batches 64, 128 and 256 through cuBLAS three ways, a process each:
#           torch's default, `--blas cublaslt` (cuBLASLt's heuristic), `--no-bf16-reduced-reduction` (`bench.engine
#           --config 31b --matmuls --no-gemv --batches 64,128,256 --roles qkv,gate_up,o_proj,down_proj,lm_head`)
#   s31     the GPU test of the serving tiles (GPUTEST=0 skips it), then the 31B's decode steps at the batches $STEPS (default 64,128), arms $ARMS (default base new base new
#           base new), a process each: `bench.engine --config 31b --skip-hf --batches "" --engines inductor
#           --decode-steps $STEPS --reps 3` (three contexts as the requests grow); base = ab/base, new = this checkout
#
# The calls:
#   1  mm    budget 540, at c417c23 (the row tile; the GPU test then stopped at a tile out of shared memory at 128 rows)
#   2  s31   STEPS=64, budget 560: adf8731 (the op takes the kernel for o_proj/down_proj at up to 64 rows; reverted in
#            c0b2979, kept as h200_s24_serving_rule.patch) against ab/base = ae6341e; its test step then also ran
#            `-k "on_the_gpu or serving"`
#   3  blas  budget 500, at cccf4a9
#   4  s31   STEPS=64,256, budget 540: 67e4b6e (cuBLASLt for K > N at 33-64 rows and N > K above 128) against
#            ab/base = cccf4a9
#   5  s31   STEPS=128, budget 420: 2af9338 (K > N at 33-64 rows, K >= 3N at 65-128) against ab/base = cccf4a9
#   6  at 2af9338: `source export/results/device_call.sh` then, for m in e4b e2b and each of default / `--blas
#      cublaslt`: `python3 -m g4rt.bench.engine --config $m --out DIR --matmuls --no-gemv --batches 64,128 --roles
#      o_proj,down_proj`
#   7  at 7ff9f50: the same for the 31B, `--batches 16,32 --roles qkv,gate_up,o_proj,down_proj`
#   8  s31   GPUTEST=0 STEPS=32, budget 240: 46d3fec (K > N from 9 rows) against ab/base = cccf4a9
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm
#     bash export/results/s24_h200.sh PART [budget_s]   # default 570 s; results under $OUT
PART=${1:?PART: mm, blas or s31}
BUDGET=${2:-570}
TAG=s24-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  mm) TRITON_INTERPRET=0 run_part gputest 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_plugins_gemv.py \
        -k on_the_gpu
      tail -3 "$OUT/gputest.log"
      run_part mm31 "$BUDGET" python3 -m g4rt.bench.engine --config 31b --out "$OUT/mm31" --matmuls --batches 64,128 \
        --roles qkv,gate_up,o_proj,down_proj,lm_head ;;
  blas) for arm in default cublaslt no-reduced; do
          flags=(); [ $arm = cublaslt ] && flags=(--blas cublaslt); [ $arm = no-reduced ] && flags=(--no-bf16-reduced-reduction)
          run_part "blas_$arm" 150 python3 -m g4rt.bench.engine --config 31b --out "$OUT/blas_$arm" --matmuls --no-gemv \
            --batches 64,128,256 --roles qkv,gate_up,o_proj,down_proj,lm_head "${flags[@]}"
        done ;;
  s31) [ "${GPUTEST:-1}" = 0 ] || { TRITON_INTERPRET=0 run_part gputest 150 python3 -m pytest -q -p no:cacheprovider \
         tests/test_plugins_gemv.py -k on_the_gpu; tail -3 "$OUT/gputest.log"; }
       each_arm "${ARMS:-base new base new base new}" steps_31b 110 engine --config 31b --skip-hf --batches "" \
         --engines inductor --decode-steps "${STEPS:-64,128}" --reps 3 ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
