#!/usr/bin/env bash
# Session 53's device call: cuBLASLt's own algorithms for the 31B's K > N decode matmuls (`bench.blas_algos`: the
# heuristic's candidates under several workspace bounds and their split-K variants, each rebuilt from its
# configuration, checked against fp32 and timed over every layer's weight of a role in one CUDA graph, beside
# torch's F.linear through cuBLAS and cuBLASLt), then torch's own cuBLASLt call traced for two of those shapes:
#     bash export/results/s53_algos.sh [budget_s]      # default 570 s; results under $OUT
# $ROWS (default 64,128) and $ROLES (default o_proj,down_proj); $OUT/blas_algos.jsonl, $OUT/ltlog_*.txt.gz
# (CUBLASLT_LOG_LEVEL=5 of export/results/s53_ltlog.py: which algorithm torch's call runs).
# The call as run in session 53 (one H100) was this script at 2b55654, whose tree also held plugins/cublaslt.py (a
# matmul by a measured algorithm from a table) and `bench.blas_algos --write`: it wrote the sweep's winners into a
# copy of the tree, ran that copy's GPU tests and the 31B's batch-64 step against the tree without a table
# (`git show 2b55654:export/results/s53_algos.sh`; export/results/README.md, session 53). Both are removed: the one
# shape that won changed nothing in the step. Session 54 ran this script (ee28d23) on an H100 as
# `ROWS=64 ALGOS_CAP=220 bash export/results/s53_algos.sh 320` (h100_s54_call1_*): torch's query is the 1 MiB one.
BUDGET=${1:-570} TAG=s53
source export/results/device_call.sh
run_part algos "${ALGOS_CAP:-300}" python3 -m g4rt.bench.blas_algos --config 31b --rows "${ROWS:-64,128}" \
  --roles "${ROLES:-o_proj,down_proj}" --out "$OUT"
CUBLASLT_LOG_LEVEL=5 CUBLASLT_LOG_FILE=$OUT/ltlog_%i.txt run_part ltlog 60 python3 export/results/s53_ltlog.py
gzip "$OUT"/ltlog_*.txt
finish_call
