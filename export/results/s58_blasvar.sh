#!/usr/bin/env bash
# Session 58's device calls (any card): why torch's cuBLAS call of one shape took 15.5-15.7 % longer in one process
# than in another (session 57). `bench.blas_algos --max-candidates 0` in $PROCS (default 6) fresh processes of at
# most $VAR_CAP s (default 60): for each of $ROLES (default the packed sliding q/k/v and the full gate/up) at $ROWS
# (default 64) rows, $ROUNDS (default 2) fresh allocations of each of $LAYOUTS (default separate; `one`: every
# layer's weight a view into one tensor), each with torch's cuBLAS and cuBLASLt graph time and the kernels they run.
# The processes cycle through $ALLOC_CONFS (space-separated PYTORCH_CUDA_ALLOC_CONF values, "-" for none; default
# "-"); records in $OUT/blasvar.jsonl tagged with the setting as the arm and the process's number as the rep.
#     bash export/results/s58_blasvar.sh [budget_s]      # default 300 s
# Session 58's one call ran this script's first form (b2d0c30: a standalone probe, two allocations a role, separate
# tensors, no allocator setting) as `PROCS=6 VAR_CAP=45 bash export/results/s58_blasvar.sh 330` (h100_s58_call1_*).
# Session 59 ran on an H100 (h100_s59_call1_*; export/results/README.md, "The allocator's expandable segments"):
#   PROCS=4 VAR_CAP=60 ALLOC_CONFS="- expandable_segments:True" ROUNDS=2 LAYOUTS=separate,one \
#     bash export/results/s58_blasvar.sh 220
BUDGET=${1:-300} TAG=s58
source export/results/device_call.sh
read -ra confs <<< "${ALLOC_CONFS:--}"
for p in $(seq 1 "${PROCS:-6}"); do
  conf=${confs[$(( (p - 1) % ${#confs[@]} ))]}
  PYTORCH_CUDA_ALLOC_CONF=${conf#-} run_arm /tmp/pkg "${conf//[:=,]/_}" "$p" blasvar "${VAR_CAP:-60}" blas_algos \
    --config 31b --rows "${ROWS:-64}" --roles "${ROLES:-sliding.self_attn.qkv,full.mlp.gate_up}" \
    --max-candidates 0 --rounds "${ROUNDS:-2}" --layouts "${LAYOUTS:-separate}"
done
python3 - "$OUT/blasvar.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r["stage"] == "baseline":
        print(r["arm"], r["rep"], r["role"], r["layout"], r["round"], r["cublas_ms"], r["cublaslt_ms"],
              sorted({k[:48] for k in r["cublas_kernels"] + r["cublaslt_kernels"]}))
PY
finish_call
