#!/usr/bin/env bash
# Session 58's device calls (any card): export/results/s58_blasvar.py in $PROCS (default 6) fresh processes of at most
# $VAR_CAP s (default 40), their lines in $OUT/blasvar.jsonl tagged with the process's number and its allocator
# setting; the first process also under CUBLASLT_LOG_LEVEL=2 (cuBLASLt's trace of the calls torch's cuBLAS path
# makes, gzipped). $VAR_ARGS: the script's arguments (rows, rounds, layouts, roles); $ALLOC_CONFS: space-separated
# PYTORCH_CUDA_ALLOC_CONF values the processes cycle through ("-" for none; default "-").
#     bash export/results/s58_blasvar.sh [budget_s]      # default 300 s
BUDGET=${1:-300} TAG=s58
source export/results/device_call.sh
read -ra confs <<< "${ALLOC_CONFS:--}"
for p in $(seq 1 "${PROCS:-6}"); do
  conf=${confs[$(( (p - 1) % ${#confs[@]} ))]}
  [ "$conf" = - ] && conf=
  if [ "$p" = 1 ]; then
    PYTORCH_CUDA_ALLOC_CONF=$conf CUBLASLT_LOG_LEVEL=2 CUBLASLT_LOG_FILE=$OUT/ltlog_%i.txt run_part "blasvar_$p" \
      "${VAR_CAP:-40}" python3 export/results/s58_blasvar.py ${VAR_ARGS:-}
  else
    PYTORCH_CUDA_ALLOC_CONF=$conf run_part "blasvar_$p" "${VAR_CAP:-40}" python3 export/results/s58_blasvar.py ${VAR_ARGS:-}
  fi
  grep '^{' "$OUT/blasvar_$p.log" | python3 -c "import json,sys; [print(json.dumps({'proc': int(sys.argv[1]),
    'alloc_conf': sys.argv[2], **json.loads(l)})) for l in sys.stdin]" "$p" "$conf" >> "$OUT/blasvar.jsonl"
  grep '^{' "$OUT/blasvar_$p.log" | python3 -c "import json,sys; [print(sys.argv[1], sys.argv[2], (r:=json.loads(l))['role'],
    r['layout'], r['alloc'], r['lib'], r['ms'], r['GBps'], [k[:50] for k in r['kernels']]) for l in sys.stdin]" "$p" "$conf"
done
gzip "$OUT"/ltlog_*.txt 2>/dev/null
finish_call
