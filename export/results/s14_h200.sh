#!/usr/bin/env bash
# H200 calls of session 14. One PART per call:
#
#   measure  where the 31B's batch-128 decode step goes and what its matmuls cost role by role: the
#            31B's matmul roles at batches 64 and 128 (`bench.engine --matmuls`: cuBLAS on every layout);
#            one inductor run at batch 128 with the decode profile (kernels by kind, replay); the E4B's
#            matmul roles at batch 1 (cuBLAS, the skinny matmul's configs and the op's own choice).
#
#     bash export/results/s14_h200.sh PART [budget_s]       # default 560 s; results under $OUT
PART=${1:?PART: measure}
BUDGET=${2:-560}
TAG=s14-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  measure)
    arm new 1 matmuls_31b 150 engine --config 31b --skip-hf --matmuls --batches 64,128
    arm new 1 profile_31b_b128 200 engine --config 31b --skip-hf --batches 128 --new-tokens 32 \
      --engines inductor --profile
    arm new 1 matmuls_e4b 90 engine --config e4b --skip-hf --matmuls --batches 1
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
