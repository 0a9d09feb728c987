#!/usr/bin/env bash
# Session 58's device call (any card): export/results/s58_blasvar.py in $PROCS (default 6) fresh processes of at most
# $VAR_CAP s (default 40), their lines in $OUT/blasvar.jsonl tagged with the process's number; the first process also
# under CUBLASLT_LOG_LEVEL=2 (cuBLASLt's trace of the calls torch's cuBLAS path makes, gzipped).
#     bash export/results/s58_blasvar.sh [budget_s]      # default 300 s
BUDGET=${1:-300} TAG=s58
source export/results/device_call.sh
for p in $(seq 1 "${PROCS:-6}"); do
  if [ "$p" = 1 ]; then
    CUBLASLT_LOG_LEVEL=2 CUBLASLT_LOG_FILE=$OUT/ltlog_%i.txt run_part "blasvar_$p" "${VAR_CAP:-40}" \
      python3 export/results/s58_blasvar.py "${VAR_ROWS:-64}"
  else
    run_part "blasvar_$p" "${VAR_CAP:-40}" python3 export/results/s58_blasvar.py "${VAR_ROWS:-64}"
  fi
  grep '^{' "$OUT/blasvar_$p.log" | python3 -c "import json,sys; [print(json.dumps({'proc': int(sys.argv[1]),
    **json.loads(l)})) for l in sys.stdin]" "$p" >> "$OUT/blasvar.jsonl"
  grep '^{' "$OUT/blasvar_$p.log" | python3 -c "import json,sys; [print(sys.argv[1], (r:=json.loads(l))['role'],
    r['alloc'], r['lib'], r['ms'], r['GBps'], [k[:70] for k in r['kernels']]) for l in sys.stdin]" "$p"
done
gzip "$OUT"/ltlog_*.txt 2>/dev/null
finish_call
