#!/usr/bin/env bash
# Session 53's device call: cuBLASLt's own algorithms for the 31B's K > N decode matmuls, and the step with the
# fastest where it beats torch's path.
#     bash export/results/s53_algos.sh [budget_s]      # default 570 s; results under $OUT
# 1. `bench.blas_algos --config 31b --rows $ROWS --roles $ROLES` (default 64,128 and o_proj,down_proj): the
#    heuristic's candidates and their split-K variants, checked against fp32 and timed over every layer's weight of
#    a role in one CUDA graph, beside torch's F.linear through cuBLAS and cuBLASLt ($OUT/blas_algos.jsonl); the
#    winners (2 % or more) written into a copy of this checkout, ab/lt (its plugins/cublaslt_algos.json, kept as
#    $OUT/cublaslt_algos.json)
# 2. ab/lt's GPU tests of the plugin (tests/test_plugins_cublaslt.py, and blas_linear's in test_plugins_gemv.py)
# 3. the 31B's decode step at batch $STEPS (default 64), this checkout (torch's path) against ab/lt, arms $ARMS
#    alternated (default "bf16 lt/bf16 lt/bf16 bf16 bf16 lt/bf16"), a process each of at most $STEPS_CAP s
#    (default 75): `s36_h200.sh steps` ($OUT/s/)
BUDGET=${1:-570} TAG=s53
source export/results/device_call.sh
mkdir -p ab/lt/g4rt && tar -c --exclude=./ab --exclude=./.venv --exclude=./.git . | tar -x -C ab/lt/g4rt
rm -f ab/lt/g4rt/plugins/cublaslt_algos.json
run_part algos "${ALGOS_CAP:-170}" python3 -m g4rt.bench.blas_algos --config 31b --rows "${ROWS:-64,128}" \
  --roles "${ROLES:-o_proj,down_proj}" --out "$OUT" --write ab/lt/g4rt/plugins/cublaslt_algos.json
cp ab/lt/g4rt/plugins/cublaslt_algos.json "$OUT/" || { echo "[$TAG] no table written"; finish_call; exit 0; }
(cd ab/lt/g4rt && PYTHONPATH=$PWD/.. run_part gpu_tests_lt 90 python3 -m pytest -q -p no:cacheprovider \
  tests/test_plugins_cublaslt.py tests/test_plugins_gemv.py -k "cublaslt or blas_linear")
tail -3 "$OUT/gpu_tests_lt.log"
left=$((BUDGET - (SECONDS - T0) - 15)); mkdir -p "$OUT/s"
OUT=$OUT/s STEPS=${STEPS:-64} ARMS="${ARMS:-bf16 lt/bf16 lt/bf16 bf16 bf16 lt/bf16}" STEPS_CAP=${STEPS_CAP:-75} \
  bash export/results/s36_h200.sh steps $left 2>&1 | grep -v '^{' | tail -30
finish_call
