#!/usr/bin/env bash
# Session 53's device call: cuBLASLt's own algorithms for the 31B's decode matmuls, each timed (`bench.blas_algos`:
# the heuristic's candidates and their split-K variants, checked against fp32, over every layer's weight of a role
# in one CUDA graph, beside torch's F.linear through cuBLAS and cuBLASLt), on this checkout:
#     bash export/results/s53_algos.sh [budget_s]      # default 570 s; results under $OUT (blas_algos.jsonl)
# $ROWS (default 64,128) for $ROLES (default o_proj,down_proj: the K > N weights), then $ROWS2 (default 64) for
# $ROLES2 (default gate_up,qkv); each a process of at most $ALGOS_CAP s (default 260).
BUDGET=${1:-570} TAG=s53
source export/results/device_call.sh
run_part algos_kn "${ALGOS_CAP:-260}" python3 -m g4rt.bench.blas_algos --config 31b --rows "${ROWS:-64,128}" \
  --roles "${ROLES:-o_proj,down_proj}" --out "$OUT"
run_part algos_nk "${ALGOS_CAP:-260}" python3 -m g4rt.bench.blas_algos --config 31b --rows "${ROWS2:-64}" \
  --roles "${ROLES2:-gate_up,qkv}" --out "$OUT"
finish_call
