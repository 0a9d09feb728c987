#!/usr/bin/env bash
# H200 calls of session 18, a fresh process per arm, arms alternated. One PART per call:
#
#   kern    the Gluon head-dim-512 prefill kernel (plugins/gluon_attention.py): its tests on the GPU
#           (tests/test_plugins_gluon.py: poisoned arenas against the reference and the Triton kernel), then the
#           31B full layer's 8k chunk, the default tile and each config of $CONFIGS (a JSON list; by default the
#           Triton kernel, '[{"wgmma": false}]'), three processes (`bench.kernels --prefill-only --layers
#           31B-full --configs "$CONFIGS"`).
#   engine  the 31B's 8k time to first token with chunks of 2,048 and 8,192 (one process, profiled) and the
#           E2B's staggered requests (piecewise steps against the compiled module, tokens against eager).
#   ttft    the GPU tests; the default against a6f9096 (ab/base: session 17's Triton kernel with copies): the
#           31B's time to first token of 2,048 and 8,192 tokens with the engine's 2,048-token chunks, three
#           processes per arm alternated; then, new only, the sliding layer's (head dim 256) 8k chunk
#           (`bench.kernels --prefill-only --layers 31B-sliding --configs '[]'`: its default alone).
#   b1      the models of $MODELS (default 31b) at batch 1 (`bench.engine --config M --skip-hf --batches 1
#           --new-tokens 32`): the 128-token prompt's full layers take the kernel in the eager and the compiled
#           engine; greedy tokens against eager.
#
# The calls, each on the tree named (calls 1-5 measured options of the kernel since folded in or dropped; a
# `wgmma` dict passed them as prefill_attention's keywords, which the tree at HEAD no longer has):
#   1  eab43f5           kern  CONFIGS='[{"wgmma": true}]' (then not the default)
#   2  eab43f5 + plugins/results/h200_s18_call2_options.patch (git apply; not committed as a tree)
#                        kern  '[{"wgmma": {"k_ahead": 0, "row_sums": 0, "lazy": 0}}, {"wgmma": {"k_ahead": 1,
#                               "row_sums": 1, "lazy": 1}}, {"wgmma": {"k_ahead": 1, "row_sums": 1, "lazy": 0}},
#                               {"wgmma": {"k_ahead": 0, "row_sums": 1, "lazy": 0}},
#                               {"wgmma": {"k_ahead": 1, "row_sums": 0, "lazy": 0}}]'
#                        (a830042 keeps k_ahead and row_sums, drops lazy)
#   3  a830042           kern  '[{"wgmma": {"overlap": 0}}, {"wgmma": {"overlap": 1}}]'
#   4  c1cabcb           kern  '[{"wgmma": {"one_sync": 0}}, {"wgmma": {"one_sync": 1}},
#                               {"wgmma": {"one_sync": 1, "skip_rescale": 1}}]'
#   5  ddcb223           kern  '[{"wgmma": {"prefetch_pages": 0}}, {"wgmma": {"prefetch_pages": 1}}, {"wgmma": false}]',
#                        then engine (the Gluon kernel the default from this call on)
#   6  (refused: no machine)
#   7  4ed2c2f           ttft
#   8  a00500a           b1 (MODELS=31b)
#   9  b62d258           b1 (MODELS=e4b)
#
#     git archive --prefix=ab/base/g4rt/ a6f9096 | tar -x    # the base arm of ttft
#     bash export/results/s18_h200.sh PART [budget_s]       # default 570 s; results under $OUT
PART=${1:?PART: kern, engine, ttft or b1}
BUDGET=${2:-570}
TAG=s18-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  kern)
    run_part gluon_tests 240 python3 -m pytest -q -x tests/test_plugins_gluon.py
    cp "$OUT/gluon_tests.log" "$OUT/gluon_tests.txt"
    configs=${CONFIGS:-'[{"wgmma": false}]'}
    for rep in 1 2 3; do
      run_part prefill_$rep 100 python3 -m g4rt.bench.kernels --out "$OUT/p$rep" --prefill-only --layers 31B-full \
        --configs "$configs"
      cp "$OUT/p$rep/results.json" "$OUT/prefill_d512_$rep.json" 2>/dev/null; rm -rf "$OUT/p$rep"
    done
    ;;
  engine)
    arm new 1 ttft_31b 200 engine --config 31b --skip-hf --batches "" --engines inductor --ttft 8192 \
      --ttft-chunks 2048,8192 --reps 3 --profile
    run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    ;;
  ttft)
    run_part gluon_tests 240 python3 -m pytest -q -x tests/test_plugins_gluon.py
    cp "$OUT/gluon_tests.log" "$OUT/gluon_tests.txt"
    for rep in 1 2 3; do
      for a in base new; do
        arm $a $rep ttft_31b 90 engine --config 31b --skip-hf --batches "" --engines inductor --ttft 2048,8192 \
          --ttft-chunks 2048 --reps 3
      done
    done
    run_part prefill_d256 80 python3 -m g4rt.bench.kernels --out "$OUT/p" --prefill-only --layers 31B-sliding \
      --configs '[]'
    cp "$OUT/p/results.json" "$OUT/prefill_d256.json" 2>/dev/null; rm -rf "$OUT/p"
    ;;
  b1)
    for m in ${MODELS:-31b}; do arm new 1 b1_$m 150 engine --config $m --skip-hf --batches 1 --new-tokens 32; done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
