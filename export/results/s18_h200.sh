#!/usr/bin/env bash
# H200 calls of session 18, a fresh process per arm, arms alternated. One PART per call:
#
#   gluon  the Gluon head-dim-512 prefill kernel (plugins/gluon_attention.py): its tests on the GPU
#          (tests/test_plugins_gluon.py: poisoned arenas against the reference and the Triton kernel), then the
#          31B full layer's 8k chunk, the default (Triton) tile against `wgmma`, three processes alternated
#          (`bench.kernels --prefill-only --layers 31B-full --configs '[{"wgmma": true}]'`).
#
#   gvar   the Gluon kernel's options (prefill_attention's keywords), the tests with the defaults first, then the
#          8k chunk of `gluon` for the default tile and each option set of $GVAR (a JSON list), three processes.
#          Call 2 ran k_ahead / row_sums / lazy (since folded in: k_ahead and row_sums kept, lazy dropped),
#          call 3 overlap 0 / 1 (since folded in: overlap kept), call 4 one_sync 0 / 1 and skip_rescale.
#
#     bash export/results/s18_h200.sh PART [budget_s]       # default 570 s; results under $OUT
PART=${1:?PART: gluon or gvar}
BUDGET=${2:-570}
TAG=s18-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  gluon)
    run_part gluon_tests 240 python3 -m pytest -q -x tests/test_plugins_gluon.py
    cp "$OUT/gluon_tests.log" "$OUT/gluon_tests.txt"
    for rep in 1 2 3; do
      run_part prefill_$rep 100 python3 -m g4rt.bench.kernels --out "$OUT/p$rep" --prefill-only --layers 31B-full \
        --configs '[{"wgmma": true}]'
      cp "$OUT/p$rep/results.json" "$OUT/prefill_d512_$rep.json" 2>/dev/null; rm -rf "$OUT/p$rep"
    done
    ;;
  gvar)
    run_part gluon_tests 240 python3 -m pytest -q -x tests/test_plugins_gluon.py
    cp "$OUT/gluon_tests.log" "$OUT/gluon_tests.txt"
    v=${GVAR:-'[{"wgmma": {"one_sync": 0}}, {"wgmma": {"one_sync": 1}}, {"wgmma": {"one_sync": 1, "skip_rescale": 1}}]'}
    for rep in 1 2 3; do
      run_part prefill_$rep 100 python3 -m g4rt.bench.kernels --out "$OUT/p$rep" --prefill-only --layers 31B-full \
        --configs "$v"
      cp "$OUT/p$rep/results.json" "$OUT/prefill_d512_$rep.json" 2>/dev/null; rm -rf "$OUT/p$rep"
    done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
