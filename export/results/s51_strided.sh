#!/usr/bin/env bash
# Session 51's device calls: the packed gate/up with the residual step in its prologue on PROLOGUE_PROGRAMS programs
# an SM (plugins/triton_gemv.py's prologue_programs; each program every P-th column block) against a program a block.
#   bash export/results/s51_strided.sh [budget_s]          # results under $OUT/all.tgz
# 1. $FORMS_REPS processes (default 2) of `bench.gemv_sweep --op-only --forms gelu,norm-gelu --programs 0,2,3` on
#    the E2B's packed gate/up [12,288 x 1,536] and double-wide one [24,576 x 1,536] and the E4B's [20,480 x 2,560]
#    (each form on the plan, a program a block, 2 and 3 programs an SM; in one process, so against each other)
# 2. the batch-1 steps of $MODELS (default e4b e2b), arms $ARMS alternated (default "new pre new pre new pre": this
#    checkout and ab/pre, a `git archive --prefix=ab/pre/g4rt/ REV | tar -x` of the tree before, carried), a
#    process each of at most $B1_CAP s (default 70): `bench.engine --config M --skip-hf --batches 1 --new-tokens 32
#    --profile`
set -u
BUDGET=${1:-570}
TAG=s51
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
for r in $(seq "${FORMS_REPS:-2}"); do
  run_part "forms_$r" 120 python3 -m g4rt.bench.gemv_sweep --op-only --forms gelu,norm-gelu --programs 0,2,3 \
    --shape 12288 1536 --shape 24576 1536 --shape 20480 2560 --reps 15 --out "$OUT/forms_$r"
done
batch1 "${B1_CAP:-70}" "e4b e2b" "new pre new pre new pre"
finish_call
cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz all.tgz
