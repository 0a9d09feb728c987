#!/usr/bin/env bash
# Session 51's device calls: the packed gate/up with the residual step in its prologue on two programs an SM, each
# taking every P-th column block (`strided`: this checkout with s51_strided_plan.patch), and with that prologue a row
# in chunks (`chunk`: with s51_chunked_prologue.patch), against this checkout (a program a block, the row whole).
#   bash export/results/s51_strided.sh [budget_s]          # results under $OUT/all.tgz
# Parts 1-2, the compile report's --gemv-programs, gemv_sweep's --programs and the strided patch need a tree of session
# 51 (e.g. c600e85): the strided launch was measured slower in session 52 and removed (export/results/README.md).
# Trees: new = this checkout; any other T = ab/T, carried:
#   git archive --prefix=ab/strided/g4rt/ HEAD | tar -x; (cd ab/strided/g4rt && patch -p1 < ../../../export/results/s51_strided_plan.patch)
#   git archive --prefix=ab/chunk/g4rt/ HEAD | tar -x; (cd ab/chunk/g4rt && patch -p1 < ../../../export/results/s51_chunked_prologue.patch)
# 1. the device's Triton's compile of the norm-gelu launch on the three shapes below, a program a block and 264
#    programs strided, for each tree of $CR_TREES (default "new chunk"): `bench.compile_report --gemv N K --form
#    norm-gelu [--gemv-programs 264]`, one JSON line each (less its IR) in $OUT/compile.jsonl
# 2. for each tree of $FORM_TREES (default "new chunk"), a process of `bench.gemv_sweep --op-only --forms
#    gelu,norm-gelu --programs 2,3` on the E2B's packed gate/up [12,288 x 1,536] and double-wide one [24,576 x
#    1,536] and the E4B's [20,480 x 2,560] (each form on the plan, a program a block, then 2 and 3 programs an SM,
#    in one process, against each other), $FORMS_REPS rounds (default 1)
# 3. the batch-1 steps of $MODELS (default e4b), arms $ARMS alternated (default "new chunk strided new chunk strided
#    chunk"), a process each of at most $B1_CAP s (default 65): `bench.engine --config M --skip-hf --batches 1
#    --new-tokens 32 --profile`
set -u
BUDGET=${1:-570}
TAG=s51
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
tree() { [ "$1" = new ] && echo /tmp/pkg || echo "$PWD/ab/$1"; }
for t in ${CR_TREES-new chunk}; do
  for s in "12288 1536" "24576 1536" "20480 2560"; do
    for p in "" "--gemv-programs 264"; do
      PYTHONPATH=$(tree "$t") timeout 60 python3 -m g4rt.bench.compile_report --gemv $s --form norm-gelu $p 2>/dev/null \
        | tail -1 | python3 -c "import json,sys; print(json.dumps({'tree': sys.argv[1], 'shape': sys.argv[2],
          **json.loads(sys.stdin.read())}))" "$t" "$s" >> "$OUT/compile.jsonl"
    done
  done
done
cut -c1-200 "$OUT/compile.jsonl"
for r in $(seq "${FORMS_REPS:-1}"); do
  for t in ${FORM_TREES-new chunk}; do
    PYTHONPATH=$(tree "$t") run_part "forms_${t}_$r" 120 python3 -m g4rt.bench.gemv_sweep --op-only \
      --forms gelu,norm-gelu --programs 2,3 --shape 12288 1536 --shape 24576 1536 --shape 20480 2560 --reps 15 \
      --out "$OUT/forms_${t}_$r"
  done
done
batch1 "${B1_CAP:-65}" "e4b" "new chunk strided new chunk strided"
finish_call
cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz all.tgz
