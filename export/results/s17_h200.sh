#!/usr/bin/env bash
# H200 calls of session 17, a fresh process per arm, arms alternated. One PART per call:
#
#   kern   the head-dim-512 prefill tiles with the interior key tiles by tensor-memory copies (`tma`,
#          plugins/triton_attention.kv_descriptors) beside the element loads: `bench.kernels --prefill-only
#          --layers 31B-full` (PREFILL_SWEEP); then batch 1 of the 31B, this tree (new) against the
#          session-15 code (ab/base: 43c3137), arms new, base, new: the packed gate/up above
#          EPILOGUE_MAX_BYTES back on the plain launch and the gelu kernel.
#   ttft   the tensor-memory copies as the head-dim-512 prefill default, this tree (new) against 9333dcd
#          (ab/base: element loads): the 31B's 8k time to first token, one 8,192 chunk, profiled, two
#          processes per arm; the E2B's staggered requests (piecewise steps against the compiled module,
#          tokens against eager; its full layers take the copies), new only.
#   ttft3  three more processes per arm of `ttft`'s 8k time to first token (repetitions 3-5); then, new
#          only, 2,048 and 8,192 tokens with chunks of 2,048 and 8,192.
#   roles  the E4B's and the E2B's decode matmuls role by role at batch 1 (`bench.engine --matmuls`): cuBLAS,
#          every GEMV_CONFIGS tile, the cuts over K, and the plan g4rt::skinny_linear takes.
#   plan   the weights narrower than any tile makes 3/5 of the SMs' worth of blocks (PLE gates, the router)
#          on the 32-column tile cut over K (gemv_plan, NARROW_SPLIT_MIN_K), this tree (new) against 2e34944
#          (ab/base): batch 1 of the E4B (two processes per arm), the 26B-A4B and the E2B (one).
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x    # the base arm: 43c3137 for kern, 9333dcd for ttft
#     bash export/results/s17_h200.sh PART [budget_s]       # default 570 s; results under $OUT
PART=${1:?PART: kern, ttft, ttft3, roles or plan}
BUDGET=${2:-570}
TAG=s17-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
small=(--skip-hf --batches 1 --new-tokens 32 --profile)
case $PART in
  kern)
    run_part prefill_d512 200 python3 -m g4rt.bench.kernels --out "$OUT/p" --prefill-only --layers 31B-full
    cp "$OUT/p/results.json" "$OUT/prefill_d512.json" 2>/dev/null; cp "$OUT/p/results.md" "$OUT/prefill_d512.md" 2>/dev/null
    rm -rf "$OUT/p"
    arm new 1 b1_31b 125 engine --config 31b "${small[@]}"
    arm base 1 b1_31b 125 engine --config 31b "${small[@]}"
    arm new 2 b1_31b 125 engine --config 31b "${small[@]}"
    ;;
  ttft|ttft3)
    reps=(1 2); [ $PART = ttft3 ] && reps=(3 4 5)
    for rep in "${reps[@]}"; do
      for a in base new; do
        arm $a $rep ttft_31b 100 engine --config 31b --skip-hf --batches "" --engines inductor --ttft 8192 \
          --ttft-chunks 8192 --reps 3 --profile
      done
    done
    [ $PART = ttft ] && run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    [ $PART = ttft ] && { cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"; }
    [ $PART = ttft3 ] && arm new 1 ttft_chunks_31b 250 engine --config 31b --skip-hf --batches "" --engines inductor \
      --ttft 2048,8192 --ttft-chunks 2048,8192 --reps 3
    ;;
  roles)
    for m in e4b e2b; do
      run_part matmuls_$m 120 python3 -m g4rt.bench.engine --config $m --out "$OUT/m_$m" --skip-hf --batches 1 --matmuls
      cp "$OUT/m_$m/export_bench.jsonl" "$OUT/matmuls_$m.jsonl" 2>/dev/null; rm -rf "${OUT:?}/m_$m"
    done
    ;;
  plan)
    for rep in 1 2; do
      for a in base new; do arm $a $rep b1_e4b 60 engine --config e4b "${small[@]}"; done
    done
    for a in base new; do arm $a 1 b1_26b 100 moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile; done
    for a in base new; do arm $a 1 b1_e2b 50 engine --config e2b "${small[@]}"; done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
