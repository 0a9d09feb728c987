#!/usr/bin/env bash
# H200 calls of session 16, a fresh process per arm, arms alternated. One PART per call:
#
#   small  the gated GELU in the skinny matmul's epilogue (`g4rt::gelu_linear`: the packed gate/up and the
#          PLE gate form gelu_tanh(gate) * up from their rounded sums, the gelu launch gone) against the
#          session-15 code (ab/base: 43c3137): its bits on the GPU against skinny_linear then the gelu
#          kernel; batch 1 of the E4B (three processes per arm) and the E2B (two), base and new.
#   prefetch  the skinny matmul asking L2 for its weight before it waits for the kernel before it (up to
#          PREFETCH_BYTES a launch) against 65c97eb (ab/base): batch 1 of the E4B and the E2B, two
#          processes per arm, arms base, new (65c97eb with h200_s16_prefetch.patch applied, 16 MiB; the code
#          is not in the tree) and p48 (ab/p48: the same with PREFETCH_BYTES = 48 << 20).
#   large  batch 1 of the 31B and the 26B-A4B (`bench.moe`), base and new, two processes per arm; the E2B's
#          third process per arm; its staggered requests (piecewise steps against the compiled module,
#          tokens against eager), new only.
#
#     git archive --prefix=ab/base/g4rt/ 43c3137 | tar -x    # the base arm (65c97eb for prefetch)
#     bash export/results/s16_h200.sh PART [budget_s]       # default 560 s; results under $OUT
PART=${1:?PART: small or large}
BUDGET=${2:-560}
TAG=s16-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
small=(--skip-hf --batches 1 --new-tokens 32 --profile)
case $PART in
  small)
    # On the GPU, the epilogue's bits against skinny_linear then the gelu kernel, the model's shapes and rows.
    run_part check 60 python3 - <<'PY'
import torch
from g4rt.plugins import triton_gemv as tg, triton_norm as tn
for name, (n, k) in {"e2b gate_up": (12288, 1536), "e2b wide gate_up": (24576, 1536), "e4b gate_up": (20480, 2560),
                     "31b gate_up": (43008, 5376), "e2b ple gate": (256, 1536), "e4b ple gate": (256, 2560)}.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    for m in (1, 2, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.ops.g4rt.skinny_linear(x, w)
        if "ple" in name:
            up = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            got, want = torch.ops.g4rt.gelu_linear(x, w, up), tn.gelu_tanh_mul(y, up)
        else:
            got, want = torch.ops.g4rt.gelu_linear(x, w, None), tn.gelu_tanh_mul(*y.split(n // 2, dim=1))
        print(f"{name} rows {m}: plan {tg.gemv_plan(n, k, w.device)}, bit-equal {torch.equal(got, want)}")
PY
    for rep in 1 2 3; do
      for a in base new; do arm $a $rep b1_e4b 70 engine --config e4b "${small[@]}"; done
      [ $rep -lt 3 ] && for a in base new; do arm $a $rep b1_e2b 55 engine --config e2b "${small[@]}"; done
    done
    ;;
  prefetch)
    for rep in 1 2; do
      for a in base new p48; do
        arm $a $rep b1_e4b 60 engine --config e4b "${small[@]}"
        arm $a $rep b1_e2b 50 engine --config e2b "${small[@]}"
      done
    done
    ;;
  large)
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep b1_31b 130 engine --config 31b "${small[@]}"
        arm $a $rep b1_26b $((rep == 1 ? 150 : 110)) moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile
      done
    done
    for a in base new; do arm $a 3 b1_e2b 50 engine --config e2b "${small[@]}"; done
    run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
